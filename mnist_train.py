"""Train the quick-start's CNN on MNIST in one process (PAI-DLC quick start, part 3).

Start command on DLC (upload common.py and review.py beside this script):
  python /mnt/data/mnist_train.py
On your own machine:
  python mnist_train.py --data-dir ./data --output-dir ./output/single

Writes to --output-dir: best_model.pth (the best model's state_dict), checkpoint.pth (the same
command resumes from it) and TensorBoard logs in runs/mnist_experiment. --epochs is a total:
epochs done before a restart count.
"""
import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.optim as optim
from torchvision import datasets, transforms
from torch.utils.tensorboard import SummaryWriter

try:
    import common
    import review
except ModuleNotFoundError as e:  # the script uploaded alone
    if e.name not in ('common', 'review'):
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
    parser.add_argument('--output-dir', default='/mnt/data/output',
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
            loss_value = loss.item()  # the loop's one host sync, at log lines only
            writer.add_scalar('Loss/train', loss_value, epoch * len(train_loader) + batch_idx)
            print(f'Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)} ({100. * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}')
            common.check_finite(loss_value, epoch, batch_idx)


def validate(model, val_loader, criterion, device, writer, epoch):
    """The document's validation and its record; the sums stay on the device until the end."""
    model.eval()
    val_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in val_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            val_loss += criterion(output, target) * data.size(0)  # the batch's sum, not its mean
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum()
    val_loss, correct = val_loss.item(), correct.item()
    val_loss /= len(val_loader.dataset)  # per sample (the document's single script divides by the number of batches)
    val_accuracy = 100. * correct / len(val_loader.dataset)
    common.check_finite(val_loss, epoch)  # a diverged model is neither reported as best nor saved
    print(f'Validation Loss: {val_loss:.4f}, Accuracy: {correct}/{len(val_loader.dataset)} ({val_accuracy:.0f}%)')
    writer.add_scalar('Loss/validation', val_loss, epoch)
    writer.add_scalar('Accuracy/validation', val_accuracy, epoch)
    return val_loss, val_accuracy


def main(args):
    # Hyperparameters: the flags, whose defaults are the document's values
    batch_size, learning_rate, num_epochs = args.batch_size, args.lr, args.epochs

    # Device: the GPU if there is one (in the distributed script, this process's own)
    device = common.check_device(args.device)

    # Restarts: checked before any data is read; an earlier run's checkpoint.pth is picked up
    best_model_path = os.path.join(args.output_dir, 'best_model.pth')
    checkpoint = common.load_checkpoint(args)
    if common.training_complete(checkpoint, num_epochs, best_model_path):
        return

    # Data (TensorLoader applies the transform once, to the whole set)
    common.prepare_mnist(args.data_dir)  # download=True, with checks and atomic files
    train_dataset = datasets.MNIST(root=args.data_dir, train=True, download=False, transform=transform)
    val_dataset = datasets.MNIST(root=args.data_dir, train=False, download=False, transform=transform)
    train_loader = common.TensorLoader(train_dataset, batch_size=batch_size, shuffle=True, seed=args.seed,
                                       device=device)
    val_loader = common.TensorLoader(val_dataset, batch_size=args.val_batch_size, shuffle=False, device=device)

    # Model, on the GPU if there is one
    torch.manual_seed(args.seed)
    model = common.SimpleCNN().to(device)
    if device.type == 'cpu':  # channels_last: a third faster on torch 2.3's CPU convolutions
        model = model.to(memory_format=torch.channels_last)
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.SGD(model.parameters(), lr=learning_rate)
    start_epoch, best_val_accuracy, best_epoch = common.resume(checkpoint, model, optimizer, best_model_path)

    # TensorBoard (purge_step: steps an interrupted run logged past its checkpoint are hidden)
    writer = SummaryWriter(f'{args.output_dir}/runs/mnist_experiment', purge_step=start_epoch * len(train_loader))

    run_start = time.perf_counter()  # training, with validation after each epoch
    for epoch in range(start_epoch, num_epochs):
        epoch_start = time.perf_counter()
        train_loader.set_epoch(epoch)  # a new order each epoch, the same one after a restart
        train(model, train_loader, optimizer, criterion, epoch, device, writer, args.log_interval)
        val_loss, val_accuracy = validate(model, val_loader, criterion, device, writer, epoch)
        # Save the model with the best validation accuracy, then the checkpoint (logs first)
        if val_accuracy > best_val_accuracy:
            best_val_accuracy = val_accuracy
            best_epoch = epoch
            common.save_atomic(model.state_dict(), best_model_path)
            print(f'Model saved with accuracy: {best_val_accuracy:.2f}%')
        common.save_checkpoint(args, writer, model, optimizer, epoch + 1, best_val_accuracy, best_epoch)
        epoch_time = time.perf_counter() - epoch_start
        print(f'Epoch {epoch} done in {epoch_time:.2f}s ({len(train_loader.dataset) / epoch_time:.0f} samples/s)')
    # TensorBoard's other tabs: the best model's mistakes, PR curves, graph, hyperparameters
    review.best_model(writer, args, best_model_path, val_loader, best_val_accuracy, best_epoch, 1)
    writer.close()
    print(f'Best accuracy {best_val_accuracy:.2f}% at epoch {best_epoch}, saved in {best_model_path}; '
          f'{num_epochs - start_epoch} epochs in {time.perf_counter() - run_start:.1f}s')
    print('Training complete. writer.close()')


if __name__ == '__main__':
    # Whole lines, each as soon as it is printed: DLC's log view is live and ranks share one stream.
    sys.stdout.reconfigure(line_buffering=True, write_through=False, errors='surrogateescape')  # any path's bytes
    args = parse_args()
    common.stop_on_signals(args)  # Ctrl-C, SIGTERM and SIGHUP end the run with one line
    common.limit_cpu_threads()  # torch counts the host's cores, not a container's CPU quota
    try:
        main(args)
    except common.SetupError as e:
        if args.debug:
            raise
        sys.exit(f'error: {e}')
    except BrokenPipeError:  # the reader of its output is gone (| head): end quietly, as Unix tools do
        sys.exit(141)  # 128 + SIGPIPE, as the shell reports a tool ended by it
