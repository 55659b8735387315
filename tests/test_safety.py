"""The mistakes users really make end with the right result or one clear paragraph, never a lost result:
changed hyperparameters on resume, divergence, Ctrl-C and SIGTERM, a full disk, hand-made data folders,
a device that is not there, two runs at once into one folder. Both scripts, as processes where the process is the
point (signals, exit codes under torchrun), else in this process with their __main__ block (run_script)."""
import errno
import gzip
import os
import re
import signal
import socket
import time
from unittest import mock

import pytest
import torch

import common
from conftest import (ROOT, SIGHUP, Mirror, dist_cmd, free_port, gz_files, in_tmp, make_mnist, run, run_main,
                      run_script, script_env, skip_without_sighup, start, torchrun, torchrun_report, train_cmd)

FAST = ('--lr', '0.1', '--batch-size', '16', '--log-interval', '10')
OFFLINE = dict(http_proxy='http://127.0.0.1:9', https_proxy='http://127.0.0.1:9', no_proxy='')
SCRIPTS = pytest.mark.parametrize('script', [train_cmd, dist_cmd], ids=['single', 'distributed'])


def files(folder):
    """{name: bytes} of the files directly in folder."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def one_paragraph_error(result, code=1):
    returncode, stdout, stderr = result
    assert returncode == code, f'exit {returncode}\n{stdout}\n{stderr}'
    assert 'Traceback' not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


# --- 1. Changed hyperparameters on resume ---------------------------------------------------------

@SCRIPTS
def test_a_changed_learning_rate_or_batch_size_stops_before_any_work(script, mnist_dir, tmp_path):
    out, module = tmp_path / 'out', script()[1].stem
    run_main(module, '--data-dir', mnist_dir, '--output-dir', out, '--epochs', '1', *FAST)
    before = files(out)
    # The document's advice: look at the curves, then train again with more epochs and another lr.
    message = one_paragraph_error(run_script(script('--data-dir', mnist_dir, '--output-dir', out, '--epochs', '3',
                                                    '--lr', '0.05', '--batch-size', '32', '--log-interval', '10'),
                                             check=False))
    assert f'{out}/checkpoint.pth was trained with --lr 0.1 (now 0.05), --batch-size 16 (now 32)' in message
    assert '--no-resume' in message and '--output-dir' in message and 'pass the recorded values' in message
    assert files(out) == before

    # The two ways on: the recorded values resume (flags that do not change the result may differ) ...
    stdout = run_main(module, '--data-dir', mnist_dir, '--output-dir', out, '--epochs', '2', *FAST,
                      '--log-interval', '7', '--val-batch-size', '50')
    assert 'Resuming from epoch 1 ' in stdout and 'Epoch 1 done' in stdout
    # ... and --no-resume starts a new run with the new values.
    stdout = run_main(module, '--data-dir', mnist_dir, '--output-dir', out, '--epochs', '1', '--lr', '0.05',
                      '--no-resume', '--log-interval', '10')
    assert 'Resuming' not in stdout and 'Epoch 0 done' in stdout
    assert torch.load(out / 'checkpoint.pth', weights_only=True)['hyperparameters'] == \
        {'lr': 0.05, 'batch_size': 64, 'seed': 0}


def test_a_changed_seed_stops_and_a_checkpoint_from_before_the_record_still_resumes(mnist_dir, tmp_path):
    out = tmp_path / 'out'
    run_main('mnist_train', '--data-dir', mnist_dir, '--output-dir', out, '--epochs', '1', *FAST)
    message = one_paragraph_error(run_script(train_cmd('--data-dir', mnist_dir, '--output-dir', out, '--epochs', '2',
                                                       '--seed', '1', *FAST), check=False))
    assert 'was trained with --seed 0 (now 1)' in message
    # A checkpoint written before the hyperparameters were recorded: its optimizer state still holds
    # the lr, so a changed --lr is caught; the same flags resume as they always did.
    checkpoint = torch.load(out / 'checkpoint.pth', weights_only=True)
    del checkpoint['hyperparameters']
    torch.save(checkpoint, out / 'checkpoint.pth')
    message = one_paragraph_error(run_script(train_cmd('--data-dir', mnist_dir, '--output-dir', out, '--epochs', '2',
                                                       *FAST, '--lr', '0.05'), check=False))
    assert 'was trained with --lr 0.1 (now 0.05)' in message
    stdout = run_main('mnist_train', '--data-dir', mnist_dir, '--output-dir', out, '--epochs', '2', *FAST)
    assert stdout.startswith('Resuming from epoch 1 ') and 'Epoch 1 done' in stdout


# --- 2. Divergence ----------------------------------------------------------------------------------

def test_divergence_stops_at_once_and_keeps_the_last_good_epoch(mnist_dir, tmp_path):
    out = tmp_path / 'out'
    run_main('mnist_train', '--data-dir', mnist_dir, '--output-dir', out, '--epochs', '1', *FAST)  # the good epoch
    # A run whose first epoch went well at a learning rate that diverges in its second: edited into
    # the checkpoint, since no learning rate does both reliably on the tiny data.
    checkpoint = torch.load(out / 'checkpoint.pth', weights_only=True)
    checkpoint['hyperparameters']['lr'] = checkpoint['optimizer']['param_groups'][0]['lr'] = 1e6
    torch.save(checkpoint, out / 'checkpoint.pth')
    before = files(out)
    result = run_script(train_cmd('--data-dir', mnist_dir, '--output-dir', out, '--epochs', '5', '--lr', '1e6',
                                  '--batch-size', '16', '--log-interval', '10'), check=False)
    message = one_paragraph_error(result)
    assert re.search(r'training diverged: the loss became (nan|inf) at epoch 1, batch \d+\. ', message), message
    assert 'smaller --lr' in message
    assert 'Epoch 1 done' not in result[1] and 'Model saved' not in result[1]
    assert files(out) == before, 'checkpoint.pth and best_model.pth keep epoch 0'


@pytest.mark.parametrize('launch', ['single', 'torchrun'])
def test_divergence_in_the_first_epoch_saves_nothing(launch, mnist_dir, tmp_path):
    out = tmp_path / 'out'
    args = ('--data-dir', mnist_dir, '--output-dir', out, '--epochs', '3', '--lr', '1e6', '--batch-size', '16',
            '--log-interval', '10')
    if launch == 'single':
        message = one_paragraph_error(run_script(train_cmd(*args), check=False))
        assert re.search(r'the loss became (nan|inf) at epoch 0, batch \d+', message)
    else:
        returncode, stdout, stderr = run(torchrun('--standalone', '--nproc_per_node=2',
                                                  ROOT / 'mnist_train_distributed.py', *args), check=False)
        assert returncode != 0  # every rank stops on its own rather than waiting for the other one
        rank, message = torchrun_report(stderr)['root']  # the paragraph, in torchrun's failure report
        assert re.match(r'error: training diverged: the loss became (nan|inf) at epoch 0, batch \d+', message), stderr
        assert not re.search(r'File ".*(mnist_train_distributed|common)\.py"', stderr), 'no traceback of ours'
    assert sorted(p.name for p in out.iterdir()) == ['runs'], 'no best_model.pth, no checkpoint.pth'


# --- 3. Ctrl-C and SIGTERM --------------------------------------------------------------------------

@pytest.mark.one_leg('newest')  # the stop's handler and line are ours; test_single resumes in both legs
@pytest.mark.parametrize('signum, code, name', [(signal.SIGINT, 130, 'Ctrl-C'), (signal.SIGTERM, 143, 'SIGTERM')])
@pytest.mark.slow
def test_an_interrupt_ends_with_one_line_and_the_rerun_resumes(signum, code, name, mnist_big_dir, tmp_path):
    out = tmp_path / 'out'
    args = ('--data-dir', mnist_big_dir, '--output-dir', out, '--epochs', '3', '--log-interval', '20')
    proc, reader = start(train_cmd(*args))
    reader.wait_for(lambda line: line.startswith('Train Epoch: 1 [1280/'))
    proc.send_signal(signum)
    output = reader.rest(timeout=60)
    assert proc.returncode == code, output
    assert 'Traceback' not in output
    assert output.rstrip().endswith(f'Stopped by {name}, after 1 finished epochs: the same command resumes '
                                    f'from epoch 1.'), output
    assert sorted(p.name for p in out.iterdir()) == ['best_model.pth', 'checkpoint.pth', 'runs'], 'no .tmp left'
    _, stdout, _ = run_script(train_cmd(*args))
    assert stdout.startswith('Resuming from epoch 1 ') and re.findall(r'^Epoch (\d) done', stdout, re.M) == ['1', '2']


@pytest.mark.one_leg('newest')  # the stop's advice and the refusal are ours
@pytest.mark.parametrize('flags', [(), ('--lr', '0.05')], ids=['same flags', 'changed lr'])
def test_a_no_resume_run_stopped_in_its_first_epoch_gives_advice_that_works(flags, mnist_dir, mnist_big_dir, tmp_path):
    out = tmp_path / 'out'
    run_main('mnist_train', '--data-dir', mnist_dir, '--output-dir', out, '--epochs', '1', *FAST)  # an earlier run
    earlier = files(out)
    args = ('--data-dir', mnist_big_dir, '--output-dir', out, '--epochs', '1', '--log-interval', '20', *flags)
    proc, reader = start(train_cmd(*args, '--no-resume'))
    reader.wait_for(lambda line: line.startswith('Train Epoch: 0 [1280/'))
    proc.send_signal(signal.SIGTERM)
    output = reader.rest(timeout=60)
    assert f'Starting afresh: the earlier run is kept as best_model.pth.previous and checkpoint.pth.previous in ' \
           f'{out}' in output
    assert output.rstrip().endswith('Stopped by SIGTERM, after 0 finished epochs: the same command resumes from '
                                    'epoch 0.'), output
    assert files(out) == {'best_model.pth.previous': earlier['best_model.pth'],
                          'checkpoint.pth.previous': earlier['checkpoint.pth']}, 'the earlier run set aside whole'
    # The same command, or the same without --no-resume: a run from epoch 0 with these flags, not a refusal
    # nor "Training already complete".
    _, stdout, _ = run_script(train_cmd(*args))
    assert 'Resuming' not in stdout and 'already complete' not in stdout
    assert re.findall(r'^Epoch (\d) done', stdout, re.M) == ['0'] and (out / 'best_model.pth').exists()


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_every_rank_and_the_rerun_resumes(mnist_big_dir, tmp_path):
    out = tmp_path / 'out'
    args = ('--data-dir', mnist_big_dir, '--output-dir', out, '--epochs', '3', '--log-interval', '20')
    launch = ('--nnodes=1', '--node_rank=0', '--master_addr=127.0.0.1', '--nproc_per_node=2')
    proc, reader = start(torchrun(*launch, f'--master_port={free_port()}', ROOT / 'mnist_train_distributed.py', *args))
    reader.wait_for(lambda line: line.startswith('Rank: 0, Local_Rank: 0 -- Train Epoch: 1 [2560/'))
    proc.send_signal(signal.SIGTERM)  # what DLC and Kubernetes do to stop a job
    output = reader.rest(timeout=90)
    assert proc.returncode == 1, 'torchrun exits 1 when signalled (its SignalException); each worker exits 143'
    assert output.count('Stopped by SIGTERM, after 1 finished epochs: the same command resumes from epoch 1.') == 1
    assert not re.search(r'^\s*File ".*mnist_train_distributed.py"', output, re.M), 'no traceback of ours'
    assert sorted(p.name for p in out.iterdir()) == ['best_model.pth', 'checkpoint.pth', 'runs']
    _, stdout, _ = run(torchrun(*launch, f'--master_port={free_port()}', ROOT / 'mnist_train_distributed.py', *args))
    assert 'Resuming from epoch 1 ' in stdout and re.findall(r'^Epoch (\d) done', stdout, re.M) == ['1', '2']


def test_sigterm_to_every_rank_exits_143(mnist_big_dir, tmp_path):
    """Each worker's own exit code, which torchrun does not pass on: ranks started by plain python, one
    per pod as Kubeflow's PyTorchJob starts them, each get SIGTERM when the job is stopped."""
    out, port = tmp_path / 'out', free_port()
    procs = [start(dist_cmd('--data-dir', mnist_big_dir, '--output-dir', out, '--epochs', '3', '--log-interval', '20'),
                   env=script_env(RANK=str(rank), WORLD_SIZE='2', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port)))
             for rank in (0, 1)]
    procs[0][1].wait_for(lambda line: line.startswith('Rank: 0, Local_Rank: 0 -- Train Epoch: 1 [2560/'))
    for proc, _ in procs:
        proc.send_signal(signal.SIGTERM)
    outputs = [reader.rest(timeout=60) for _, reader in procs]
    assert [proc.returncode for proc, _ in procs] == [143, 143], outputs
    assert outputs[0].rstrip().endswith('Stopped by SIGTERM, after 1 finished epochs: the same command resumes from '
                                        'epoch 1.'), outputs[0]
    assert 'Stopped' not in outputs[1] and not any('Traceback' in output or 'error:' in output for output in outputs)
    assert sorted(p.name for p in out.iterdir()) == ['best_model.pth', 'checkpoint.pth', 'runs']


@pytest.mark.one_leg('newest')  # our download's staging folder and the stop's clean-up
@pytest.mark.parametrize('signum, code, name', [(signal.SIGTERM, 143, 'SIGTERM'),
                                               pytest.param(SIGHUP, 129, 'SIGHUP', marks=skip_without_sighup)])
def test_a_stop_during_the_first_download_leaves_nothing_behind(signum, code, name, mnist_big_dir, tmp_path):
    mirror = Mirror(gz_files(mnist_big_dir), delay=0.05)  # slow: a download to stop in the middle of
    data, raw = tmp_path / 'data', tmp_path / 'data' / 'MNIST' / 'raw'
    env = script_env(MNIST_MIRROR=mirror.url, **{**OFFLINE, 'no_proxy': '127.0.0.1'})
    proc, reader = start(train_cmd('--data-dir', data, '--output-dir', tmp_path / 'out'), env=env)
    deadline = time.monotonic() + 60
    while not list(raw.glob('.download-*/*')) and time.monotonic() < deadline:  # a file half downloaded
        time.sleep(0.05)
    assert list(raw.glob('.download-*/*')), reader.drain()
    proc.send_signal(signum)  # SIGHUP: its terminal closed (an SSH session dropped)
    output = reader.rest(timeout=60)
    mirror.close()
    assert proc.returncode == code and 'Traceback' not in output, output
    assert output.rstrip().endswith(f'Stopped by {name}, after 0 finished epochs: the same command resumes from '
                                    f'epoch 0.'), output
    assert [p.name for p in raw.iterdir() if p.name.startswith('.') or p.suffix in ('.gz', '.tmp')] == [], \
        'no staging folder, no partial file'
    for path in raw.iterdir():  # what finished downloading is whole
        assert common.check_idx_file(path) > 0


# --- 4. A full disk ---------------------------------------------------------------------------------

def full_disk_after(saves):
    """os.fsync of a disk that fills up once `saves` files are saved: ENOSPC from then on."""
    calls, real_fsync = [0], os.fsync

    def fsync(fd):
        calls[0] += 1
        if calls[0] > saves:
            raise OSError(errno.ENOSPC, 'No space left on device')
        return real_fsync(fd)
    return mock.patch.object(os, 'fsync', fsync)


@SCRIPTS
def test_a_full_disk_names_the_file_keeps_the_previous_ones_and_the_rerun_resumes(script, mnist_dir, tmp_path):
    out = tmp_path / 'out'
    args = script('--data-dir', mnist_dir, '--output-dir', out, '--epochs', '3', *FAST)
    with full_disk_after(2):  # the third file the script saves
        message = one_paragraph_error(run_script(args, check=False))
    # Epoch 0 saved best_model.pth and checkpoint.pth; the first save of epoch 1 found the disk full.
    assert re.search(rf'error: could not write {out}/(best_model|checkpoint)\.pth \(No space left on device\)\. '
                     r'The previous (best_model|checkpoint)\.pth, if any, is left as it was', message), message
    assert sorted(p.name for p in out.iterdir()) == ['best_model.pth', 'checkpoint.pth', 'runs'], 'no .tmp left'
    checkpoint = torch.load(out / 'checkpoint.pth', weights_only=True)
    assert checkpoint['epochs_done'] == 1
    best = torch.load(out / 'best_model.pth', weights_only=True)  # epoch 0's, whole: the failed save left it
    assert all(torch.equal(best[key], checkpoint['model'][key]) for key in best)
    _, stdout, _ = run_script(args)  # space freed: the same command
    assert 'Resuming from epoch 1 ' in stdout and 'Epoch 2 done' in stdout


# --- 5. The data users really have ------------------------------------------------------------------

@SCRIPTS
def test_the_gz_files_alone_are_used_offline(script, tmp_path):
    root = make_mnist(tmp_path / 'data', 64, 32)
    raw = root / 'MNIST' / 'raw'
    originals = {}
    for path in list(raw.iterdir()):
        originals[path.name] = path.read_bytes()
        (raw / (path.name + '.gz')).write_bytes(gzip.compress(originals[path.name]))
        path.unlink()
    _, stdout, _ = run_script(script('--data-dir', root, '--output-dir', tmp_path / 'out', '--epochs', '1', *FAST),
                              env=script_env(**OFFLINE))
    assert 'Epoch 0 done' in stdout
    assert {name: (raw / name).read_bytes() for name in originals} == originals
    assert sorted(p.name for p in raw.iterdir()) == sorted(list(originals) + [n + '.gz' for n in originals])


@pytest.mark.one_leg('newest')  # gzip and our extraction
def test_a_broken_gz_file_is_named(tmp_path):
    root = make_mnist(tmp_path / 'data', 64, 32)
    labels = root / 'MNIST' / 'raw' / 't10k-labels-idx1-ubyte'
    (labels.parent / (labels.name + '.gz')).write_bytes(gzip.compress(labels.read_bytes())[:30])
    labels.unlink()
    message = one_paragraph_error(run(train_cmd('--data-dir', root, '--output-dir', tmp_path / 'out'),
                                      env=script_env(**OFFLINE), check=False))
    assert f'MNIST is not in {root}/MNIST/raw and could not be downloaded (missing: t10k-labels-idx1-ubyte)' in message
    assert f'{labels}.gz could not be used' in message
    assert sorted(p.name for p in labels.parent.iterdir() if p.name.startswith('t10k-labels')) == \
        ['t10k-labels-idx1-ubyte.gz'], 'no partial file left'


# --- 6. Two runs at once into one folder -----------------------------------------------------------

@pytest.mark.skipif(common.fcntl is None, reason='no folder locks on Windows: two runs there are not told apart')
@pytest.mark.one_leg('newest')  # the folder's lock is ours
@pytest.mark.slow
def test_a_second_run_into_the_folder_of_a_running_one_stops_and_changes_nothing(mnist_big_dir, tmp_path):
    out = tmp_path / 'out'
    args = ('--data-dir', mnist_big_dir, '--output-dir', out, '--epochs', '2', '--log-interval', '20')
    proc, reader = start(train_cmd(*args))
    reader.wait_for(lambda line: line.startswith('Train Epoch: 1 ['))  # its first checkpoint saved
    proc.send_signal(signal.SIGSTOP)  # it holds the folder, whenever the second run comes
    try:
        before = files(out)
        refusal = (f'error: another run is writing to {out} now (the same command in another terminal, or a job '
                   f'submitted twice): let it end, or stop it, before running again into this folder; or pass '
                   f'another --output-dir.')
        assert one_paragraph_error(run_script(train_cmd(*args), check=False)) == refusal
        # Rank 0, refused, ends 6 s late (as a GPU's teardown may): torch 2.3's torchrun looks every 5 s
        slow_exit = tmp_path / 'slow_exit'
        slow_exit.mkdir()
        (slow_exit / 'sitecustomize.py').write_text("import atexit, os, time\n"
                                                    "if os.environ.get('RANK') == '0':\n"
                                                    "    atexit.register(time.sleep, 6)\n")
        job, job_output = start(torchrun('--nnodes=1', '--nproc_per_node=2', '--master_addr=127.0.0.1',
                                         f'--master_port={free_port()}', ROOT / 'mnist_train_distributed.py', *args),
                                env=script_env(PYTHONPATH=os.pathsep.join(filter(None, (
                                    str(slow_exit), os.environ.get('PYTHONPATH'))))))
        report = torchrun_report(job_output.rest(timeout=120))
        # Rank 0's paragraph as the root cause; rank 1's pointer too where torchrun reports it (newer torch)
        assert job.returncode == 1 and report['root'] == (0, refusal), job_output.lines
        assert report['others'] in ([], [(1, f"error: stopped because rank 0 ({socket.gethostname()}) failed during "
                                             f"set-up (the root cause: see its node's report)")]), job_output.lines
        assert files(out) == before, 'nothing of the running one written over'
    finally:
        proc.send_signal(signal.SIGCONT)
    output = reader.rest(timeout=120)
    assert proc.returncode == 0 and output.rstrip().endswith('Training complete. writer.close()'), output
    _, stdout, _ = run_script(train_cmd(*args))  # once it has ended, the folder is free again
    assert stdout.startswith('Training already complete'), stdout


# --- 7. Devices -------------------------------------------------------------------------------------

def test_a_device_that_is_not_there_gets_a_clear_message(tmp_path):
    if torch.backends.mps.is_available():
        pytest.skip('this machine has MPS')
    message = one_paragraph_error(run_script(train_cmd('--device', 'mps', *in_tmp(tmp_path)), check=False))
    assert message.startswith('error: --device mps is not available on this machine (MPS needs a Mac')
    message = one_paragraph_error(run_script(dist_cmd('--device', 'mps', *in_tmp(tmp_path)), check=False))
    assert message.startswith('error: --device mps: the distributed script trains on cpu, or on cuda')


def test_training_and_validation_use_no_float64(mnist_dir):
    """MPS has no float64: nothing on the training or validation path may create it."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torchvision import datasets
    import common
    import mnist_train

    class Dtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    self.seen.add(t.dtype)
            return out

    class Writer:
        def add_scalar(self, *args):
            pass

    model = common.SimpleCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Dtypes() as mode:
        train_dataset = datasets.MNIST(root=mnist_dir, train=True, transform=mnist_train.transform)
        val_dataset = datasets.MNIST(root=mnist_dir, train=False, transform=mnist_train.transform)
        train_loader = common.TensorLoader(train_dataset, batch_size=64, shuffle=True)
        val_loader = common.TensorLoader(val_dataset, batch_size=64)
        mnist_train.train(model, train_loader, optimizer, torch.nn.CrossEntropyLoss(), 0, 'cpu', Writer(), 5)
        mnist_train.validate(model, val_loader, torch.nn.CrossEntropyLoss(), 'cpu', Writer(), 0)
    assert torch.float32 in mode.seen and torch.float64 not in mode.seen, mode.seen
