"""Bad input gets one readable paragraph, a non-zero exit within seconds, and loses nothing saved. The scripts run in
the test's process (run_script) where the paragraph is the point, as processes where the process is."""
import os
import sys

import pytest

from conftest import (dist_cmd, in_tmp, make_mnist, run, run_into_a_closed_pipe, run_script, script_env,
                      skip_on_windows_pipes, train_cmd)

OFFLINE = dict(http_proxy='http://127.0.0.1:9', https_proxy='http://127.0.0.1:9', no_proxy='')


def fails(cmd, *messages, env=None, code=1, runner=run_script):
    """Run cmd (runner: run for a process), expect exit code and each message in stderr, no traceback; return
    stderr."""
    returncode, stdout, stderr = runner(cmd, env=env or script_env(**OFFLINE), check=False)
    assert returncode == code, f'exit {returncode}\n{stdout}\n{stderr}'
    assert 'Traceback' not in stderr
    for message in messages:
        assert message in stderr, stderr
    assert 'Train Epoch' not in stdout
    return stderr


@pytest.mark.parametrize('script', [train_cmd, dist_cmd])
def test_missing_data_offline_says_which_files_go_where(script, tmp_path):
    stderr = fails(script('--data-dir', tmp_path / 'data', '--output-dir', tmp_path / 'out'),
                   f'error: MNIST is not in {tmp_path}/data/MNIST/raw and could not be downloaded',
                   'train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, '
                   't10k-labels-idx1-ubyte', 'MNIST_MIRROR', runner=run)  # a process, offline
    assert len(stderr.strip().splitlines()) == 1
    assert not list((tmp_path / 'data' / 'MNIST' / 'raw').iterdir()), 'no partial download left'


def test_truncated_mnist_file_is_named(tmp_path):
    root = make_mnist(tmp_path / 'data', 64, 32)
    labels = root / 'MNIST' / 'raw' / 't10k-labels-idx1-ubyte'
    labels.write_bytes(labels.read_bytes()[:20])
    fails(train_cmd('--data-dir', root, '--output-dir', tmp_path / 'out'),
          f'error: {labels} is not a complete MNIST file', 'truncated or corrupt')


@pytest.mark.parametrize('script', [train_cmd, dist_cmd])
def test_unwritable_output_folder_is_found_before_reading_data(script, tmp_path):
    (tmp_path / 'a_file').write_text('')
    # The data folder does not exist either: the output folder must be the first thing checked.
    fails(script('--data-dir', tmp_path / 'nodata', '--output-dir', tmp_path / 'a_file' / 'out'),
          f'cannot write to the output folder {tmp_path}/a_file/out', '--output-dir')


@pytest.mark.skipif(sys.platform == 'win32', reason='a file name in bytes that are not UTF-8: not on Windows')
@pytest.mark.parametrize('script', [train_cmd, dist_cmd])
def test_an_output_folder_not_named_in_utf8_is_refused_before_training(script, tmp_path):
    """TensorBoard's writer failed on it with a traceback once the data was read (GBK's 测: \\xb2\\xe2)."""
    out = os.fsdecode(os.path.join(os.fsencode(tmp_path), b'\xb2\xe2'))
    fails(script('--data-dir', tmp_path / 'nodata', '--output-dir', out),
          f'error: the output folder {tmp_path}/\ufffd\ufffd is not named in UTF-8 (a name in another encoding, GBK '
          f'say), and TensorBoard cannot write there: pass --output-dir with a path in UTF-8.')
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(sys.platform != 'linux', reason='a folder named in bytes that are not UTF-8: macOS refuses it')
@pytest.mark.parametrize('script', [train_cmd, dist_cmd])
def test_a_data_folder_not_named_in_utf8_is_read(script, mnist_dir, tmp_path):
    """Read from a folder whose name is not UTF-8, with stdout strict (most UTF-8 locales)."""
    raw = os.path.join(os.fsencode(tmp_path), b'\xb2\xe2', b'MNIST', b'raw')
    os.makedirs(os.path.dirname(raw))
    os.symlink(mnist_dir / 'MNIST' / 'raw', raw)
    root = os.fsdecode(os.path.dirname(os.path.dirname(raw)))
    _, stdout, _ = run(script('--data-dir', root, '--output-dir', tmp_path / 'out', '--epochs', '1'),
                       env=script_env(PYTHONIOENCODING='utf-8:strict'))
    assert stdout.rstrip().endswith('Training complete. writer.close()'), stdout


@pytest.mark.one_leg('newest')  # torch-independent: a start-up error of our own
def test_default_dlc_paths_on_a_laptop_name_the_flags():
    # A laptop user without root: creating /mnt/data fails. Simulated, so /mnt/data is never made.
    laptop = ("import errno, os, runpy, sys\n"
              "real = os.makedirs\n"
              "def makedirs(path, *a, **k):\n"
              "    if str(path).startswith('/mnt/data'):\n"
              "        raise PermissionError(errno.EACCES, 'Permission denied', str(path))\n"
              "    return real(path, *a, **k)\n"
              "os.makedirs = makedirs\n"
              "sys.argv = ['mnist_train.py']\n"
              "runpy.run_path('mnist_train.py', run_name='__main__')\n")
    fails([sys.executable, '-c', laptop], 'cannot write to the output folder /mnt/data/output',
          'pass --data-dir and --output-dir', runner=run)


def test_corrupt_checkpoint_is_kept_and_refused(mnist_dir, tmp_path):
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'checkpoint.pth').write_bytes(b'not a checkpoint')
    (out / 'best_model.pth').write_bytes(b'an earlier result')
    fails(train_cmd('--data-dir', mnist_dir, '--output-dir', out),
          f'cannot resume from {out}/checkpoint.pth', 'It was left as it is', '--no-resume')
    assert (out / 'checkpoint.pth').read_bytes() == b'not a checkpoint'
    assert (out / 'best_model.pth').read_bytes() == b'an earlier result'


def test_checkpoint_of_another_model_is_refused_in_the_distributed_script(mnist_dir, tmp_path):
    import torch
    out = tmp_path / 'out'
    out.mkdir()
    torch.save({'model': torch.nn.Linear(2, 2).state_dict(), 'optimizer': {}, 'epochs_done': 1,
                'best_val_accuracy': 1.0, 'best_epoch': 0}, out / 'checkpoint.pth')
    fails(dist_cmd('--data-dir', mnist_dir, '--output-dir', out),
          'is not a readable checkpoint of this model', '--no-resume')


@pytest.mark.parametrize('script, flag, value, message', [
    (train_cmd, '--epochs', '0', "argument --epochs: must be a positive int, got '0'"),
    (dist_cmd, '--batch-size', '-64', "argument --batch-size: must be a positive int, got '-64'"),
    (train_cmd, '--lr', '0', "argument --lr: must be a positive float, got '0'"),
    (train_cmd, '--seed', '1' + '0' * 23, f"argument --seed: must be from -2**63 to 2**63 - 1, got '1{'0' * 23}'"),
    (dist_cmd, '--seed', 'x', "argument --seed: invalid seed value: 'x'"),
    (dist_cmd, '--join-timeout', 'inf', "argument --join-timeout: must be a positive float of at most 1,000,000,000, "
                                        "got 'inf'"),
    (dist_cmd, '--collective-timeout', '1e20', "argument --collective-timeout: must be a positive float of at most "
                                               "1,000,000,000, got '1e20'"),
])
def test_invalid_numbers(script, flag, value, message, tmp_path):
    fails(script(flag, value, *in_tmp(tmp_path)), message, code=2)


def test_unknown_backend(tmp_path):
    fails(dist_cmd('--backend', 'mpi', *in_tmp(tmp_path)), "argument --backend: invalid choice: 'mpi'", code=2)


def test_cuda_asked_for_without_cuda(tmp_path):
    fails(train_cmd('--device', 'cuda', *in_tmp(tmp_path)),
          '--device cuda was asked for, but this machine has 0 CUDA GPUs')
    fails(dist_cmd('--backend', 'nccl', *in_tmp(tmp_path)), 'needs CUDA, which is not available')


def test_half_set_distributed_environment(tmp_path):
    fails(dist_cmd(*in_tmp(tmp_path)), 'WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing',
          env=script_env(RANK='0'))
    # torchrun's per-process variables without the address to meet at:
    fails(dist_cmd(*in_tmp(tmp_path)), 'MASTER_ADDR, MASTER_PORT missing', 'Start the script with torchrun',
          env=script_env(RANK='0', WORLD_SIZE='2', LOCAL_RANK='0'))


@pytest.mark.one_leg('newest')  # Python's and ours
@skip_on_windows_pipes
@pytest.mark.parametrize('script', [train_cmd, dist_cmd])
def test_output_into_a_closed_pipe_ends_quietly(script, mnist_dir, tmp_path):
    # `python mnist_train.py | head` once head has ended: no traceback, no "Exception ignored" as Python exits
    assert run_into_a_closed_pipe(script('--data-dir', mnist_dir, '--output-dir', tmp_path)) == (141, '')


def test_debug_shows_the_traceback(tmp_path):
    returncode, _, stderr = run(train_cmd('--data-dir', tmp_path / 'none', '--output-dir', tmp_path / 'out',
                                          '--debug'), env=script_env(**OFFLINE), check=False)
    assert returncode == 1 and 'Traceback' in stderr and 'common.SetupError' in stderr
