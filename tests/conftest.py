"""Shared fixtures: tiny MNIST-format data made here, and ways to run the scripts as users do."""
import contextlib
import gzip
import http.server
import io
import os
import queue
import re
import runpy
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# SIGHUP (a closed terminal): none on Windows, and under nohup the suite's processes inherit it ignored, as the
# programs then rightly keep it: the tests of what it does skip there.
SIGHUP = getattr(signal, 'SIGHUP', None)
skip_without_sighup = pytest.mark.skipif(SIGHUP is None or signal.getsignal(SIGHUP) == signal.SIG_IGN,
                                         reason='no SIGHUP to send: Windows, or the suite runs under nohup')

FILES = ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte',
         't10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte')


def write_idx(path, array):
    """Write a uint8 array as an IDX file (the format of the MNIST files)."""
    magic = 0x0800 | array.ndim  # 0x08: unsigned byte
    header = magic.to_bytes(4, 'big') + b''.join(d.to_bytes(4, 'big') for d in array.shape)
    Path(path).write_bytes(header + array.astype(np.uint8).tobytes())


def make_mnist(root, n_train, n_test, seed=0):
    """Fake MNIST under root/MNIST/raw: class k is a bright 8x8 square at one of 10 places, in noise."""
    rng = np.random.default_rng(seed)
    raw = Path(root) / 'MNIST' / 'raw'
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, n in (('train', n_train), ('t10k', n_test)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 90, (n, 28, 28))
        for i, k in enumerate(labels):
            row, col = 2 + 12 * (k // 5), 1 + 5 * (k % 5)
            images[i, row:row + 8, col:col + 8] += 150
        write_idx(raw / f'{prefix}-images-idx3-ubyte', images)
        write_idx(raw / f'{prefix}-labels-idx1-ubyte', labels)
    return Path(root)


def gz_files(root):
    """{'name.gz': bytes}: the four MNIST files under root/MNIST/raw, compressed as MNIST's mirrors serve them."""
    return {f'{name}.gz': gzip.compress((Path(root) / 'MNIST' / 'raw' / name).read_bytes(), mtime=0) for name in FILES}


class Mirror(http.server.ThreadingHTTPServer):
    """An MNIST mirror on localhost: files {'name.gz': bytes} under .url; .gets lists every path asked for.

    torchvision asks for each file twice (a redirect check, then the file). delay: seconds between
    2 KiB pieces, for a download to stop in the middle of."""

    def __init__(self, files, delay=0):
        mirror, self.gets = self, []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                mirror.gets.append(self.path)
                data = files.get(self.path.removeprefix('/mnist/'))
                if data is None:
                    return self.send_error(404)
                self.send_response(200)
                self.send_header('Content-Length', str(len(data)))
                self.end_headers()
                for offset in range(0, len(data), 2048):
                    self.wfile.write(data[offset:offset + 2048])
                    time.sleep(delay)

            def log_message(self, *args):
                pass
        super().__init__(('127.0.0.1', 0), Handler)
        self.daemon_threads = True
        self.url = f'http://127.0.0.1:{self.server_port}/mnist/'
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def files_asked(self):
        """The paths asked for, in order, a file's two requests in a row counted once."""
        return [path for i, path in enumerate(self.gets) if self.gets[i - 1:i] != [path]]

    def downloads(self):
        """{file: times downloaded}."""
        return {name: self.gets.count(f'/mnist/{name}.gz') / 2 for name in FILES}

    def close(self):
        self.shutdown()
        self.server_close()


def png_header(width, height):
    """A grey PNG's header and no pixels: what a picture claims to be, in 45 bytes."""
    chunks = [(b'IHDR', struct.pack('>IIBBBBB', width, height, 8, 0, 0, 0, 0)), (b'IDAT', b'')]
    return b'\x89PNG\r\n\x1a\n' + b''.join(struct.pack('>I', len(data)) + kind + data
                                          + struct.pack('>I', zlib.crc32(kind + data)) for kind, data in chunks)


@pytest.fixture(scope='session')
def mnist_dir(tmp_path_factory):
    """A small set: 640 training and 200 validation images."""
    return make_mnist(tmp_path_factory.mktemp('data'), 640, 200)


@pytest.fixture(scope='session')
def mnist_big_dir(tmp_path_factory):
    """Long enough epochs (about a second) to stop a process in the middle of one."""
    return make_mnist(tmp_path_factory.mktemp('data_big'), 12800, 200, seed=1)


@pytest.fixture(scope='session')
def model_file(tmp_path_factory):
    """A model saved as the training scripts save it: weights of a fixed seed, whose predictions vary enough."""
    import torch
    import common
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp('model') / 'best_model.pth'
    torch.save(common.SimpleCNN().state_dict(), path)
    return path


def script_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'MNIST_MIRROR')}
    env.update(OMP_NUM_THREADS='1', CUDA_VISIBLE_DEVICES='')
    env.update(extra)
    return env


def run(args, env=None, timeout=180, check=True):
    """Run a command in the project root; return (returncode, stdout, stderr)."""
    result = subprocess.run([str(a) for a in args], cwd=ROOT, env=env or script_env(),
                            capture_output=True, text=True, errors='backslashreplace', timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f'{args} exited {result.returncode}\n--- stdout\n{result.stdout}'
                             f'\n--- stderr\n{result.stderr}')
    return result.returncode, result.stdout, result.stderr


def run_script(args, env=None, check=True):
    """run() of a training script's command, [python, SCRIPT, ARGS...], in this process, its __main__ block
    included: (exit code, stdout, stderr) as the process gives them, less its start-up (torch is imported already).
    For what a run says and writes; how a process starts, stops or meets a signal stays with run(). The
    environment, signal handlers, torch's threads and the output folder's lock are put back after it."""
    from unittest import mock
    import torch
    import torch.distributed as dist
    import common
    streams = [io.TextIOWrapper(io.BytesIO(), encoding='utf-8', write_through=True) for _ in range(2)]
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, SIGHUP) if signum}
    threads, claimed, returncode = torch.get_num_threads(), set(common._claimed), 0
    with mock.patch.dict(os.environ, env or script_env(), clear=True), \
            mock.patch.object(sys, 'argv', [str(a) for a in args[1:]]), \
            contextlib.redirect_stdout(streams[0]), contextlib.redirect_stderr(streams[1]):
        torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 in a process of script_env's
        try:
            runpy.run_path(str(args[1]), run_name='__main__')
        except SystemExit as e:  # as the interpreter ends: a message goes to stderr, with exit code 1
            returncode = 1 if isinstance(e.code, str) else e.code or 0
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except Exception:  # uncaught: a traceback
            traceback.print_exc()
            returncode = 1
        finally:
            torch.set_num_threads(threads)
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            for folder in set(common._claimed) - claimed:  # the output folder's lock, as the process's end
                os.close(common._claimed.pop(folder))
            if dist.is_initialized():
                dist.destroy_process_group()
    for stream in streams:
        stream.flush()
    stdout, stderr = (stream.buffer.getvalue().decode(errors='backslashreplace') for stream in streams)
    if check and returncode != 0:
        raise AssertionError(f'{args} exited {returncode}\n--- stdout\n{stdout}\n--- stderr\n{stderr}')
    return returncode, stdout, stderr


# Windows reports a write to a closed pipe as EINVAL, not as a broken pipe: not handled there
skip_on_windows_pipes = pytest.mark.skipif(sys.platform == 'win32', reason='a closed pipe is EINVAL on Windows')


def run_into_a_closed_pipe(args):
    """Run a command whose output's reader is gone, as in `command | head` once head has ended; return
    (returncode, stderr)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # before the command starts: its first line meets a closed pipe
    try:
        result = subprocess.run([str(a) for a in args], cwd=ROOT, env=script_env(), stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=180)
    finally:
        os.close(write_end)
    return result.returncode, result.stderr


def train_cmd(*args):
    return [sys.executable, ROOT / 'mnist_train.py', *args]


def dist_cmd(*args):
    return [sys.executable, ROOT / 'mnist_train_distributed.py', *args]


def run_main(module_name, *args):
    """A training script's main() in this process, as `python SCRIPT ARGS` runs it less the process's start-up
    (torch is imported already) and its end (signals, exit codes): its stdout. For what a run computes and
    writes; a test of how the process starts, stops or fails runs it as a process."""
    import importlib
    import io
    from unittest import mock
    import torch.distributed as dist
    module = importlib.import_module(module_name)
    output = io.StringIO()
    with mock.patch.dict(os.environ), mock.patch.object(sys, 'argv', [module_name, *map(str, args)]), \
            contextlib.redirect_stdout(output):
        os.environ.update(CUDA_VISIBLE_DEVICES='')
        threads, claimed = module.torch.get_num_threads(), set(module.common._claimed)
        module.torch.set_num_threads(1)  # as script_env's OMP_NUM_THREADS=1: the same arithmetic as a process's
        try:
            module.main(module.parse_args())
        finally:
            module.torch.set_num_threads(threads)
            for folder in set(module.common._claimed) - claimed:  # the output folder's lock, as the process's end
                os.close(module.common._claimed.pop(folder))
            if dist.is_initialized():
                dist.destroy_process_group()
    return output.getvalue()


def in_tmp(tmp_path):
    """--data-dir and --output-dir in tmp_path, for a run meant to stop at a check: one that let it through would
    otherwise read and write DLC's /mnt/data (as root, even where it is no mount)."""
    return '--data-dir', tmp_path / 'data', '--output-dir', tmp_path / 'out'


def torchrun(*args):
    return [sys.executable, '-m', 'torch.distributed.run', *args]


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class LineReader:
    """Reads a process's merged output on a thread, so a test can wait for a line with a timeout."""

    def __init__(self, proc):
        self.proc, self.lines, self._queue = proc, [], queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, predicate, timeout=120):
        """Return the first new line for which predicate holds; fail after timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError('timed out waiting for a line; output so far:\n' + ''.join(self.lines))
            if line is None:
                raise AssertionError('process ended before the line came; output:\n' + ''.join(self.lines))
            self.lines.append(line)
            if predicate(line):
                return line

    def drain(self):
        """Everything printed so far, without waiting for more."""
        while not self._queue.empty():
            line = self._queue.get()
            if line is None:
                self._queue.put(None)  # keep the end mark for rest()
                break
            self.lines.append(line)
        return ''.join(self.lines)

    def rest(self, timeout=180):
        """Wait for the process to end; return all of its output."""
        self.proc.wait(timeout=timeout)
        while (line := self._queue.get(timeout=timeout)) is not None:
            self.lines.append(line)
        self._queue.put(None)
        return ''.join(self.lines)


def start(args, env=None):
    proc = subprocess.Popen([str(a) for a in args], cwd=ROOT, env=env or script_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors='backslashreplace')
    return proc, LineReader(proc)


@contextlib.contextmanager
def serving(args):
    """(proc, reader) of a serve.py started with args, once it says it is serving; stopped after, even if it never
    said so (a server left running would outlive the suite)."""
    proc, reader = start(args)
    try:
        reader.wait_for(lambda line: line.startswith('Serving'), timeout=60)
        yield proc, reader
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def read_scalars(log_dir):
    """TensorBoard's own reading of the event files: {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()['scalars']}


def torchrun_report(output):
    """torchrun's failure report in a launcher's output: {'root': (rank, message), 'others': [(rank, message)]},
    or None if it printed none. The message is what the worker left in its error file."""
    if 'Root Cause (first observed failure):' not in output:
        return None
    failures, root = output.split('Root Cause (first observed failure):')
    entry = re.compile(r'^  rank      : (\d+) \(local_rank: \d+\)$.*?^  traceback : (.*?)$', re.M | re.S)
    others = [(int(rank), message) for rank, message in entry.findall(failures.split('Failures:')[-1])]
    (rank, message), = entry.findall(root)
    return {'root': (int(rank), message), 'others': others}


def read_review(log_dir):
    """What review.best_model wrote, as TensorBoard's reader sees it: {'images': {tag: [steps]}, 'pr_curves':
    [tags], 'graph': bool, 'hparams': bool, 'matrix': the 10x10 confusion matrix (rows true) of the last step,
    'mistakes': the count the text states}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(str(log_dir), size_guidance={'images': 0, 'tensors': 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    text = accumulator.Tensors('Best model/confusion matrix/text_summary')[-1].tensor_proto.string_val[0].decode()
    rows = re.findall(r'^\| \*\*\d\*\* \| (.*) \|$', text, re.M)
    try:
        plugins = accumulator.PluginTagToContent('hparams')
    except KeyError:  # no hparams written
        plugins = {}
    return {'images': {tag: [event.step for event in accumulator.Images(tag)] for tag in tags['images']},
            'pr_curves': [tag for tag in tags['tensors'] if tag.startswith('Best model/digit ')],
            'graph': tags['graph'], 'hparams': bool(plugins),
            'matrix': [[int(n) for n in row.split(' | ')] for row in rows],
            'mistakes': int(re.search(r'(\d+) mistakes', text).group(1)), 'text': text}


def event_writers(log_dir):
    """The processes (host.pid) that wrote a TensorBoard run's event files."""
    return {'.'.join(path.name.split('.')[4:-1]) for path in Path(log_dir).glob('events.out.tfevents.*')}


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: the workers of -n auto
def pytest_xdist_auto_num_workers(config):
    """One worker more than the CPUs this process may use: much of the suite's time is processes waiting (on a
    timeout, a peer, a server), which the extra worker fills (2 CPUs: the newest-torch leg in 0.89-0.97 of the
    time with 2 workers, docs/benchmarks.md#test-suite)."""
    import common
    return common.usable_cpus() + 1


def pytest_configure(config):
    config.addinivalue_line('markers', 'one_leg: a test that starts processes whose behaviour does not depend on '
                                       'the torch version: run in the PAI leg only (torch 2.3, the image DLC trains '
                                       'and EAS serves on), or with one_leg("newest") in the newest torch\'s, so '
                                       'each leg stays within minutes')
    config.addinivalue_line('markers', 'slow: a test of tens of seconds (a torchrun job waiting out its timeouts or '
                                       'restarting, a load test): started first')
    # The programs the tests start write their temporary files in a folder of the session's, removed at its end:
    # torchrun leaves a torchelastic_* folder each run, and a stopped Chromium its profile's. pytest's tmp_path
    # stays where it was, in the folder pytest keeps for its last 3 runs.
    global SESSION_TEMP
    SESSION_TEMP = tempfile.mkdtemp(prefix='mnist-tests-')
    os.environ['TMPDIR'] = SESSION_TEMP


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_TEMP, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    # pytest-xdist's --dist loadgroup: the tests of a module-scoped fixture (a server, a browser) as one group, so
    # it starts once, the groups dealt first (largest first); then the slow tests, in this order, while the short
    # ones fill in around them (no worker ends the run with a slow one alone); a few at a time to each worker.
    items.sort(key=lambda item: 'slow' not in item.keywords)
    for item in items:
        if any(defs[-1].scope == 'module' for defs in item._fixtureinfo.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    import torch
    leg, other = ('pai', 'test') if torch.__version__ < '2.4' else ('newest', 'test-pai')
    if os.environ.get('ALL_TESTS'):
        return
    skip = pytest.mark.skip(reason=f'torch-independent: run by ./run_local.sh {other} (or ALL_TESTS=1)')
    for item in items:
        marker = item.get_closest_marker('one_leg')
        if marker and (marker.args or ('pai',))[0] != leg:
            item.add_marker(skip)
