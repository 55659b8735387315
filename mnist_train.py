"""Train the quick-start's CNN on MNIST in one process (PAI-DLC quick start, part 3).

On DLC:   python /mnt/data/mnist_train.py          (upload common.py beside it)
Locally:  python mnist_train.py --data-dir ./data --output-dir ./output

Writes <output-dir>/best_model.pth (the best model's state_dict), <output-dir>/checkpoint.pth
(to resume after a restart) and TensorBoard logs under <output-dir>/runs/mnist_experiment.
"""
import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.tensorboard import SummaryWriter

import common


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    # Hyperparameters: the document's values are the defaults.
    parser.add_argument('--batch-size', type=common.positive(int), default=64, help='training batch size (default: 64)')
    parser.add_argument('--lr', type=common.positive(float), default=0.01, help='SGD learning rate (default: 0.01)')
    parser.add_argument('--epochs', type=common.positive(int), default=20, help='number of epochs (default: 20)')
    parser.add_argument('--data-dir', default='/mnt/data/dataSet',
                        help='torchvision root: the files live in <data-dir>/MNIST/raw (default: /mnt/data/dataSet)')
    parser.add_argument('--output-dir', default='/mnt/data/output',
                        help='best_model.pth, checkpoint.pth and runs/ go here (default: /mnt/data/output)')
    parser.add_argument('--log-interval', type=common.positive(int), default=100,
                        help='batches between training-loss lines (default: 100)')
    parser.add_argument('--val-batch-size', type=common.positive(int), default=1000,
                        help='validation batch size; does not change the results (default: 1000)')
    parser.add_argument('--seed', type=int, default=0, help='seed for the initial weights and the data order (default: 0)')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu',
                        help='cpu, cuda or cuda:N (default: cuda if available, else cpu)')
    parser.add_argument('--no-resume', action='store_true',
                        help='ignore <output-dir>/checkpoint.pth and start from epoch 0 (default: resume)')
    parser.add_argument('--debug', action='store_true', help='show tracebacks for set-up errors (default: off)')
    return parser.parse_args()


def train(model, train_loader, optimizer, criterion, epoch, device, writer, log_interval):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)  # no-op: the batches already live there
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % log_interval == 0:
            loss_value = loss.item()  # the only host sync in the loop, as in the document
            writer.add_scalar('Loss/train', loss_value, epoch * len(train_loader) + batch_idx)
            print(f'Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)} '
                  f'({100. * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss_value:.6f}')


def validate(model, val_loader, device):
    """Return (summed loss, correct, count) over the loader, synced to the host once."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    with torch.no_grad():
        for data, target in val_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            totals[0] += F.cross_entropy(output, target, reduction='sum')
            totals[1] += (output.argmax(dim=1) == target).sum()
            totals[2] += len(target)
    return totals


def main(args):
    # Fail on a bad device or output folder now, before reading any data.
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise common.SetupError(f'--device {args.device} is not a device; pass cpu, cuda or cuda:N.') from None
    if device.type == 'cuda' and (device.index or 0) >= torch.cuda.device_count():
        raise common.SetupError(f'--device {args.device} was asked for, but this machine has '
                                f'{torch.cuda.device_count()} CUDA GPUs; pass --device cpu or run on a GPU node.')
    common.check_writable(args.output_dir)
    checkpoint_path = os.path.join(args.output_dir, 'checkpoint.pth')
    best_model_path = os.path.join(args.output_dir, 'best_model.pth')
    checkpoint = None
    if os.path.exists(checkpoint_path) and not args.no_resume:
        checkpoint = common.read_checkpoint(checkpoint_path)
        if checkpoint['epochs_done'] >= args.epochs:
            print(f'Training already complete: {checkpoint_path} has {checkpoint["epochs_done"]} '
                  f'epochs, best accuracy {checkpoint["best_val_accuracy"]:.2f}% at epoch '
                  f'{checkpoint["best_epoch"]} in {best_model_path}. Pass a larger --epochs to '
                  f'train on, or --no-resume to start over.')
            return

    # Data: the whole set as normalised tensors on the device, read once.
    common.prepare_mnist(args.data_dir, download=True)
    train_images, train_labels = common.load_mnist(args.data_dir, train=True, device=device)
    val_images, val_labels = common.load_mnist(args.data_dir, train=False, device=device)
    train_loader = common.TensorLoader(train_images, train_labels, args.batch_size, shuffle=True, seed=args.seed)
    val_loader = common.TensorLoader(val_images, val_labels, args.val_batch_size)

    torch.manual_seed(args.seed)
    model = common.SimpleCNN().to(device, memory_format=common.SimpleCNN.memory_format(device))
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.SGD(model.parameters(), lr=args.lr)
    start_epoch, best_val_accuracy, best_epoch = 0, 0.0, None
    if checkpoint is not None:
        model.load_state_dict(checkpoint['model'])
        optimizer.load_state_dict(checkpoint['optimizer'])
        start_epoch = checkpoint['epochs_done']
        best_val_accuracy, best_epoch = checkpoint['best_val_accuracy'], checkpoint['best_epoch']
        print(f'Resuming from epoch {start_epoch} ({checkpoint_path}; best accuracy so far '
              f'{best_val_accuracy:.2f}%)')
    else:
        common.set_aside(best_model_path)

    # purge_step: TensorBoard hides what an earlier, interrupted run logged from this step on,
    # so a resumed epoch's steps appear once.
    writer = SummaryWriter(os.path.join(args.output_dir, 'runs', 'mnist_experiment'),
                           purge_step=start_epoch * len(train_loader))
    run_start = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        epoch_start = time.perf_counter()
        train_loader.set_epoch(epoch)  # a new shuffle each epoch, the same one after a restart
        train(model, train_loader, optimizer, criterion, epoch, device, writer, args.log_interval)

        val_loss_sum, correct, total = validate(model, val_loader, device).tolist()
        val_loss = val_loss_sum / total  # per sample, not per batch
        val_accuracy = 100. * correct / total
        correct, total = int(correct), int(total)
        print(f'Validation Loss: {val_loss:.4f}, Accuracy: {correct}/{total} ({val_accuracy:.0f}%)')
        writer.add_scalar('Loss/validation', val_loss, epoch)
        writer.add_scalar('Accuracy/validation', val_accuracy, epoch)

        if val_accuracy > best_val_accuracy:
            best_val_accuracy, best_epoch = val_accuracy, epoch
            common.save_atomic(model.state_dict(), best_model_path)
            print(f'Model saved with accuracy: {best_val_accuracy:.2f}%')
        # The logs first, then the checkpoint: a finished epoch is never missing from either.
        writer.flush()
        common.save_atomic({'model': model.state_dict(), 'optimizer': optimizer.state_dict(),
                            'epochs_done': epoch + 1, 'best_val_accuracy': best_val_accuracy,
                            'best_epoch': best_epoch}, checkpoint_path)
        epoch_time = time.perf_counter() - epoch_start
        print(f'Epoch {epoch} done in {epoch_time:.2f}s ({len(train_loader.dataset) / epoch_time:.0f} samples/s)')

    writer.close()
    print(f'Best accuracy {best_val_accuracy:.2f}% at epoch {best_epoch}, saved in {best_model_path}; '
          f'{args.epochs - start_epoch} epochs in {time.perf_counter() - run_start:.1f}s')
    print('Training complete. writer.close()')


if __name__ == '__main__':
    # Whole lines, each as soon as it is printed: DLC's log view is live and ranks share one stream.
    sys.stdout.reconfigure(line_buffering=True, write_through=False)
    args = parse_args()
    try:
        main(args)
    except common.SetupError as e:
        if args.debug:
            raise
        sys.exit(f'error: {e}')
