"""What mnist_train.py and mnist_train_distributed.py share: the model, the data, and saving.

The data is read once through torchvision's MNIST (download and parsing), normalised in one
vectorised step to exactly the values of ToTensor() + Normalize((0.5,), (0.5,)), and served as
batches of those tensors: no PIL image and no per-sample Python work in the training loop.
"""
import argparse
import math
import os
import shutil
import socket
import tempfile
from urllib.error import URLError

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, TensorDataset
from torchvision import datasets
from torchvision.datasets.utils import download_and_extract_archive

MNIST_FILES = {  # file in <data-dir>/MNIST/raw: (IDX magic number, shape of one item)
    'train-images-idx3-ubyte': (2051, (28, 28)),
    'train-labels-idx1-ubyte': (2049, ()),
    't10k-images-idx3-ubyte': (2051, (28, 28)),
    't10k-labels-idx1-ubyte': (2049, ()),
}
CHECKPOINT_KEYS = {'model', 'optimizer', 'epochs_done', 'best_val_accuracy', 'best_epoch'}


class SetupError(Exception):
    """A problem the user can fix (flags, environment, data, output folder, checkpoint).

    The scripts print it as one paragraph, without a traceback unless --debug is given.
    """


class SimpleCNN(nn.Module):
    """The document's model; keep the layer names, they are the keys of best_model.pth."""

    @staticmethod
    def memory_format(device):
        """channels_last on CPU, where its convolutions and pooling run about 25% faster."""
        return torch.channels_last if torch.device(device).type == 'cpu' else torch.contiguous_format

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=3)
        self.fc1 = nn.Linear(20 * 5 * 5, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):                              # x: [batch, 1, 28, 28]
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)     # [batch, 10, 12, 12]
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)     # [batch, 20, 5, 5]
        x = torch.flatten(x, 1)                        # [batch, 500], whatever the memory format
        x = F.relu(self.fc1(x))                        # [batch, 128]
        return self.fc2(x)                             # [batch, 10]


def positive(kind):
    """argparse type: a number of the given kind that is greater than zero."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise argparse.ArgumentTypeError(f'must be a positive {kind.__name__}, got {text!r}')
        return value
    return parse


# --- data -------------------------------------------------------------------------------------

def _laptop_hint(path):
    if os.path.abspath(path).startswith('/mnt/data'):
        return (' /mnt/data is the dataset mount of a DLC job; on another machine pass --data-dir '
                'and --output-dir (for example ./data and ./output), or use ./run_local.sh.')
    return ''


def check_idx_file(path):
    """Raise SetupError unless path is a complete MNIST IDX file (header, shape and size)."""
    name = os.path.basename(path)
    magic, item_shape = MNIST_FILES[name]
    with open(path, 'rb') as f:
        header = f.read(8 + 4 * len(item_shape))
    size = os.path.getsize(path)
    fields = [int.from_bytes(header[i:i + 4], 'big') for i in range(0, len(header) - 3, 4)]
    count = fields[1] if len(fields) > 1 else 0
    expected = len(header) + count * math.prod(item_shape)
    if len(fields) != 2 + len(item_shape) or fields[0] != magic or tuple(fields[2:]) != item_shape:
        problem = f'its header is not that of an MNIST {"image" if item_shape else "label"} file'
    elif size != expected:
        problem = f'{size} bytes where its header calls for {expected}'
    else:
        return count
    raise SetupError(f'{path} is not a complete MNIST file: it is truncated or corrupt ({problem}). '
                     f'Delete it to have it downloaded again, or copy a good one there.')


def prepare_mnist(data_dir, download=True):
    """Make sure the four MNIST files are in <data_dir>/MNIST/raw, downloading any that are missing.

    Mirrors tried in turn: $MNIST_MIRROR (a URL prefix, for nodes that reach only an internal
    mirror or OSS; its files are checked for format, not checksum), then torchvision's. Each file
    is downloaded into a private temporary folder and moved into place whole, so a reader never
    sees half a file and a killed download leaves no partial file where the data belongs.
    """
    raw_folder = os.path.join(data_dir, 'MNIST', 'raw')
    missing = [name for name in MNIST_FILES if not os.path.isfile(os.path.join(raw_folder, name))]
    failure = ''
    if missing and download:
        try:
            os.makedirs(raw_folder, exist_ok=True)
            staging = tempfile.mkdtemp(prefix='.download-', dir=raw_folder)
        except OSError as e:
            raise SetupError(f'cannot create {raw_folder} to download MNIST into ({e.strerror}).'
                             + _laptop_hint(data_dir)) from None
        mirrors = [(m.rstrip('/') + '/', False) for m in [os.environ.get('MNIST_MIRROR')] if m]
        mirrors += [(m, True) for m in datasets.MNIST.mirrors]
        md5s = dict(datasets.MNIST.resources)
        old_timeout = socket.getdefaulttimeout()
        socket.setdefaulttimeout(30)  # urllib waits forever by default; a blocked node should fail
        try:
            for name in list(missing):
                for mirror, check_md5 in mirrors:
                    try:
                        download_and_extract_archive(mirror + name + '.gz', staging,
                                                     md5=md5s[name + '.gz'] if check_md5 else None)
                        check_idx_file(os.path.join(staging, name))
                        os.replace(os.path.join(staging, name), os.path.join(raw_folder, name))
                        missing.remove(name)
                        break
                    except (URLError, OSError, RuntimeError, SetupError) as e:
                        failure = f' The last download error was: {mirror}{name}.gz: {e}.'
                else:
                    break  # no mirror has this file: the others will not fare better
        finally:
            socket.setdefaulttimeout(old_timeout)
            shutil.rmtree(staging, ignore_errors=True)
    if missing:
        raise SetupError(
            f'MNIST is not in {raw_folder} and could not be downloaded (missing: '
            f'{", ".join(missing)}). On a node without internet access, put the four files '
            f'{", ".join(MNIST_FILES)} (uncompressed) in that folder, for example by uploading '
            f'them to the dataset, or set MNIST_MIRROR to a URL prefix that serves them as .gz.'
            + failure + _laptop_hint(data_dir))
    counts = {name: check_idx_file(os.path.join(raw_folder, name)) for name in MNIST_FILES}
    for split in ('train', 't10k'):
        if counts[f'{split}-images-idx3-ubyte'] != counts[f'{split}-labels-idx1-ubyte']:
            raise SetupError(f'{raw_folder}: {split}-images-idx3-ubyte and {split}-labels-idx1-ubyte '
                             f'hold different numbers of items; replace them with a matching pair.')


def load_mnist(data_dir, train, device):
    """Return (images, labels) of one split on device: images [N, 1, 28, 28] float32, normalised."""
    dataset = datasets.MNIST(root=data_dir, train=train, download=False)  # parses the IDX files
    # ToTensor divides by 255, Normalize subtracts 0.5 and divides by 0.5: the same float32
    # operations in the same order, so the values are bit for bit the document's.
    images = dataset.data.to(device).unsqueeze(1).float().div_(255).sub_(0.5).div_(0.5)
    labels = dataset.targets.to(device)
    if labels.max() > 9:  # uint8 labels: never below 0
        raise SetupError(f'{dataset.raw_folder} holds labels outside 0..9: the label file is corrupt.')
    return images, labels


def shard(tensors, rank, world_size):
    """A contiguous, disjoint 1/world_size share of each tensor: together they hold every row once."""
    n = len(tensors[0])
    start, end = n * rank // world_size, n * (rank + 1) // world_size
    return [t[start:end] for t in tensors]


class TensorLoader:
    """DataLoader's place for tensors already in memory (on the GPU when training there).

    Yields (data, target) batches. With shuffle=True the order is DistributedSampler's (seeded
    by seed + epoch, this rank's 1/world_size share), new each epoch after set_epoch(epoch);
    with world_size=1 that is a plain shuffle of the whole set. Batches are gathered by index
    on the tensors' device, so a step does no per-sample work and no host-to-device copy.
    """

    def __init__(self, images, labels, batch_size, shuffle=False, seed=0, rank=0, world_size=1):
        self.dataset = TensorDataset(images, labels)
        self.batch_size = batch_size
        self.sampler = DistributedSampler(self.dataset, num_replicas=world_size, rank=rank,
                                          shuffle=True, seed=seed) if shuffle else None

    def set_epoch(self, epoch):
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def __len__(self):
        samples = len(self.sampler) if self.sampler is not None else len(self.dataset)
        return math.ceil(samples / self.batch_size)

    def __iter__(self):
        images, labels = self.dataset.tensors
        if self.sampler is None:
            for start in range(0, len(images), self.batch_size):
                yield images[start:start + self.batch_size], labels[start:start + self.batch_size]
            return
        order = torch.tensor(list(self.sampler), device=images.device)
        for indices in order.split(self.batch_size):
            yield images[indices], labels[indices]


# --- saving -----------------------------------------------------------------------------------

def check_writable(folder):
    """Fail now, not after an epoch, if the output folder cannot be created or written."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise SetupError(f'cannot write to the output folder {folder} ({e.strerror}); pass '
                         f'--output-dir with a folder you can write.' + _laptop_hint(folder)) from None


def set_aside(path):
    """Before a fresh start, keep an earlier run's file as <path>.previous rather than overwrite it."""
    if os.path.exists(path):
        os.replace(path, path + '.previous')
        print(f'Starting afresh: the earlier {os.path.basename(path)} is kept as {path}.previous')


def save_atomic(obj, path):
    """torch.save to a temporary file beside path, then rename it over path.

    A kill at any moment leaves either the old file or the new one, never a torn one.
    """
    tmp_path = path + '.tmp'
    with open(tmp_path, 'wb') as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_path, path)


def read_checkpoint(path):
    """Load a training checkpoint written by save_atomic, or raise SetupError; the file is kept."""
    fresh = f'To start fresh, pass --no-resume (the file is then overwritten) or move {path} away.'
    try:
        # weights_only: tensors and plain values are all it may hold; no arbitrary objects are built.
        checkpoint = torch.load(path, map_location='cpu', weights_only=True)
        missing = CHECKPOINT_KEYS - set(checkpoint)
        if missing:
            raise KeyError(f'no {", ".join(sorted(missing))}')
        SimpleCNN().load_state_dict(checkpoint['model'])
    except Exception as e:  # corrupt, truncated, another model, another program's file
        reason = f'{type(e).__name__}: {e}'.splitlines()[0][:300]
        raise SetupError(f'cannot resume from {path}: it is not a readable checkpoint of this '
                         f'model ({reason}). It was left as it is. {fresh}') from None
    return checkpoint
