"""Epoch time of the document's data pipeline against ours, side by side in one run.

    python tests/benchmark.py --data-dir ../shared/data/mnist      (or: ./run_local.sh bench ...)

Each repetition runs, in alternating order, one epoch (train + validate) of:
  document  torchvision MNIST with ToTensor + Normalize per sample, DataLoader(batch 64,
            shuffle), the document's validation (batch 64, a host sync per batch), NCHW model;
  ours      mnist_train.train and mnist_train.validate on common.TensorLoader, as the script runs;
  floor     forward, backward and step alone on batches made in advance (our model layout).
It prints each time, the medians, and ours/document. Then it runs each pipeline once more in a
child process of its own and prints their peak memory (RSS). Not part of the test suite.
"""
import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import mnist_train  # noqa: E402
from bench_serve import check_mnist, scratch_folder  # beside this file; a scratch folder: removed when it ends


def sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def document_epoch(model, optimizer, criterion, train_loader, val_loader, device, writer, epoch):
    """The document's loop, written out: per-sample pipeline, per-batch .item() in validation."""
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = criterion(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % 100 == 0:
            writer.add_scalar('Loss/train', loss.item(), epoch * len(train_loader) + batch_idx)
            print(f'Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)}]\t'
                  f'Loss: {loss.item():.6f}')
    model.eval()
    val_loss, correct = 0, 0
    with torch.no_grad():
        for data, target in val_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            val_loss += criterion(output, target).item()
            correct += output.argmax(dim=1).eq(target).sum().item()
    return correct


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--data-dir', required=True, help='torchvision root holding MNIST/raw')
    parser.add_argument('--repeats', type=int, default=4, help='alternating repetitions (default: 4)')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu',
                        help='cpu or cuda (default: cuda if available, else cpu)')
    parser.add_argument('--only', choices=['document', 'ours'], help=argparse.SUPPRESS)  # memory child
    args = parser.parse_args()
    device = torch.device(args.device)
    pipelines = [args.only] if args.only else ['document', 'ours', 'floor']

    # The document's pipeline and its model, as it writes them (NCHW).
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])
    check_mnist(args.data_dir)
    doc_train = datasets.MNIST(root=args.data_dir, train=True, download=False, transform=transform)
    doc_val = datasets.MNIST(root=args.data_dir, train=False, download=False, transform=transform)
    doc_train_loader = DataLoader(doc_train, batch_size=64, shuffle=True)
    doc_val_loader = DataLoader(doc_val, batch_size=64, shuffle=False)
    # Ours, as mnist_train.py builds it.
    if 'ours' in pipelines or 'floor' in pipelines:
        train_loader = common.TensorLoader(doc_train, batch_size=64, shuffle=True, device=device)
        val_loader = common.TensorLoader(doc_val, batch_size=1000, shuffle=False, device=device)
    if 'floor' in pipelines:
        premade = [(d.clone(), t.clone()) for d, t in train_loader]

    ours_layout = torch.channels_last if device.type == 'cpu' else torch.contiguous_format  # as the scripts

    def fresh(layout):
        torch.manual_seed(0)
        model = common.SimpleCNN().to(device).to(memory_format=layout)
        return model, optim.SGD(model.parameters(), lr=0.01), nn.CrossEntropyLoss()

    times = {name: [] for name in pipelines}
    train_part = []
    log_dir = scratch_folder()  # the document's writes are timed, not kept
    writer = SummaryWriter(log_dir)
    for rep in range(args.repeats):
        order = pipelines if rep % 2 == 0 else pipelines[::-1]
        for name in order:
            with contextlib.redirect_stdout(io.StringIO()):
                if name == 'document':
                    model, optimizer, criterion = fresh(torch.contiguous_format)
                    sync(device)
                    start = time.perf_counter()
                    document_epoch(model, optimizer, criterion, doc_train_loader, doc_val_loader, device, writer, rep)
                elif name == 'ours':
                    model, optimizer, criterion = fresh(ours_layout)
                    sync(device)
                    start = time.perf_counter()
                    train_loader.set_epoch(rep)
                    mnist_train.train(model, train_loader, optimizer, criterion, rep, device, writer, 100)
                    sync(device)
                    train_part.append(time.perf_counter() - start)
                    mnist_train.validate(model, val_loader, criterion, device, writer, rep)
                else:
                    model, optimizer, criterion = fresh(ours_layout)
                    sync(device)
                    start = time.perf_counter()
                    for data, target in premade:
                        optimizer.zero_grad()
                        criterion(model(data), target).backward()
                        optimizer.step()
                sync(device)
                times[name].append(time.perf_counter() - start)
        if not args.only:
            print(f'repetition {rep}: ' + ', '.join(f'{n} {times[n][-1]:.2f}s' for n in pipelines)
                  + f' (ours: train part {train_part[-1]:.2f}s)', flush=True)
    writer.close()
    if args.only:  # VmHWM: this process's peak RSS (ru_maxrss would include the parent's, from before exec)
        with open('/proc/self/status') as status:
            print(next(line for line in status if line.startswith('VmHWM')))
        return

    median = {name: statistics.median(values) for name, values in times.items()}
    ratios = [o / d for o, d in zip(times['ours'], times['document'])]
    print(f'\nDevice {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, '
          f'{args.repeats} repetitions; one epoch = 60000 training + 10000 validation images')
    print(f'document pipeline  epoch {median["document"]:6.2f}s (median)')
    print(f'ours               epoch {median["ours"]:6.2f}s (median), training part '
          f'{statistics.median(train_part):.2f}s')
    print(f'model-only floor   train {median["floor"]:6.2f}s (median)')
    print(f'ours / document    {statistics.median(ratios):.3f} (median of paired ratios: '
          + ', '.join(f'{r:.3f}' for r in ratios) + ')')
    print(f'ours training part / floor  {statistics.median(train_part) / median["floor"]:.3f}')

    # Peak memory: each pipeline alone, one epoch, in a child process of its own.
    peaks = {}
    for name in ('document', 'ours'):
        child = subprocess.run([sys.executable, __file__, '--data-dir', args.data_dir, '--device',
                                args.device, '--repeats', '1', '--only', name],
                               capture_output=True, text=True, check=True)
        peaks[name] = int(child.stdout.split()[-2]) / 1024  # 'VmHWM: <KiB> kB'
    print(f'peak RSS           document {peaks["document"]:.0f} MiB, ours {peaks["ours"]:.0f} MiB '
          f'({peaks["ours"] - peaks["document"]:+.0f} MiB)')


if __name__ == '__main__':
    main()
