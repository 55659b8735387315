"""Unit tests of common.py's set-up helpers: devices, data folders, extraction and download, checkpoints,
resuming and stopping. Each message is asserted as the user reads it (the scripts print it as it is)."""
import argparse
import errno
import gzip
import hashlib
import io
import os
import re
import signal
import socket
import sys

import pytest
import torch
from torchvision import datasets
from torchvision.datasets import utils as download_utils

import common
from conftest import FILES, SIGHUP, Mirror, gz_files, make_mnist


def args_for(folder, no_resume=False, lr=0.01, batch_size=64, seed=0):
    return argparse.Namespace(output_dir=str(folder), no_resume=no_resume, lr=lr, batch_size=batch_size, seed=seed)


@pytest.fixture
def hint(monkeypatch):
    """_laptop_hint replaced by one that names its argument, to see where each message asks for it."""
    monkeypatch.setattr(common, '_laptop_hint', lambda path: f' [hint for {path}]')


# --- --device -----------------------------------------------------------------------------------

def test_check_device_gives_the_cpu():
    assert common.check_device('cpu') == torch.device('cpu')


def test_check_device_refuses_a_name_that_is_no_device():
    with pytest.raises(common.SetupError) as error:
        common.check_device('gpu0')
    assert str(error.value) == '--device gpu0 is not a device; pass cpu, cuda, cuda:N or mps.'


@pytest.mark.parametrize('name, count, gpus', [('cuda', 0, '0 CUDA GPUs'), ('cuda:1', 1, '1 CUDA GPU'),
                                               ('cuda:2', 2, '2 CUDA GPUs')])
def test_check_device_counts_the_gpus(name, count, gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: count)
    with pytest.raises(common.SetupError) as error:
        common.check_device(name)
    assert str(error.value) == (
        f'--device {name} was asked for, but this machine has {gpus}; pass --device cpu or run on a '
        f'GPU node (distributed: one process per GPU, so --nproc_per_node at most the number of GPUs).')


def test_check_device_tries_a_gpu_that_is_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    tried = []
    monkeypatch.setattr(torch, 'zeros', lambda *size, device: tried.append((size, device)))
    assert common.check_device('cuda:1') == torch.device('cuda', 1)
    assert common.check_device('cuda') == torch.device('cuda')
    assert tried == [((1,), torch.device('cuda', 1)), ((1,), torch.device('cuda'))]


@pytest.mark.parametrize('error, reason', [(RuntimeError('CUDA error: no kernel image\nCUDA kernel errors ...'),
                                            'CUDA error: no kernel image'),
                                           (AssertionError(), 'AssertionError'),
                                           (RuntimeError('x' * 300), 'x' * 200)])
def test_check_device_says_why_a_gpu_cannot_be_used(error, reason, monkeypatch):
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    monkeypatch.setattr(torch, 'zeros', lambda *size, device: (_ for _ in ()).throw(error))
    with pytest.raises(common.SetupError) as raised:
        common.check_device('cuda:0')
    assert str(raised.value) == (f'--device cuda:0 is not available on this machine ({reason}); pass --device cpu, '
                                 f'or leave --device out to use a CUDA GPU when there is one.')


@pytest.mark.skipif(sys.platform == 'darwin', reason='a Mac may have MPS')
def test_check_device_says_mps_needs_a_mac():
    with pytest.raises(common.SetupError, match=r'^--device mps is not available on this machine \(MPS needs a Mac '
                                                r'with Apple silicon and a PyTorch built for it\)'):
        common.check_device('mps')


# --- CPUs and threads ---------------------------------------------------------------------------

@pytest.mark.parametrize('files, affinity, expected', [
    ({}, 8, 8),  # no cgroup files: the affinity
    ({'cpu.max': 'max 100000\n'}, 8, 8),  # cgroup v2, no quota
    ({'cpu.max': '200000 100000\n'}, 64, 2),  # docker --cpus 2 on a 64-core host
    ({'cpu.max': '150000 100000\n'}, 64, 2),  # 1.5 CPUs: rounded up
    ({'cpu.max': '50000 100000\n'}, 64, 1),
    ({'cpu.max': '400000 100000\n'}, 3, 3),  # taskset to 3 cores: fewer than the quota
    ({'cpu/cpu.cfs_quota_us': '300000\n', 'cpu/cpu.cfs_period_us': '100000\n'}, 64, 3),  # cgroup v1
    ({'cpu/cpu.cfs_quota_us': '-1\n', 'cpu/cpu.cfs_period_us': '100000\n'}, 64, 64),  # v1, no quota
    ({'cpu.max': 'garbage'}, 4, 4),
    ({'cpu.max': 'abc 100000\n', 'cpu/cpu.cfs_quota_us': '200000\n', 'cpu/cpu.cfs_period_us': '100000\n'}, 4, 2),
    ({'cpu.max': '100000 0\n'}, 4, 4),
    ({'cpu.max': 'max 100000\n', 'cpu/cpu.cfs_quota_us': '200000\n', 'cpu/cpu.cfs_period_us': '100000\n'}, 4, 4),
], ids=['none', 'v2-max', 'v2-2', 'v2-1.5', 'v2-0.5', 'affinity', 'v1-3', 'v1-none', 'garbage', 'v2-bad-v1',
        'period-0', 'v2-first'])
def test_usable_cpus_follow_the_affinity_and_a_containers_quota(files, affinity, expected, tmp_path, monkeypatch):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(common, 'CGROUP', str(tmp_path))
    monkeypatch.setattr(common.os, 'sched_getaffinity', lambda pid: set(range(affinity)), raising=False)
    assert common.usable_cpus() == expected


@pytest.mark.parametrize('platform_cpus', [4, None])
def test_without_cpu_affinity_as_on_macos_the_cpu_count_is_used(platform_cpus, tmp_path, monkeypatch):
    monkeypatch.delattr(common.os, 'sched_getaffinity', raising=False)  # as on macOS
    monkeypatch.setattr(common.os, 'cpu_count', lambda: platform_cpus)
    monkeypatch.setattr(common, 'CGROUP', str(tmp_path))  # no cgroup files, as on macOS
    assert common.usable_cpus() == (platform_cpus or 1)


@pytest.mark.parametrize('omp, cpus, expected, line', [
    (None, 2, 2, 'CPU threads: 2, the CPUs this process may use (torch would start 8).\n'),  # a quota of 2
    (None, 8, 8, ''),  # no quota, or one of as many CPUs as torch's threads
    (None, 16, 8, ''),  # never more threads than torch's own count
    ('4', 2, 8, ''),  # OMP_NUM_THREADS: the user's or torchrun's choice, kept
], ids=['quota', 'no-quota', 'more-cpus', 'omp-set'])
def test_torch_threads_are_capped_at_the_usable_cpus(omp, cpus, expected, line, monkeypatch, capsys):
    threads = [8]  # torch's, as on an 8-core host; this test process's own torch is left as it is
    monkeypatch.setattr(common.torch, 'get_num_threads', lambda: threads[-1])
    monkeypatch.setattr(common.torch, 'set_num_threads', threads.append)
    monkeypatch.setattr(common, 'usable_cpus', lambda: cpus)
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    if omp:
        monkeypatch.setenv('OMP_NUM_THREADS', omp)
    common.limit_cpu_threads()
    assert threads[-1] == expected
    assert capsys.readouterr().out == line


def test_laptop_hint_only_for_the_dlc_mount():
    assert common._laptop_hint('/mnt/data/mnist') == (
        ' /mnt/data is the dataset mount of a DLC job; on another machine pass --data-dir and --output-dir (for '
        'example ./data and ./output), or use ./run_local.sh.')
    assert common._laptop_hint('/mnt/data') != '' and common._laptop_hint('data') == ''
    assert common._laptop_hint('/srv/mnt/data') == '' and common._laptop_hint('/mnt/data2/output') == ''


# --- prepare_mnist: checks, extraction -----------------------------------------------------------

def test_prepare_mnist_accepts_good_files_without_downloading(tmp_path, monkeypatch):
    root = make_mnist(tmp_path, 20, 10)
    monkeypatch.setattr(common, '_download', lambda *a: pytest.fail('nothing is missing: nothing to download'))
    assert common.prepare_mnist(str(root)) is None


def test_mismatched_validation_counts(tmp_path):
    root = make_mnist(tmp_path, 20, 10)
    other = make_mnist(tmp_path / 'other', 20, 12)
    raw = 'MNIST/raw/t10k-labels-idx1-ubyte'
    (root / raw).write_bytes((other / raw).read_bytes())
    with pytest.raises(common.SetupError) as error:
        common.prepare_mnist(str(root), download=False)
    assert str(error.value) == (f'{root}/MNIST/raw: t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte hold different '
                                f'numbers of items; replace them with a matching pair.')


def test_missing_files_are_listed_with_the_advice(tmp_path, hint):
    root = make_mnist(tmp_path, 20, 10)
    for name in FILES[1:3]:
        (root / 'MNIST' / 'raw' / name).unlink()
    with pytest.raises(common.SetupError) as error:
        common.prepare_mnist(str(root), download=False)
    assert str(error.value) == (
        f'MNIST is not in {root}/MNIST/raw and could not be downloaded (missing: train-labels-idx1-ubyte, '
        f't10k-images-idx3-ubyte). On a node without internet access, put the four files '
        f'{", ".join(FILES)} in that folder (uncompressed, or the .gz files as downloaded), for example by '
        f'uploading them to the dataset, or set MNIST_MIRROR to a URL prefix that serves them as .gz. '
        f'[hint for {root}]')


def compress_in_place(root, names):
    """Leave only the .gz of each file named, as downloaded by hand (the file itself kept as .good)."""
    raw = root / 'MNIST' / 'raw'
    for name in names:
        (raw / f'{name}.gz').write_bytes(gzip.compress((raw / name).read_bytes()))
        (raw / name).rename(raw / f'{name}.good')


def test_files_missing_beside_their_gz_are_extracted(tmp_path, monkeypatch):
    root = make_mnist(tmp_path, 20, 10)
    raw = root / 'MNIST' / 'raw'
    compress_in_place(root, FILES[:2])
    (raw / f'{FILES[2]}.gz').write_bytes(b'not this one: its file is there')
    seen = []
    real_replace = os.replace
    monkeypatch.setattr(common.os, 'replace', lambda src, dst: (seen.append((src, dst, set(common._writing))),
                                                                real_replace(src, dst)))
    missing = list(FILES[:2]) + ['t10k-labels-idx1-ubyte']
    assert common._extract_archives(str(raw), missing) == ''
    assert missing == ['t10k-labels-idx1-ubyte']
    for name in FILES[:2]:
        assert (raw / name).read_bytes() == (raw / f'{name}.good').read_bytes()
    assert [(src, dst) for src, dst, _ in seen] == [(f'{raw}/{name}.tmp', f'{raw}/{name}') for name in FILES[:2]]
    assert [writing for _, _, writing in seen] == [{f'{raw}/{name}.tmp'} for name in FILES[:2]]
    assert common._writing == set() and not list(raw.glob('*.tmp'))


@pytest.mark.parametrize('content, problem', [
    (b'not gzip', r"\(Not a gzipped file \(b'no'\)\)"),
    (gzip.compress(b'\x00\x00\x08\x01'), r'\(.*train-labels-idx1-ubyte.tmp is not a complete MNIST file: it is '
                                         r'truncated or corrupt \(its header is not that of an MNIST label file\)'),
], ids=['not-gzip', 'not-mnist'])  # ids of their own: gzip's bytes hold the time
def test_an_archive_that_cannot_be_used_is_named_and_leaves_nothing(content, problem, tmp_path, hint):
    root = make_mnist(tmp_path, 20, 10)
    raw = root / 'MNIST' / 'raw'
    (raw / 'train-labels-idx1-ubyte').unlink()
    (raw / 'train-labels-idx1-ubyte.gz').write_bytes(content)
    with pytest.raises(common.SetupError) as error:
        common.prepare_mnist(str(root), download=False)
    message = str(error.value)
    assert '(missing: train-labels-idx1-ubyte)' in message
    failure = message[message.index('.gz.') + 4:]
    assert failure.startswith(f' {raw}/train-labels-idx1-ubyte.gz could not be used (')
    assert failure.endswith(f'). [hint for {root}]') and re.search(problem, failure), failure
    assert sorted(os.listdir(raw)) == sorted(set(FILES) - {'train-labels-idx1-ubyte'} | {'train-labels-idx1-ubyte.gz'})
    assert common._writing == set()


def test_every_archive_that_cannot_be_used_is_named_also_when_downloading(tmp_path, mirrors):
    root = make_mnist(tmp_path, 20, 10)
    raw = root / 'MNIST' / 'raw'
    for name in FILES[:2]:
        (raw / name).unlink()
        (raw / f'{name}.gz').write_bytes(b'not gzip')
    with pytest.raises(common.SetupError) as error:
        common.prepare_mnist(str(root))  # no mirror: nothing downloaded
    assert all(f' {raw}/{name}.gz could not be used (' in str(error.value) for name in FILES[:2]), error.value


# --- prepare_mnist: downloads --------------------------------------------------------------------

@pytest.fixture
def archives(tmp_path_factory):
    return gz_files(make_mnist(tmp_path_factory.mktemp('source'), 20, 10))


@pytest.fixture
def mirrors(monkeypatch, archives):
    """Two local mirrors standing in for MNIST_MIRROR's and torchvision's (checksums of the tiny files)."""
    made = []

    def make(files, torchvision=False):
        mirror = Mirror(files)
        made.append(mirror)
        if torchvision:
            monkeypatch.setattr(datasets.MNIST, 'mirrors', [mirror.url])
        else:
            monkeypatch.setenv('MNIST_MIRROR', mirror.url.rstrip('/'))  # the / is added
        return mirror
    monkeypatch.setattr(datasets.MNIST, 'mirrors', [])
    monkeypatch.setattr(datasets.MNIST, 'resources',
                        [(name, hashlib.md5(data).hexdigest()) for name, data in archives.items()])
    monkeypatch.delenv('MNIST_MIRROR', raising=False)
    yield make
    for mirror in made:
        mirror.close()


def raw_listing(root):
    return sorted(os.listdir(root / 'MNIST' / 'raw'))


def test_download_from_mnist_mirror_with_a_timeout(tmp_path, mirrors, archives, monkeypatch):
    mirror = mirrors(archives)
    monkeypatch.setattr(datasets.MNIST, 'resources', [(name, '0' * 32) for name in archives])  # not checked
    calls = []
    real = download_utils.download_and_extract_archive
    monkeypatch.setattr(download_utils, 'download_and_extract_archive', lambda url, folder, md5: (
        calls.append((url, os.path.dirname(folder), os.path.basename(folder)[:10], md5, socket.getdefaulttimeout(),
                      common._writing == {folder})), real(url, folder, md5=md5)))
    socket.setdefaulttimeout(5)
    try:
        common.prepare_mnist(str(tmp_path / 'data'))
        assert socket.getdefaulttimeout() == 5, 'the timeout is put back'
    finally:
        socket.setdefaulttimeout(None)
    raw = tmp_path / 'data' / 'MNIST' / 'raw'
    assert raw_listing(tmp_path / 'data') == sorted(FILES)  # no staging folder, no .gz left
    for name in FILES:
        assert gzip.compress((raw / name).read_bytes(), mtime=0) == archives[f'{name}.gz']
    assert mirror.files_asked() == [f'/mnist/{name}.gz' for name in FILES]
    assert calls == [(f'{mirror.url}{name}.gz', str(raw), '.download-', None, 30, True) for name in FILES]
    assert common._writing == set()


def test_download_falls_back_to_torchvisions_mirror_with_checksums(tmp_path, mirrors, archives, monkeypatch):
    first = mirrors({name: data for name, data in archives.items() if name.startswith('train')})
    monkeypatch.setenv('MNIST_MIRROR', first.url)  # with its / at the end
    second = mirrors(archives, torchvision=True)
    make_mnist(tmp_path, 20, 10)
    (tmp_path / 'MNIST' / 'raw' / 'train-images-idx3-ubyte').unlink()  # into a folder that is there
    (tmp_path / 'MNIST' / 'raw' / 't10k-images-idx3-ubyte').unlink()
    common.prepare_mnist(str(tmp_path))
    assert raw_listing(tmp_path) == sorted(FILES)
    assert first.files_asked() == ['/mnist/train-images-idx3-ubyte.gz', '/mnist/t10k-images-idx3-ubyte.gz']
    assert second.files_asked() == ['/mnist/t10k-images-idx3-ubyte.gz']


def test_without_a_mirror_nothing_is_downloaded(tmp_path, mirrors, hint):
    with pytest.raises(common.SetupError) as error:
        common.prepare_mnist(str(tmp_path))
    assert str(error.value).endswith('set MNIST_MIRROR to a URL prefix that serves them as .gz. [hint for '
                                     f'{tmp_path}]'), 'no download error to tell'
    assert raw_listing(tmp_path) == []


def test_a_file_no_mirror_has_ends_the_download_with_its_error(tmp_path, mirrors, archives, hint):
    broken = dict(archives)
    broken['train-labels-idx1-ubyte.gz'] = gzip.compress(b'\x00\x00\x08\x01\x00\x00\x00\x05')  # 5 labels, none there
    first = mirrors(broken)
    second = mirrors({name: data + b'x' for name, data in archives.items()}, torchvision=True)  # checksums differ
    with pytest.raises(common.SetupError) as error:
        common.prepare_mnist(str(tmp_path))
    message = str(error.value)
    assert message.startswith(f'MNIST is not in {tmp_path}/MNIST/raw and could not be downloaded (missing: '
                              f'train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte).')
    assert message.endswith(f' The last download error was: {second.url}train-labels-idx1-ubyte.gz: File not found '
                            f'or corrupted. [hint for {tmp_path}]'), message
    assert first.files_asked() == ['/mnist/train-images-idx3-ubyte.gz', '/mnist/train-labels-idx1-ubyte.gz']
    assert second.files_asked() == ['/mnist/train-labels-idx1-ubyte.gz']  # the next files are not tried
    assert raw_listing(tmp_path) == ['train-images-idx3-ubyte'] and socket.getdefaulttimeout() is None


def test_download_names_a_damaged_file_and_an_unreachable_mirror(tmp_path, mirrors, archives, hint, monkeypatch):
    broken = dict(archives)
    broken['train-images-idx3-ubyte.gz'] = gzip.compress(b'\x00\x00\x08\x03')
    mirrors(broken)
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(('127.0.0.1', 0))
        port = closed.getsockname()[1]
    monkeypatch.setattr(datasets.MNIST, 'mirrors', [f'http://127.0.0.1:{port}/'])
    with pytest.raises(common.SetupError) as error:
        common.prepare_mnist(str(tmp_path))
    assert f' The last download error was: http://127.0.0.1:{port}/train-images-idx3-ubyte.gz: <urlopen error' \
           in str(error.value)
    assert raw_listing(tmp_path) == []


def test_download_into_a_folder_that_cannot_be_made(tmp_path, hint):
    (tmp_path / 'file').write_text('')
    with pytest.raises(common.SetupError) as error:
        common.prepare_mnist(str(tmp_path / 'file'))
    assert str(error.value) == f'cannot create {tmp_path}/file/MNIST/raw to download MNIST into (Not a directory). ' \
                               f'[hint for {tmp_path}/file]'


# --- checkpoints ---------------------------------------------------------------------------------

def checkpoint_of(model=None, epochs_done=2, best=75.0, best_epoch=1, **hyperparameters):
    model = model or common.SimpleCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=hyperparameters.get('lr', 0.01))
    return {'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'epochs_done': epochs_done,
            'best_val_accuracy': best, 'best_epoch': best_epoch,
            'hyperparameters': {'lr': 0.01, 'batch_size': 64, 'seed': 0, **hyperparameters}}


def test_load_checkpoint_makes_the_output_folder_and_finds_nothing_to_resume(tmp_path):
    folder = tmp_path / 'a' / 'b'
    assert common.load_checkpoint(args_for(folder)) is None
    assert os.listdir(folder) == []  # its test file is gone


@pytest.mark.skipif(not os.path.isdir('/sys/kernel'), reason='needs Linux sysfs: a folder no one can write, root too')
def test_load_checkpoint_refuses_an_unwritable_output_folder(hint):
    with pytest.raises(common.SetupError) as error:
        common.load_checkpoint(args_for('/sys/kernel'))
    assert str(error.value) == ('cannot write to the output folder /sys/kernel (Permission denied); pass --output-dir '
                                'with a folder you can write. [hint for /sys/kernel]')


def test_load_checkpoint_refuses_an_output_folder_that_is_a_file(tmp_path, hint):
    (tmp_path / 'out').write_text('')
    with pytest.raises(common.SetupError) as error:
        common.load_checkpoint(args_for(tmp_path / 'out'))
    assert str(error.value) == (f'cannot write to the output folder {tmp_path}/out (a file has that name); pass '
                                f'--output-dir with a folder you can write. [hint for {tmp_path}/out]')


def test_load_checkpoint_returns_the_checkpoint_unless_no_resume(tmp_path):
    saved = checkpoint_of()
    torch.save(saved, tmp_path / 'checkpoint.pth')
    loaded = common.load_checkpoint(args_for(tmp_path))
    assert loaded.keys() == saved.keys() and loaded['epochs_done'] == 2 and loaded['best_epoch'] == 1
    assert all(torch.equal(loaded['model'][k], v) for k, v in saved['model'].items())
    assert loaded['model']['fc2.bias'].device == torch.device('cpu')
    assert common.load_checkpoint(args_for(tmp_path, no_resume=True)) is None


def refusal(tmp_path, content):
    path = tmp_path / 'checkpoint.pth'
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    before = path.read_bytes()
    with pytest.raises(common.SetupError) as error:
        common.load_checkpoint(args_for(tmp_path))
    assert path.read_bytes() == before, 'the file is left as it is'
    message = str(error.value)
    start = f'cannot resume from {path}: it is not a readable checkpoint of this model ('
    end = ('). It was left as it is. To start fresh, pass --no-resume (it is then kept as checkpoint.pth.previous) '
           'or move it away.')
    assert message.startswith(start) and message.endswith(end), message
    return message[len(start):-len(end)]


def test_a_damaged_checkpoint_is_refused(tmp_path):
    reason = refusal(tmp_path, b'\x80\x02 not a torch file')
    assert reason.startswith('ValueError: torch.load cannot read it as weights: ') and reason.endswith('Error')


def test_a_checkpoint_holding_more_than_weights_is_refused(tmp_path):
    reason = refusal(tmp_path, {**checkpoint_of(), 'hyperparameters': argparse.Namespace(lr=0.01)})
    assert reason == 'ValueError: torch.load cannot read it as weights: UnpicklingError'


def test_a_checkpoint_without_its_keys_is_refused(tmp_path):
    saved = checkpoint_of()
    del saved['best_epoch'], saved['epochs_done']
    assert refusal(tmp_path, saved) == "KeyError: 'no best_epoch, epochs_done'"


def test_another_models_checkpoint_is_refused_with_the_first_line_of_why(tmp_path):
    reason = refusal(tmp_path, checkpoint_of(model=torch.nn.Linear(784, 10)))
    assert reason == 'RuntimeError: Error(s) in loading state_dict for SimpleCNN:'


def test_a_checkpoint_of_other_hyperparameters_is_refused(tmp_path):
    torch.save(checkpoint_of(lr=0.1, seed=3), tmp_path / 'checkpoint.pth')
    with pytest.raises(common.SetupError) as error:
        common.load_checkpoint(args_for(tmp_path, seed=4))
    assert str(error.value) == (
        f'{tmp_path}/checkpoint.pth was trained with --lr 0.1 (now 0.01), --seed 3 (now 4); resuming would mix the two '
        f'settings in one run. To resume, pass the recorded values (a larger --epochs is fine). To train with the '
        f'new ones, start a new run: add --no-resume (the earlier run is kept as best_model.pth.previous and '
        f'checkpoint.pth.previous) or pass another --output-dir.')


def test_an_older_checkpoint_has_its_lr_checked_from_the_optimizer(tmp_path):
    saved = checkpoint_of(lr=0.05)
    del saved['hyperparameters']  # written before the record was kept: only the lr is known
    torch.save(saved, tmp_path / 'checkpoint.pth')
    with pytest.raises(common.SetupError, match=r'was trained with --lr 0.05 \(now 0.01\); resuming'):
        common.load_checkpoint(args_for(tmp_path, seed=9, batch_size=8))
    assert common.load_checkpoint(args_for(tmp_path, lr=0.05, seed=9, batch_size=8))['epochs_done'] == 2


def test_a_record_of_some_hyperparameters_checks_those(tmp_path):
    saved = checkpoint_of()
    saved['hyperparameters'] = {'batch_size': 32}
    torch.save(saved, tmp_path / 'checkpoint.pth')
    assert common.load_checkpoint(args_for(tmp_path, batch_size=32, lr=0.5, seed=1)) is not None
    with pytest.raises(common.SetupError, match=r'was trained with --batch-size 32 \(now 64\); resuming'):
        common.load_checkpoint(args_for(tmp_path))


def test_training_complete_when_the_checkpoint_has_every_epoch(capsys):
    assert not common.training_complete(None, 3, 'out/best_model.pth')
    assert not common.training_complete(checkpoint_of(epochs_done=2), 3, 'out/best_model.pth')
    assert capsys.readouterr().out == ''
    assert common.training_complete(checkpoint_of(epochs_done=3, best=98.5, best_epoch=2), 3, 'out/best_model.pth')
    assert capsys.readouterr().out == (
        'Training already complete: the checkpoint has 3 epochs, best accuracy 98.50% at epoch 2 in '
        'out/best_model.pth. Pass a larger --epochs to train on, or --no-resume to start over.\n')
    assert common.training_complete(checkpoint_of(epochs_done=4), 3, 'x', main_process=False)
    assert capsys.readouterr().out == ''


def test_resume_loads_the_model_and_the_optimizer(capsys):
    torch.manual_seed(1)
    trained = common.SimpleCNN()
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.01, momentum=0.9)
    trained(torch.ones(2, 1, 28, 28)).sum().backward()
    optimizer.step()
    checkpoint = {'model': trained.state_dict(), 'optimizer': optimizer.state_dict(), 'epochs_done': 4,
                  'best_val_accuracy': 97.125, 'best_epoch': 3}
    model = common.SimpleCNN()
    fresh = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    assert common.resume(checkpoint, model, fresh, 'unused') == (4, 97.125, 3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), trained.state_dict().values()))
    assert str(fresh.state_dict()) == str(optimizer.state_dict())  # the momentum buffers too
    assert capsys.readouterr().out == 'Resuming from epoch 4 (best accuracy so far 97.12%)\n'
    common.resume(checkpoint, model, fresh, 'unused', main_process=False)
    assert capsys.readouterr().out == ''


def test_a_fresh_start_sets_the_earlier_run_aside_whole(tmp_path, capsys):
    best = tmp_path / 'best_model.pth'
    model = common.SimpleCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    assert common.resume(None, model, optimizer, str(best)) == (0, 0.0, None)  # nothing to keep
    best.write_text('earlier')
    assert common.resume(None, model, optimizer, str(best), main_process=False) == (0, 0.0, None)
    assert os.listdir(tmp_path) == ['best_model.pth'] and capsys.readouterr().out == ''
    assert common.resume(None, model, optimizer, str(best)) == (0, 0.0, None)
    assert os.listdir(tmp_path) == ['best_model.pth.previous']
    assert (tmp_path / 'best_model.pth.previous').read_text() == 'earlier'
    assert capsys.readouterr().out == \
        f'Starting afresh: the earlier run is kept as best_model.pth.previous in {tmp_path}\n'
    # With its checkpoint (--no-resume): both together, so the folder never claims a run whose model is gone.
    best.write_text('second')
    (tmp_path / 'checkpoint.pth').write_text('its checkpoint')
    common.resume(None, model, optimizer, str(best))
    assert sorted(os.listdir(tmp_path)) == ['best_model.pth.previous', 'checkpoint.pth.previous']
    assert (tmp_path / 'checkpoint.pth.previous').read_text() == 'its checkpoint'
    assert capsys.readouterr().out == (f'Starting afresh: the earlier run is kept as best_model.pth.previous and '
                                       f'checkpoint.pth.previous in {tmp_path}\n')


def test_save_checkpoint_flushes_the_logs_then_writes_everything_to_resume(tmp_path):
    model = common.SimpleCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    path = tmp_path / 'checkpoint.pth'

    class Writer:
        flushed_before_save = None

        def flush(self):
            self.flushed_before_save = not path.exists()
    writer = Writer()
    common.save_checkpoint(args_for(tmp_path, lr=0.5, batch_size=16, seed=7), writer, model, optimizer, 3, 88.0, 2)
    assert writer.flushed_before_save
    saved = torch.load(path, weights_only=True)
    assert saved.keys() == common.CHECKPOINT_KEYS | {'hyperparameters'}
    assert (saved['epochs_done'], saved['best_val_accuracy'], saved['best_epoch']) == (3, 88.0, 2)
    assert saved['hyperparameters'] == {'lr': 0.5, 'batch_size': 16, 'seed': 7}
    assert saved['optimizer']['param_groups'][0]['lr'] == 0.5
    assert all(torch.equal(saved['model'][k], v) for k, v in model.state_dict().items())
    assert common.load_checkpoint(args_for(tmp_path, lr=0.5, batch_size=16, seed=7))['epochs_done'] == 3


def held_elsewhere(folder):
    """Whether folder is locked against another open file of it, as another process would open it."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        common.fcntl.flock(descriptor, common.fcntl.LOCK_EX | common.fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)  # a lock taken here goes with it
    return False


@pytest.mark.skipif(common.fcntl is None, reason='no folder locks on Windows')
def test_claim_holds_the_folder_against_other_runs_and_takes_a_free_one(tmp_path):
    assert not held_elsewhere(tmp_path)
    common.load_checkpoint(args_for(tmp_path))  # claims it, for as long as this process runs
    common.claim(tmp_path / '.')  # the same folder again: this process holds it already
    assert held_elsewhere(tmp_path)
    held = tmp_path / 'held'
    held.mkdir()
    other_run = os.open(held, os.O_RDONLY)
    common.fcntl.flock(other_run, common.fcntl.LOCK_EX)
    try:
        with pytest.raises(common.SetupError) as error:
            common.claim(held)
        assert str(error.value) == (f'another run is writing to {held} now (the same command in another terminal, '
                                    f'or a job submitted twice): let it end, or stop it, before running again into '
                                    f'this folder; or pass another --output-dir.')
    finally:
        os.close(other_run)  # that run ends: the folder is free
    common.claim(held)
    assert held_elsewhere(held)


@pytest.mark.skipif(common.fcntl is None, reason='no folder locks on Windows')
def test_claim_leaves_a_folder_unguarded_where_there_are_no_locks(tmp_path, monkeypatch):
    def no_locks(descriptor, operation):
        raise OSError(errno.ENOLCK, 'No locks available')
    monkeypatch.setattr(common.fcntl, 'flock', no_locks)
    common.claim(tmp_path)  # no error: the run goes on unguarded
    assert os.path.realpath(tmp_path) not in common._claimed
    common.claim(tmp_path / 'missing')  # no folder: nothing to lock, no error


# --- stopping ------------------------------------------------------------------------------------

NO_SIGHUP = pytest.mark.skipif(SIGHUP is None, reason='no SIGHUP on Windows')


@pytest.fixture
def stop(monkeypatch, capsys):
    """stop(args, signum, main_process) installs stop_on_signals, signals, and returns (exit code, stderr)."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, SIGHUP) if s}

    class Exit(Exception):
        pass
    monkeypatch.setattr(common.os, '_exit', lambda code: (_ for _ in ()).throw(Exit(code)))
    monkeypatch.setattr(common, '_epochs_saved', None)  # no run set up yet in this process

    def run(args, signum, main_process=True):
        if SIGHUP:
            signal.signal(SIGHUP, signal.SIG_DFL)  # as in a terminal, even where the suite runs under nohup
        common.stop_on_signals(args, *([] if main_process is None else [main_process]))  # None: its default
        assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM)
        with pytest.raises(Exit) as code:
            signal.getsignal(signum)(signum, None)
        return code.value.args[0], capsys.readouterr().err
    yield run
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize('signum, code, name', [(signal.SIGTERM, 143, 'SIGTERM'), (signal.SIGINT, 130, 'Ctrl-C'),
                                               pytest.param(SIGHUP, 129, 'SIGHUP', marks=NO_SIGHUP)])
def test_a_stop_says_where_to_resume_and_exits_128_plus_the_signal(tmp_path, stop, signum, code, name):
    torch.save(checkpoint_of(epochs_done=3), tmp_path / 'checkpoint.pth')
    assert stop(args_for(tmp_path), signum) == (
        code, f'Stopped by {name}, after 3 finished epochs: the same command resumes from epoch 3.\n')


@NO_SIGHUP
def test_under_nohup_a_hangup_changes_nothing(tmp_path, stop):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts the script; the fixture restores it after
    common.stop_on_signals(args_for(tmp_path))
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


@NO_SIGHUP
def test_a_stop_with_its_terminal_gone_still_exits_with_its_code(tmp_path, stop, monkeypatch):
    class Gone(io.StringIO):  # a hung-up terminal: every write and flush fails with EIO
        def write(self, text=None):
            raise OSError(errno.EIO, 'Input/output error')
        flush = write
    monkeypatch.setattr(sys, 'stdout', Gone())
    monkeypatch.setattr(sys, 'stderr', Gone())
    assert stop(args_for(tmp_path), signal.SIGHUP) == (129, '')


def test_a_stop_reads_only_weights_of_the_checkpoint(tmp_path, stop):
    torch.save({**checkpoint_of(epochs_done=3), 'extra': argparse.Namespace()}, tmp_path / 'checkpoint.pth')
    assert stop(args_for(tmp_path), signal.SIGTERM, main_process=None) == (
        143, 'Stopped by SIGTERM, after 0 finished epochs: the same command resumes from epoch 0.\n')


def test_a_stop_before_a_checkpoint_resumes_from_0(tmp_path, stop):
    assert stop(args_for(tmp_path, no_resume=True), signal.SIGTERM) == (
        143, 'Stopped by SIGTERM, after 0 finished epochs: the same command resumes from epoch 0.\n')


def test_a_stop_of_a_no_resume_run_says_to_drop_the_flag(tmp_path, stop, monkeypatch):
    torch.save({'epochs_done': 1}, tmp_path / 'checkpoint.pth')
    monkeypatch.setattr(common, '_epochs_saved', 1)  # as save_checkpoint leaves it after this run's first epoch
    assert stop(args_for(tmp_path, no_resume=True), signal.SIGTERM) == (
        143, 'Stopped by SIGTERM, after 1 finished epochs: the same command without --no-resume resumes from '
             'epoch 1.\n')


def test_a_stop_of_a_no_resume_run_before_its_first_epoch_ignores_the_earlier_run(tmp_path, stop, monkeypatch):
    torch.save({'epochs_done': 20}, tmp_path / 'checkpoint.pth')  # the earlier run's, not yet set aside
    assert stop(args_for(tmp_path, no_resume=True), signal.SIGTERM) == (
        143, 'Stopped by SIGTERM, after 0 finished epochs: the same command resumes from epoch 0.\n')
    monkeypatch.setattr(common, '_epochs_saved', 0)  # set aside by resume(), no epoch finished since
    assert stop(args_for(tmp_path, no_resume=True), signal.SIGTERM) == (
        143, 'Stopped by SIGTERM, after 0 finished epochs: the same command resumes from epoch 0.\n')


def test_a_stop_counts_the_epochs_this_run_resumed_from_or_saved(tmp_path, stop):
    """resume() and save_checkpoint() record the count the stop line says, whatever checkpoint.pth holds then."""
    model = common.SimpleCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    best = str(tmp_path / 'best_model.pth')
    common.resume(checkpoint_of(model, epochs_done=4), model, optimizer, best)  # none on disk: the record counts
    assert stop(args_for(tmp_path), signal.SIGTERM) == (
        143, 'Stopped by SIGTERM, after 4 finished epochs: the same command resumes from epoch 4.\n')
    common.resume(None, model, optimizer, best)
    assert stop(args_for(tmp_path), signal.SIGTERM) == (
        143, 'Stopped by SIGTERM, after 0 finished epochs: the same command resumes from epoch 0.\n')
    args = args_for(tmp_path, no_resume=True)  # a stop of a --no-resume run reads no checkpoint.pth
    common.save_checkpoint(args, argparse.Namespace(flush=lambda: None), model, optimizer, 5, 90.0, 4)
    assert stop(args, signal.SIGTERM) == (
        143, 'Stopped by SIGTERM, after 5 finished epochs: the same command without --no-resume resumes from '
             'epoch 5.\n')


def test_a_stop_removes_what_is_being_written_and_only_rank_0_speaks(tmp_path, stop, monkeypatch):
    (tmp_path / 'best_model.pth.tmp').write_text('half')
    (tmp_path / '.download-x').mkdir()
    (tmp_path / '.download-x' / 'part.gz').write_text('half')
    (tmp_path / 'checkpoint.pth').write_text('kept')
    monkeypatch.setattr(common, '_writing', {str(tmp_path / 'best_model.pth.tmp'), str(tmp_path / '.download-x'),
                                             str(tmp_path / 'gone.tmp')})
    assert stop(args_for(tmp_path), signal.SIGTERM, main_process=False) == (143, '')
    assert os.listdir(tmp_path) == ['checkpoint.pth']


def test_check_finite_stops_a_diverged_run():
    common.check_finite(2.5, 0, 0)
    with pytest.raises(common.SetupError) as error:
        common.check_finite(float('nan'), 2, 0)
    assert str(error.value) == (
        'training diverged: the loss became nan at epoch 2, batch 0. checkpoint.pth and best_model.pth are left as '
        'the last finished epoch wrote them. The learning rate is probably too large: train again with a smaller '
        '--lr (the document uses 0.01), adding --no-resume if this output folder already has a checkpoint of this run.')
    diverged = r'^training diverged: the loss became -inf at the validation of epoch 1\. '
    with pytest.raises(common.SetupError, match=diverged):
        common.check_finite(float('-inf'), 1)
