"""Train the quick-start's CNN on MNIST with DistributedDataParallel (PAI-DLC quick start, part 4).

On DLC (one process per GPU; DLC sets WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT per node):
  torchrun --nproc_per_node=1 --nnodes=${WORLD_SIZE} --node_rank=${RANK} \\
      --master_addr=${MASTER_ADDR} --master_port=${MASTER_PORT} /mnt/data/mnist_train_distributed.py
Locally:  torchrun --standalone --nproc_per_node=2 mnist_train_distributed.py --data-dir ./data --output-dir ./output

Only global rank 0 writes: <output-dir>/best_model.pth (a state_dict with the single script's
keys), <output-dir>/checkpoint.pth and TensorBoard logs under <output-dir>/runs/mnist_experiment.
"""
import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

import common


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    # Hyperparameters: the document's values are the defaults. --batch-size is per process.
    parser.add_argument('--batch-size', type=common.positive(int), default=64, help='batch size of each process (default: 64)')
    parser.add_argument('--lr', type=common.positive(float), default=0.01, help='SGD learning rate (default: 0.01)')
    parser.add_argument('--epochs', type=common.positive(int), default=20, help='number of epochs (default: 20)')
    parser.add_argument('--data-dir', default='/mnt/data/dataSet',
                        help='torchvision root: the files live in <data-dir>/MNIST/raw (default: /mnt/data/dataSet)')
    parser.add_argument('--output-dir', default='/mnt/data/output_distributed',
                        help='best_model.pth, checkpoint.pth and runs/ go here (default: /mnt/data/output_distributed)')
    parser.add_argument('--log-interval', type=common.positive(int), default=100,
                        help='batches between training-loss lines (default: 100)')
    parser.add_argument('--val-batch-size', type=common.positive(int), default=1000,
                        help='validation batch size; does not change the results (default: 1000)')
    parser.add_argument('--seed', type=int, default=0, help='seed for the initial weights and the data order (default: 0)')
    parser.add_argument('--device', choices=['cuda', 'cpu'], default='cuda' if torch.cuda.is_available() else 'cpu',
                        help='cuda (GPU LOCAL_RANK) or cpu (default: cuda if available, else cpu)')
    parser.add_argument('--backend', choices=['nccl', 'gloo'],
                        help='process-group backend (default: nccl on cuda, gloo on cpu)')
    parser.add_argument('--no-resume', action='store_true',
                        help='ignore <output-dir>/checkpoint.pth and start from epoch 0 (default: resume)')
    parser.add_argument('--debug', action='store_true', help='show tracebacks for set-up errors (default: off)')
    return parser.parse_args()


def on_ranks(selected, fn):
    """Run fn where selected is true; return rank 0's result on every rank.

    If fn fails anywhere, every rank raises, so none is left waiting in a collective forever.
    """
    result, error = None, None
    if selected:
        try:
            result = fn()
        except Exception as e:
            error = e
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (result, None if error is None else str(error)))
    if error is not None:
        raise error
    for rank, (_, message) in enumerate(gathered):
        if message is not None:
            raise common.SetupError(f'rank {rank} failed during set-up: {message}')
    return gathered[0][0]


def main(args):
    # torchrun sets RANK, WORLD_SIZE and LOCAL_RANK for each process; MASTER_* too.
    env_names = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')
    missing = [name for name in env_names if name not in os.environ]
    standalone = not any(name in os.environ for name in env_names[:3])
    if standalone:
        print('Not started by torchrun (no RANK, WORLD_SIZE, LOCAL_RANK): running as a world of one process.')
    elif missing:
        raise common.SetupError(
            f'the distributed environment is half set: {", ".join(missing)} missing while '
            f'{", ".join(n for n in env_names if n not in missing)} are set. Start the script with '
            f'torchrun, which sets them all (on DLC: the torchrun line in the README, whose '
            f'--nnodes and --node_rank take DLC\'s WORLD_SIZE and RANK).')
    rank = int(os.environ.get('RANK', 0))
    world_size = int(os.environ.get('WORLD_SIZE', 1))
    local_rank = int(os.environ.get('LOCAL_RANK', 0))
    backend = args.backend or ('nccl' if args.device == 'cuda' else 'gloo')
    if args.device == 'cuda' or backend == 'nccl':
        if not torch.cuda.is_available():
            raise common.SetupError(f'--device {args.device} with backend {backend} needs CUDA, which '
                                    f'is not available here; pass --device cpu (gloo) or run on GPU nodes.')
        if local_rank >= torch.cuda.device_count():
            raise common.SetupError(f'LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs on '
                                    f'this node: start at most that many processes per node (--nproc_per_node).')
    if backend == 'nccl' and args.device != 'cuda':
        raise common.SetupError('backend nccl works on GPUs only: pass --device cuda, or --backend gloo.')

    if args.device == 'cuda':
        torch.cuda.set_device(local_rank)  # before the process group, so NCCL binds this GPU
        device = torch.device('cuda', local_rank)
    else:
        device = torch.device('cpu')
    if standalone:  # an in-memory store instead of a master address
        store = dist.HashStore()
    else:
        # torchrun's store at MASTER_ADDR:MASTER_PORT (hosted by rank 0 under other launchers), with
        # keys kept apart per restart: torch 2.14's torchrun keeps its store across --max-restarts
        # attempts, and a restarted rank would otherwise read the address of a dead one.
        agent_store = os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True'
        store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), world_size,
                              is_master=rank == 0 and not agent_store, timeout=timedelta(minutes=30))
        store = dist.PrefixStore(f'attempt_{os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}', store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    print(f'Rank {rank}/{world_size} (local rank {local_rank}, pid {os.getpid()}) on {device} with {backend}')

    # Rank 0 owns the output folder: it checks it can write there and reads any checkpoint,
    # before any data is read; every rank gets the checkpoint from it.
    checkpoint_path = os.path.join(args.output_dir, 'checkpoint.pth')
    best_model_path = os.path.join(args.output_dir, 'best_model.pth')

    def check_output_and_read_checkpoint():
        common.check_writable(args.output_dir)
        if os.path.exists(checkpoint_path) and not args.no_resume:
            return common.read_checkpoint(checkpoint_path)
    checkpoint = on_ranks(rank == 0, check_output_and_read_checkpoint)
    if checkpoint is not None and checkpoint['epochs_done'] >= args.epochs:
        if rank == 0:
            print(f'Training already complete: {checkpoint_path} has {checkpoint["epochs_done"]} '
                  f'epochs, best accuracy {checkpoint["best_val_accuracy"]:.2f}% at epoch '
                  f'{checkpoint["best_epoch"]} in {best_model_path}. Pass a larger --epochs to '
                  f'train on, or --no-resume to start over.')
        dist.destroy_process_group()
        return

    # Data: global rank 0 downloads first (one download on a shared mount); then the first
    # process of each other node fetches its own copy if it still sees none (node-local disks).
    # Everyone else only reads, after both rounds.
    on_ranks(rank == 0, lambda: common.prepare_mnist(args.data_dir))
    on_ranks(local_rank == 0 and rank != 0, lambda: common.prepare_mnist(args.data_dir))
    common.prepare_mnist(args.data_dir, download=False)
    train_images, train_labels = common.load_mnist(args.data_dir, train=True, device=device)
    val_images, val_labels = common.load_mnist(args.data_dir, train=False, device=device)
    # Training: DistributedSampler's share, reshuffled by set_epoch. Validation: a disjoint
    # share per rank with no padding, so the summed counts are exactly the test set.
    train_loader = common.TensorLoader(train_images, train_labels, args.batch_size, shuffle=True,
                                       seed=args.seed, rank=rank, world_size=world_size)
    val_loader = common.TensorLoader(*common.shard([val_images, val_labels], rank, world_size),
                                     args.val_batch_size)

    torch.manual_seed(args.seed)
    model = common.SimpleCNN().to(device, memory_format=common.SimpleCNN.memory_format(device))
    if checkpoint is not None:
        model.load_state_dict(checkpoint['model'])
    # DDP copies rank 0's weights to every rank here; device_ids only for a GPU module.
    model = DDP(model, device_ids=[local_rank] if device.type == 'cuda' else None)
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.SGD(model.parameters(), lr=args.lr)
    start_epoch, best_val_accuracy, best_epoch = 0, 0.0, None
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint['optimizer'])
        start_epoch = checkpoint['epochs_done']
        best_val_accuracy, best_epoch = checkpoint['best_val_accuracy'], checkpoint['best_epoch']
        if rank == 0:
            print(f'Resuming from epoch {start_epoch} ({checkpoint_path}; best accuracy so far '
                  f'{best_val_accuracy:.2f}%)')
    elif rank == 0:
        common.set_aside(best_model_path)

    if rank == 0:  # purge_step: TensorBoard hides an interrupted run's steps from here on
        writer = SummaryWriter(os.path.join(args.output_dir, 'runs', 'mnist_experiment'),
                               purge_step=start_epoch * len(train_loader))
    run_start = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        epoch_start = time.perf_counter()
        train_loader.set_epoch(epoch)
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = criterion(output, target)
            loss.backward()  # DDP averages the gradients across ranks here
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                loss_value = loss.item()  # the only host sync in the loop, as in the document
                print(f'Rank: {rank}, Local_Rank: {local_rank} -- Train Epoch: {epoch} '
                      f'[{batch_idx * len(data) * world_size}/{len(train_loader.dataset)} '
                      f'({100. * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss_value:.6f}')
                if rank == 0:
                    writer.add_scalar('Loss/train', loss_value, epoch * len(train_loader) + batch_idx)

        # Validation: each rank its own share; sums on the device, one all-reduce, one sync.
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
        with torch.no_grad():
            for data, target in val_loader:
                output = model(data)
                totals[0] += F.cross_entropy(output, target, reduction='sum')
                totals[1] += (output.argmax(dim=1) == target).sum()
                totals[2] += len(target)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        val_loss_sum, correct, total = totals.tolist()
        val_loss = val_loss_sum / total
        val_accuracy = 100. * correct / total
        correct, total = int(correct), int(total)
        improved = val_accuracy > best_val_accuracy
        if improved:  # on every rank, so all keep the same record
            best_val_accuracy, best_epoch = val_accuracy, epoch
        if rank == 0:
            print(f'Validation Loss: {val_loss:.4f}, Accuracy: {correct}/{total} ({val_accuracy:.0f}%)')
            writer.add_scalar('Loss/validation', val_loss, epoch)
            writer.add_scalar('Accuracy/validation', val_accuracy, epoch)
            if improved:
                # model.module: the plain model, so the keys carry no 'module.' prefix.
                common.save_atomic(model.module.state_dict(), best_model_path)
                print(f'Model saved with accuracy: {best_val_accuracy:.2f}%')
            writer.flush()  # the logs first, then the checkpoint
            common.save_atomic({'model': model.module.state_dict(), 'optimizer': optimizer.state_dict(),
                                'epochs_done': epoch + 1, 'best_val_accuracy': best_val_accuracy,
                                'best_epoch': best_epoch}, checkpoint_path)
            epoch_time = time.perf_counter() - epoch_start
            print(f'Epoch {epoch} done in {epoch_time:.2f}s '
                  f'({len(train_loader.dataset) / epoch_time:.0f} samples/s over {world_size} processes)')

    if rank == 0:
        writer.close()
        print(f'Best accuracy {best_val_accuracy:.2f}% at epoch {best_epoch}, saved in {best_model_path}; '
              f'{args.epochs - start_epoch} epochs in {time.perf_counter() - run_start:.1f}s')
    dist.destroy_process_group()
    if rank == 0:
        print('Training complete. writer.close()')


if __name__ == '__main__':
    # Whole lines, each as soon as it is printed: DLC's log view is live and ranks share one stream.
    sys.stdout.reconfigure(line_buffering=True, write_through=False)
    args = parse_args()
    try:
        main(args)
    except common.SetupError as e:
        if dist.is_initialized():
            dist.destroy_process_group()
        if args.debug:
            raise
        sys.exit(f'error: {e}')
