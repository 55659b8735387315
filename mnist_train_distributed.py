"""Train the quick-start's CNN on MNIST with DistributedDataParallel (PAI-DLC quick start, part 4).

Start command on DLC (upload common.py, peers.py and review.py beside this script; DLC sets WORLD_SIZE, RANK,
MASTER_ADDR and MASTER_PORT, and NPROC_PER_NODE for nodes with several GPUs):
  torchrun --nproc_per_node=1 --nnodes=${WORLD_SIZE} --node_rank=${RANK} \\
      --master_addr=${MASTER_ADDR} --master_port=${MASTER_PORT} /mnt/data/mnist_train_distributed.py
On your own machine (2 CPU processes):
  torchrun --standalone --nproc_per_node=2 mnist_train_distributed.py \\
      --data-dir ./data --output-dir ./output/distributed

Global rank 0 writes to --output-dir: best_model.pth (the best model's state_dict, keys as in the
single script), checkpoint.pth (the same command resumes from it) and TensorBoard logs in
runs/mnist_experiment. --epochs is a total: epochs done before a restart count.
"""
import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torch.utils.tensorboard import SummaryWriter

try:
    import common
    import peers
    import review
except ModuleNotFoundError as e:  # the script uploaded alone
    if e.name not in ('common', 'peers', 'review'):
        raise
    sys.exit(f'error: {e.name}.py is missing: upload it beside {os.path.abspath(__file__)} (on DLC, to the same '
             f'folder of the dataset as the script).')

# Data preprocessing, as in the document
transform = transforms.Compose([
    transforms.ToTensor(),
    transforms.Normalize((0.5,), (0.5,))
])


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Hyperparameters: the document's values are the defaults.
    parser.add_argument('--batch-size', type=common.positive(int), default=64,
                        help='training batch size, of each process in the distributed script (default: 64)')
    parser.add_argument('--lr', type=common.positive(float), default=0.01, help='SGD learning rate (default: 0.01)')
    parser.add_argument('--epochs', type=common.positive(int), default=20,
                        help='total epochs, counting those done before a restart (default: 20)')
    parser.add_argument('--data-dir', default='/mnt/data/dataSet',
                        help='torchvision root: the files live in <data-dir>/MNIST/raw (default: /mnt/data/dataSet)')
    parser.add_argument('--output-dir', default='/mnt/data/output_distributed',
                        help='best_model.pth, checkpoint.pth and runs/ go here (default: %(default)s)')
    parser.add_argument('--log-interval', type=common.positive(int), default=100,
                        help='batches between training-loss lines (default: 100)')
    parser.add_argument('--val-batch-size', type=common.positive(int), default=1000,
                        help='validation batch size; does not change the results (default: 1000)')
    parser.add_argument('--seed', type=common.seed, default=0,
                        help='seed for the initial weights and the data order (default: 0)')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu',
                        help='cpu, cuda, and in the single script also cuda:N or mps; in the distributed script '
                             'cuda means GPU LOCAL_RANK (default: cuda if available, else cpu)')
    parser.add_argument('--backend', choices=['nccl', 'gloo'],
                        help='process-group backend (default: nccl on cuda, gloo on cpu)')
    parser.add_argument('--join-timeout', type=common.positive(float, most=common.MAX_SECONDS), default=1800,
                        help='seconds to wait for every process of the job to start and connect (default: 1800)')
    parser.add_argument('--collective-timeout', type=common.positive(float, most=common.MAX_SECONDS), default=300,
                        help='seconds a step may wait for the other processes (an epoch takes seconds) before the '
                             'job stops, on gloo naming the one that stopped answering (default: 300)')
    parser.add_argument('--no-resume', action='store_true',
                        help='ignore <output-dir>/checkpoint.pth and start from epoch 0 (default: resume)')
    parser.add_argument('--debug', action='store_true', help='show tracebacks for set-up errors (default: off)')
    return parser.parse_args()


def ddp_setup(args):
    """Join the job (started without torchrun: a world of one); return rank, world_size, local_rank, device."""
    launched = peers.check_environment()  # RANK, WORLD_SIZE, LOCAL_RANK, as torchrun sets them
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = peers.check_backend(args, local_rank)  # nccl on GPUs, gloo on CPUs
    if args.device == 'cuda':
        torch.cuda.set_device(local_rank)  # before the process group, so NCCL binds this GPU
        device = torch.device('cuda', local_rank)
    else:
        device = torch.device('cpu')
    store = peers.join(rank, world_size, args) if launched else dist.HashStore()
    # Training's collectives wait --collective-timeout for a peer, on gloo and NCCL alike (their own defaults:
    # 30 and 10 minutes); the set-up's waits (rank 0's download) take longer: peers.on_ranks
    with peers.connecting(rank, world_size):  # a rank that cannot be reached: named, with its host
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=args.collective_timeout))
    print(f'Rank {rank}/{world_size} (local rank {local_rank}, pid {os.getpid()}) on {device} with {backend}')
    return rank, world_size, local_rank, device


def train(model, train_loader, optimizer, criterion, epoch, device, writer, log_interval, rank, local_rank, world_size):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)  # no-op: already there
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % log_interval == 0:
            loss_value = loss.item()  # the loop's one host sync, at log lines only
            print(f"Rank: {rank}, Local_Rank: {local_rank} -- Train Epoch: {epoch} "
                  f"[{batch_idx * len(data) * world_size}/{len(train_loader.dataset)} "
                  f"({100. * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss_value:.6f}")
            if rank == 0:
                writer.add_scalar('Loss/train', loss_value, epoch * len(train_loader) + batch_idx)
            all_losses = loss.detach().clone()
            dist.all_reduce(all_losses)  # nan or inf on any rank makes the sum so: every rank stops
            common.check_finite(all_losses.item(), epoch, batch_idx)


def validate(model, val_loader, criterion, device, writer, epoch, rank):
    """The document's validation and its record; the sums stay on the device until the end."""
    model.eval()
    val_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in val_loader:
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            output = model(data)
            val_loss += criterion(output, target) * data.size(0)  # the batch's sum, not its mean
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum()
    # Each rank validated its own share of the test set: together, every image once
    dist.all_reduce(val_loss, op=dist.ReduceOp.SUM)
    dist.all_reduce(correct, op=dist.ReduceOp.SUM)
    val_loss, correct = val_loss.item(), correct.item()
    val_loss /= len(val_loader.dataset)  # per sample (the document's single script divides by the number of batches)
    val_accuracy = 100. * correct / len(val_loader.dataset)
    common.check_finite(val_loss, epoch)  # a diverged model is neither reported as best nor saved
    if rank != 0:
        return val_loss, val_accuracy  # rank 0 alone reports
    print(f'Validation Loss: {val_loss:.4f}, Accuracy: {correct}/{len(val_loader.dataset)} ({val_accuracy:.0f}%)')
    writer.add_scalar('Loss/validation', val_loss, epoch)
    writer.add_scalar('Accuracy/validation', val_accuracy, epoch)
    return val_loss, val_accuracy


def prepare_data(args, rank, world_size, local_rank, device):
    """The data of this rank: its sampler and loader of the training set, and its share of the test set."""
    for first in (rank == 0, local_rank == 0 and rank != 0):
        peers.on_ranks(first, common.prepare_mnist, args.data_dir)
    train_dataset = datasets.MNIST(root=args.data_dir, train=True, download=False, transform=transform)
    val_dataset = datasets.MNIST(root=args.data_dir, train=False, download=False, transform=transform)
    train_sampler = DistributedSampler(train_dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = common.TensorLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler, device=device)
    val_loader = common.TensorLoader(val_dataset, batch_size=args.val_batch_size,
                                     sampler=range(rank, len(val_dataset), world_size), device=device)
    return train_sampler, train_loader, val_loader


def main(args):
    # Hyperparameters: the flags, whose defaults are the document's values
    batch_size, learning_rate, num_epochs = args.batch_size, args.lr, args.epochs

    # Device: the GPU if there is one (in the distributed script, this process's own)
    rank, world_size, local_rank, device = ddp_setup(args)

    # Restarts: checked before any data is read; an earlier run's checkpoint.pth is picked up
    best_model_path = os.path.join(args.output_dir, 'best_model.pth')
    checkpoint = peers.on_ranks(rank == 0, common.load_checkpoint, args)
    if common.training_complete(checkpoint, num_epochs, best_model_path, main_process=rank == 0):
        return

    # Data: rank 0 downloads, then each other node's first process if it sees none; disjoint validation shares
    train_sampler, train_loader, val_loader = prepare_data(args, rank, world_size, local_rank, device)

    # Model, on the GPU if there is one
    torch.manual_seed(args.seed)
    model = common.SimpleCNN().to(device)
    if device.type == 'cpu':  # channels_last: a third faster on torch 2.3's CPU convolutions
        model = model.to(memory_format=torch.channels_last)
    # rank 0's weights everywhere; device_ids only on a GPU
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if device.type == 'cuda' else None)
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.SGD(model.parameters(), lr=learning_rate)
    start_epoch, best_val_accuracy, best_epoch = common.resume(checkpoint, model.module, optimizer, best_model_path,
                                                               main_process=rank == 0)

    # TensorBoard (purge_step: steps an interrupted run logged past its checkpoint are hidden)
    writer = (SummaryWriter(f'{args.output_dir}/runs/mnist_experiment', purge_step=start_epoch * len(train_loader))
              if rank == 0 else None)

    run_start = time.perf_counter()  # training, with validation after each epoch
    for epoch in range(start_epoch, num_epochs):
        epoch_start = time.perf_counter()
        train_sampler.set_epoch(epoch)  # a new order each epoch, the same one after a restart
        # A failed or timed-out collective: which rank is gone or hung, in one paragraph
        with peers.watched(epoch, rank, world_size, args.collective_timeout):
            train(model, train_loader, optimizer, criterion, epoch, device, writer, args.log_interval, rank, local_rank,
                  world_size)
            val_loss, val_accuracy = validate(model, val_loader, criterion, device, writer, epoch, rank)
        if rank != 0:
            continue  # rank 0 alone logs and saves
        # Save the model with the best validation accuracy, then the checkpoint (logs first)
        if val_accuracy > best_val_accuracy:
            best_val_accuracy = val_accuracy
            best_epoch = epoch
            common.save_atomic(model.module.state_dict(), best_model_path)  # no 'module.' in the keys
            print(f'Model saved with accuracy: {best_val_accuracy:.2f}%')
        common.save_checkpoint(args, writer, model.module, optimizer, epoch + 1, best_val_accuracy, best_epoch)
        epoch_time = time.perf_counter() - epoch_start
        print(f'Epoch {epoch} done in {epoch_time:.2f}s ({len(train_loader.dataset) / epoch_time:.0f} samples/s)')
    if rank != 0:
        return
    # TensorBoard's other tabs: the best model's mistakes, PR curves, graph, hyperparameters
    review.best_model(writer, args, best_model_path, val_loader, best_val_accuracy, best_epoch, world_size)
    writer.close()
    print(f'Best accuracy {best_val_accuracy:.2f}% at epoch {best_epoch}, saved in {best_model_path}; '
          f'{num_epochs - start_epoch} epochs in {time.perf_counter() - run_start:.1f}s')
    print('Training complete. writer.close()')


if __name__ == '__main__':
    # Whole lines, each as soon as it is printed: DLC's log view is live and ranks share one stream.
    sys.stdout.reconfigure(line_buffering=True, write_through=False, errors='surrogateescape')  # any path's bytes
    args = parse_args()
    common.stop_on_signals(args, main_process=int(os.environ.get('RANK', 0)) == 0)  # one line, from rank 0
    common.limit_cpu_threads()  # torch counts the host's cores, not a container's CPU quota
    try:
        main(args)
    except common.SetupError as e:
        if args.debug:
            raise
        peers.report_failure(e)  # one paragraph, in torchrun's report where it makes one
        sys.exit(1)
    except BrokenPipeError:  # the reader of its output is gone (| head): end quietly, as Unix tools do
        sys.exit(141)  # 128 + SIGPIPE, as the shell reports a tool ended by it
    finally:
        if dist.is_initialized():
            # Before torch 2.8, Gloo's teardown holds the GIL while its threads may still need it to
            # free the last collective's tensors, and hangs (pytorch/pytorch#154976): let them finish.
            time.sleep(0.1)
            dist.destroy_process_group()
