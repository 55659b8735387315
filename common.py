"""What mnist_train.py and mnist_train_distributed.py share, after the set-up helpers (flags, device, CPU threads):
the model, the data, and the checkpoints that let a stopped or restarted job pick up its work. The training loops
stay in each script, so that each reads beside the document's own.
"""
import argparse
import contextlib
import gzip
import io
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
from urllib.error import URLError

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

try:
    import fcntl  # the output folder's lock: not on Windows
except ImportError:
    fcntl = None


class SetupError(Exception):
    """A problem the user can fix (flags, environment, data, output folder, checkpoint, full disk): the scripts
    print it as one paragraph, without a traceback unless --debug is given, and exit 1."""


# The most seconds a timeout flag takes, about 32 years: 'inf' or 1e99 meant "never", and crashed where the
# seconds become a timedelta (at most 8.64e13 s) or an integer
MAX_SECONDS = 10 ** 9


def positive(kind, most=None):
    """argparse type: a number of the given kind that is greater than zero, and at most `most` if given."""
    def parse(text):
        with contextlib.suppress(ValueError):
            value = kind(text)
            if value > 0 and (most is None or value <= most):  # nan is neither
                return value
        bound = f' of at most {most:,}' if most is not None else ''
        raise argparse.ArgumentTypeError(f'must be a positive {kind.__name__}{bound}, got {text!r}')
    return parse


def seed(text):
    """argparse type of --seed: an integer torch seeds with, seed + epoch too: from -2**63 to 2**63 - 1."""
    value = int(text)  # not an integer: argparse says "invalid seed value"
    if not -2 ** 63 <= value < 2 ** 63:
        raise argparse.ArgumentTypeError(f'must be from -2**63 to 2**63 - 1, got {text!r}')
    return value


def check_device(name):
    """torch.device(name), or SetupError if it is not a device or not available on this machine."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SetupError(f'--device {name} is not a device; pass cpu, cuda, cuda:N or mps.') from None
    if device.type == 'cuda' and (device.index or 0) >= torch.cuda.device_count():
        gpus = torch.cuda.device_count()
        raise SetupError(f'--device {name} was asked for, but this machine has {gpus} CUDA GPU{"s" * (gpus != 1)}; '
                         f'pass --device cpu or run on a GPU node (distributed: one process per GPU, '
                         f'so --nproc_per_node at most the number of GPUs).')
    if device.type != 'cpu':
        try:
            if device.type == 'mps' and not torch.backends.mps.is_available():
                raise RuntimeError('MPS needs a Mac with Apple silicon and a PyTorch built for it')
            torch.zeros(1, device=device)
        except (RuntimeError, AssertionError) as e:  # a build without that backend, no such device, ...
            reason = (str(e).splitlines()[0] if str(e) else type(e).__name__)[:200]
            raise SetupError(f'--device {name} is not available on this machine ({reason}); pass '
                             f'--device cpu, or leave --device out to use a CUDA GPU when there is one.') from None
    return device


CGROUP = '/sys/fs/cgroup'  # a Linux container's own CPU limits, where it has them


def usable_cpus():
    """The CPUs this process may use: its affinity (where the platform has one) and a Linux container's CPU quota
    (Docker --cpus, Kubernetes limits: cgroup v2, then v1), which neither os.cpu_count() nor torch sees."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1
    for quota_file, period_file in (('cpu.max', 'cpu.max'), ('cpu/cpu.cfs_quota_us', 'cpu/cpu.cfs_period_us')):
        try:  # v2: "max 100000" or "200000 100000"; v1: -1 (no quota) or 200000, and 100000 in a file of its own
            with open(os.path.join(CGROUP, quota_file)) as q, open(os.path.join(CGROUP, period_file)) as p:
                quota, period = q.read().split()[0], int(p.read().split()[-1])
            return count if quota in ('max', '-1') else max(1, min(count, math.ceil(int(quota) / period)))
        except (OSError, ValueError, IndexError, ZeroDivisionError):
            continue
    return count


def limit_cpu_threads():
    """At most usable_cpus() threads for torch's CPU work. torch starts one per core of the host: in a container
    with a quota of fewer CPUs they are throttled in turn, and a training step takes several times as long.
    OMP_NUM_THREADS, where set (torchrun sets 1 for several processes a node), is left to decide."""
    threads, cpus = torch.get_num_threads(), usable_cpus()
    if 'OMP_NUM_THREADS' not in os.environ and cpus < threads:
        torch.set_num_threads(cpus)
        print(f'CPU threads: {cpus}, the CPUs this process may use (torch would start {threads}).')


# === Model ========================================================================================

class SimpleCNN(nn.Module):
    """The document's model; keep the layer names, they are the keys of best_model.pth."""

    def __init__(self):
        super(SimpleCNN, self).__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=3)
        self.fc1 = nn.Linear(20 * 5 * 5, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):                              # x: [batch, 1, 28, 28]
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)     # [batch, 10, 12, 12]
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)     # [batch, 20, 5, 5]
        x = torch.flatten(x, 1)                        # [batch, 500], also in channels_last
        x = F.relu(self.fc1(x))                        # [batch, 128]
        x = self.fc2(x)                                # [batch, 10]
        return x


# === Data =========================================================================================

MNIST_FILES = {  # file in <data-dir>/MNIST/raw: (IDX magic number, shape of one item)
    'train-images-idx3-ubyte': (2051, (28, 28)),
    'train-labels-idx1-ubyte': (2049, ()),
    't10k-images-idx3-ubyte': (2051, (28, 28)),
    't10k-labels-idx1-ubyte': (2049, ()),
}


def _laptop_hint(path):
    if (os.path.abspath(path) + '/').startswith('/mnt/data/'):  # the mount or a folder in it, not /mnt/data2
        return (' /mnt/data is the dataset mount of a DLC job; on another machine pass --data-dir '
                'and --output-dir (for example ./data and ./output), or use ./run_local.sh.')
    return ''


def check_idx_file(path, name=None):
    """Return the item count of a complete MNIST IDX file (name: which of the four), or raise SetupError."""
    name = name or os.path.basename(path)
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
    """What datasets.MNIST(download=True) does, made safe: the four files in <data_dir>/MNIST/raw, checked. A missing
    file is extracted from its .gz beside it (as downloaded by hand), else downloaded; each is written beside its
    place and moved there whole: no reader sees half a file, and a killed run leaves no partial one."""
    raw_folder = os.path.join(data_dir, 'MNIST', 'raw')
    missing = [name for name in MNIST_FILES if not os.path.isfile(os.path.join(raw_folder, name))]
    failure = _extract_archives(raw_folder, missing)
    if missing and download:
        failure += _download(data_dir, raw_folder, missing)
    if missing:
        raise SetupError(
            f'MNIST is not in {raw_folder} and could not be downloaded (missing: '
            f'{", ".join(missing)}). On a node without internet access, put the four files '
            f'{", ".join(MNIST_FILES)} in that folder (uncompressed, or the .gz files as downloaded), '
            f'for example by uploading them to the dataset, or set MNIST_MIRROR to a URL prefix that '
            f'serves them as .gz.' + failure + _laptop_hint(data_dir))
    counts = {name: check_idx_file(os.path.join(raw_folder, name)) for name in MNIST_FILES}
    for split in ('train', 't10k'):
        if counts[f'{split}-images-idx3-ubyte'] != counts[f'{split}-labels-idx1-ubyte']:
            raise SetupError(f'{raw_folder}: {split}-images-idx3-ubyte and {split}-labels-idx1-ubyte '
                             f'hold different numbers of items; replace them with a matching pair.')


def _extract_archives(raw_folder, missing):
    """Extract each missing file that has its .gz beside it; remove it from missing. Returns what failed."""
    failure = ''
    for name in [n for n in missing if os.path.isfile(os.path.join(raw_folder, n + '.gz'))]:
        archive, target = os.path.join(raw_folder, name + '.gz'), os.path.join(raw_folder, name)
        _writing.add(target + '.tmp')
        try:
            with gzip.open(archive) as src, open(target + '.tmp', 'wb') as dst:
                shutil.copyfileobj(src, dst)
            check_idx_file(target + '.tmp', name)
            os.replace(target + '.tmp', target)
            missing.remove(name)
        except (OSError, EOFError, SetupError) as e:
            failure += f' {archive} could not be used ({e}).'
        finally:
            with contextlib.suppress(OSError):
                os.remove(target + '.tmp')
            _writing.discard(target + '.tmp')
    return failure


def _download(data_dir, raw_folder, missing):
    """Download the missing files, removing each one fetched from missing; return the last error. Mirrors tried in
    turn: $MNIST_MIRROR (a URL prefix, for nodes that reach only an internal mirror or OSS; its files are checked
    for format, not checksum), then torchvision's."""
    try:
        os.makedirs(raw_folder, exist_ok=True)
        staging = tempfile.mkdtemp(prefix='.download-', dir=raw_folder)
        _writing.add(staging)
    except OSError as e:
        raise SetupError(f'cannot create {raw_folder} to download MNIST into ({e.strerror}).'
                         + _laptop_hint(data_dir)) from None
    # torchvision here, not at the top: serve.py imports this module, and would start seconds later with it
    from torchvision import datasets
    from torchvision.datasets.utils import download_and_extract_archive
    mirrors = [(m.rstrip('/') + '/', False) for m in [os.environ.get('MNIST_MIRROR')] if m]
    mirrors += [(m, True) for m in datasets.MNIST.mirrors]
    md5s = dict(datasets.MNIST.resources)
    error = ''
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
                    error = f' The last download error was: {mirror}{name}.gz: {str(e).rstrip(".")}.'
            else:
                break  # no mirror has this file: the others will not fare better
    finally:
        socket.setdefaulttimeout(old_timeout)
        shutil.rmtree(staging, ignore_errors=True)
        _writing.discard(staging)
    return error


class TensorLoader:
    """DataLoader's place for a dataset held whole in memory, on the training device: the transform runs once, over
    every image at the same time, and the batches are gathered by index on the device (no per-sample Python work,
    no host-to-device copy in the training loop). Takes DataLoader's batch_size, shuffle and sampler; shuffle=True
    draws each epoch's order from seed + epoch (set_epoch), so a restarted run sees the same batches."""

    def __init__(self, dataset, batch_size, shuffle=False, sampler=None, seed=0, device='cpu'):
        self.dataset, self.batch_size = dataset, batch_size
        # else one replica's DistributedSampler: the whole set, in the order of seed + epoch (or as it is)
        self.sampler = sampler if sampler is not None else DistributedSampler(dataset, 1, 0, shuffle=shuffle, seed=seed)
        # The images [N, 28, 28] seen as one 28x28 picture with N channels: ToTensor and Normalize
        # work pixel by pixel, so this one call gives every image bit for bit what it gives each.
        images = dataset.transform(dataset.data.numpy().transpose(1, 2, 0))
        self.images = images.unsqueeze(1).to(device)  # [N, 1, 28, 28]
        self.labels = dataset.targets.to(device)
        if self.labels.max() > 9:  # uint8 labels: never below 0
            raise SetupError(f'{dataset.raw_folder} holds labels outside 0..9: the label file is corrupt.')

    def set_epoch(self, epoch):
        self.sampler.set_epoch(epoch)

    def __len__(self):
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self):
        for indices in torch.tensor(list(self.sampler), device=self.images.device).split(self.batch_size):
            yield self.images[indices], self.labels[indices]


# === Checkpoints and stopping =====================================================================
# checkpoint.pth, beside best_model.pth, holds what a restarted job needs to go on where the last
# finished epoch left off. Every file is written whole or not at all, and a run that has to stop
# (a signal, a diverged loss, a full disk) stops without losing what it saved.

CHECKPOINT_KEYS = {'model', 'optimizer', 'epochs_done', 'best_val_accuracy', 'best_epoch'}
TRAINING_FLAGS = {'lr': '--lr', 'batch_size': '--batch-size', 'seed': '--seed'}  # they change the result
_writing = set()  # the temporary files and folders being written now (saves, downloads): a stop removes them
_epochs_saved = None  # epochs in this run's checkpoint, once resume() has set the run up (a stop's line says it)
_claimed = {}  # output folders this process holds locked (see claim), and their descriptors


def save_atomic(obj, path):
    """torch.save to a temporary file beside path, then rename it over path: a kill at any moment leaves either the
    old file or the new one, never a torn one; a failed write (a full disk) leaves the old one and says why."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)  # in memory first: torch.save turns a write error into an obscure one
    tmp_path = path + '.tmp'
    _writing.add(tmp_path)
    try:
        with open(tmp_path, 'wb') as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp_path)
        if not isinstance(e, OSError):
            raise
        raise SetupError(f'could not write {path} ({e.strerror or e}). The previous {os.path.basename(path)}, if '
                         f'any, is left as it was; once there is room (or the folder is writable again), the '
                         f'same command resumes from the last finished epoch.') from None
    finally:
        _writing.discard(tmp_path)


def claim(folder):
    """Lock folder for as long as this process runs (the system drops the lock when it ends, however it ends), so
    that a second run into the same folder at once stops at its start instead of writing over this one's files.
    Unguarded where there are no such locks: on Windows, or a filesystem without them."""
    key = os.path.realpath(folder)
    if fcntl is None or key in _claimed:
        return
    try:
        descriptor = os.open(key, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise SetupError(f'another run is writing to {folder} now (the same command in another terminal, or a job '
                         f'submitted twice): let it end, or stop it, before running again into this folder; or pass '
                         f'another --output-dir.') from None
    except OSError:  # no locks on this filesystem
        os.close(descriptor)
        return
    _claimed[key] = descriptor  # never closed: the lock lasts as long as the process


def load_checkpoint(args):
    """Check that --output-dir can be written and claim it; return its checkpoint.pth to resume from, or None.
    A damaged checkpoint is refused and kept, and so is one trained with other --lr, --batch-size or --seed."""
    folder = args.output_dir
    checkpoint_path = os.path.join(folder, 'checkpoint.pth')
    try:
        folder.encode()  # TensorBoard's writer takes UTF-8 paths only
    except UnicodeEncodeError:
        raise SetupError(f'the output folder {os.fsencode(folder).decode(errors="replace")} is not named in UTF-8 (a '
                         f'name in another encoding, GBK say), and TensorBoard cannot write there: pass '
                         f'--output-dir with a path in UTF-8.') from None
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:  # FileExistsError: a file has the folder's name (makedirs takes an existing folder)
        reason = 'a file has that name' if isinstance(e, FileExistsError) else e.strerror
        raise SetupError(f'cannot write to the output folder {folder} ({reason}); pass '
                         f'--output-dir with a folder you can write.' + _laptop_hint(folder)) from None
    claim(folder)
    if args.no_resume or not os.path.exists(checkpoint_path):
        return None
    try:
        # weights_only: tensors and plain values are all it may hold; no arbitrary objects are built.
        try:
            checkpoint = torch.load(checkpoint_path, map_location='cpu', weights_only=True)
        except Exception as e:
            raise ValueError(f'torch.load cannot read it as weights: {type(e).__name__}') from None
        missing = CHECKPOINT_KEYS - set(checkpoint)
        if missing:
            raise KeyError(f'no {", ".join(sorted(missing))}')
        SimpleCNN().load_state_dict(checkpoint['model'])
    except Exception as e:  # corrupt, truncated, another model, another program's file
        reason = f'{type(e).__name__}: {e}'.splitlines()[0][:300]
        raise SetupError(f'cannot resume from {checkpoint_path}: it is not a readable checkpoint of this '
                         f'model ({reason}). It was left as it is. To start fresh, pass --no-resume '
                         f'(it is then kept as checkpoint.pth.previous) or move it away.') from None
    # Checkpoints from before the record was kept still hold the lr, in the optimizer's state.
    recorded = checkpoint.get('hyperparameters', {'lr': checkpoint['optimizer']['param_groups'][0]['lr']})
    changed = [f'{flag} {recorded[name]} (now {getattr(args, name)})' for name, flag in TRAINING_FLAGS.items()
               if name in recorded and recorded[name] != getattr(args, name)]
    if changed:
        raise SetupError(f'{checkpoint_path} was trained with {", ".join(changed)}; resuming would mix the two '
                         f'settings in one run. To resume, pass the recorded values (a larger --epochs is '
                         f'fine). To train with the new ones, start a new run: add --no-resume (the earlier '
                         f'run is kept as best_model.pth.previous and checkpoint.pth.previous) or pass another '
                         f'--output-dir.')
    return checkpoint


def training_complete(checkpoint, num_epochs, best_model_path, main_process=True):
    """True, and says so, if the checkpoint already holds num_epochs epochs: nothing is left to do."""
    if checkpoint is None or checkpoint['epochs_done'] < num_epochs:
        return False
    if main_process:
        print(f'Training already complete: the checkpoint has {checkpoint["epochs_done"]} epochs, '
              f'best accuracy {checkpoint["best_val_accuracy"]:.2f}% at epoch {checkpoint["best_epoch"]} '
              f'in {best_model_path}. Pass a larger --epochs to train on, or --no-resume to start over.')
    return True


def resume(checkpoint, model, optimizer, best_model_path, main_process=True):
    """Load the checkpoint into model and optimizer; return (start_epoch, best_val_accuracy, best_epoch). Without
    one the run starts at epoch 0, and the main process (global rank 0) sets an earlier run (--no-resume) aside
    whole, as best_model.pth.previous and checkpoint.pth.previous."""
    global _epochs_saved
    _epochs_saved = 0 if checkpoint is None else checkpoint['epochs_done']
    if checkpoint is None:
        folder = os.path.dirname(best_model_path)
        earlier = [name for name in ('best_model.pth', 'checkpoint.pth') if os.path.exists(os.path.join(folder, name))]
        if main_process and earlier:
            for name in earlier:
                os.replace(os.path.join(folder, name), os.path.join(folder, name + '.previous'))
            print(f'Starting afresh: the earlier run is kept as {" and ".join(name + ".previous" for name in earlier)} '
                  f'in {folder}')
        return 0, 0.0, None
    model.load_state_dict(checkpoint['model'])
    optimizer.load_state_dict(checkpoint['optimizer'])
    if main_process:
        print(f'Resuming from epoch {checkpoint["epochs_done"]} (best accuracy so far '
              f'{checkpoint["best_val_accuracy"]:.2f}%)')
    return checkpoint['epochs_done'], checkpoint['best_val_accuracy'], checkpoint['best_epoch']


def save_checkpoint(args, writer, model, optimizer, epochs_done, best_val_accuracy, best_epoch):
    """Write checkpoint.pth in --output-dir at the end of an epoch, after the TensorBoard logs: they never lag it."""
    writer.flush()
    save_atomic({'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'epochs_done': epochs_done,
                 'best_val_accuracy': best_val_accuracy, 'best_epoch': best_epoch,
                 'hyperparameters': {name: getattr(args, name) for name in TRAINING_FLAGS}},
                os.path.join(args.output_dir, 'checkpoint.pth'))
    global _epochs_saved
    _epochs_saved = epochs_done


def stop_on_signals(args, main_process=True):
    """Make Ctrl-C (SIGINT), SIGTERM (what torchrun, Kubernetes and DLC send) and SIGHUP (a closed terminal;
    under nohup nothing) end the run at once, with exit code 128 + the signal, no traceback and no temporary file
    left, the main process saying in one line how to resume. Every finished epoch is already on disk."""
    def stop(signum, frame):
        for path in list(_writing):
            with contextlib.suppress(OSError):
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        if main_process:
            epochs_done = _epochs_saved
            if epochs_done is None and not args.no_resume:  # stopped before resume(): what the rerun finds
                try:
                    checkpoint_path = os.path.join(args.output_dir, 'checkpoint.pth')
                    epochs_done = torch.load(checkpoint_path, map_location='cpu', weights_only=True)['epochs_done']
                except Exception:
                    pass
            epochs_done = epochs_done or 0
            how = 'the same command without --no-resume' if args.no_resume and epochs_done else 'the same command'
            name = 'Ctrl-C' if signum == signal.SIGINT else signal.Signals(signum).name
            # Either stream may be gone (a closed terminal, on SIGHUP; a closed pipe): the exit code still says it
            with contextlib.suppress(OSError):
                sys.stdout.flush()
            with contextlib.suppress(OSError):
                sys.stderr.write(f'Stopped by {name}, after {epochs_done} finished epochs: {how} resumes from '
                                 f'epoch {epochs_done}.\n')
                sys.stderr.flush()
        os._exit(128 + signum)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    if hasattr(signal, 'SIGHUP') and signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:  # not on Windows
        signal.signal(signal.SIGHUP, stop)


def check_finite(loss, epoch, batch_idx=None):
    """Stop the run, before anything is saved, once a loss is nan or infinite: the model has diverged."""
    if not math.isfinite(loss):
        where = f'epoch {epoch}, batch {batch_idx}' if batch_idx is not None else f'the validation of epoch {epoch}'
        raise SetupError(f'training diverged: the loss became {loss} at {where}. checkpoint.pth and '
                         f'best_model.pth are left as the last finished epoch wrote them. The learning rate '
                         f'is probably too large: train again with a smaller --lr (the document uses 0.01), '
                         f'adding --no-resume if this output folder already has a checkpoint of this run.')
