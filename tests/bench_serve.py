"""Speed and memory of serve.py, measured as clients see it: real images, over HTTP on this machine.

    python tests/bench_serve.py [--model best_model.pth] [--data-dir DIR] [--baseline REV]
    (or: ./run_local.sh bench-serve, which compares with the http.server version of serve.py)

Starts serve.py on a free port (its default settings: one worker process per usable CPU), then:
its idle memory (the PSS of all its processes: shared pages counted once); MNIST test images (the
real ones from --data-dir, else made-up digits) sent as 28x28 PNGs by one client, one request after
another on a kept-alive connection (latency p50 and p99); by --clients clients at once (requests per
second); by 16 clients that open a new connection for every request (requests per second, and how
many took 1 s or more); the slow kinds of pictures, one at a time (time and server CPU per image: a
thin pen on 1024x1024 and 2000x2000 canvases, a 12-megapixel phone photo, 1024x1024 noise); and 8
clients at once sending the largest images the limits accept (peak memory; the CPU one such image
cost). With --baseline REV, the serve.py of that git revision is measured too, each part alternating
between the two. Any model serves at the same speed: without --model, a freshly initialised one.
Not part of the test suite.
"""
import argparse
import atexit
import http.client
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch
from PIL import Image, ImageDraw

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402


def check_mnist(data_dir):
    """MNIST's four files in data_dir/MNIST/raw as the training scripts get them (extracted from the .gz files there,
    or downloaded), or exit with their one-paragraph error."""
    try:
        common.prepare_mnist(data_dir)
    except common.SetupError as e:
        sys.exit(f'error: {e}')


def pngs(data_dir, count):
    if data_dir:
        from torchvision import datasets
        check_mnist(data_dir)
        images = datasets.MNIST(root=data_dir, train=False).data[:count].numpy()
    else:
        images = np.random.default_rng(0).integers(0, 256, (count, 28, 28), dtype=np.uint8)
    out = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image, mode='L').save(buffer, format='PNG')
        out.append(buffer.getvalue())
    return out


def largest_images():
    """The largest images serve.py's limits accept: a 4096x4096 RGBA PNG and a 16384x16384 JPEG, a digit each."""
    out = []
    for size, mode, fmt in ((4096, 'RGBA', 'PNG'), (16384, 'RGB', 'JPEG')):
        image = Image.new(mode, (size, size), 'white')
        ImageDraw.Draw(image).ellipse((size // 3, size // 4, size * 2 // 3, size * 3 // 4), outline='black',
                                      width=size // 25)
        buffer = io.BytesIO()
        image.save(buffer, format=fmt)
        out.append(buffer.getvalue())
    return out


def slow_kinds():
    """{kind: image bytes}: the pictures whose reading cost grew with their size before framing.py."""
    def seven(side, width):
        image = Image.new('L', (side, side), 255)
        ImageDraw.Draw(image).line((side * 0.3, side * 0.2, side * 0.7, side * 0.2, side * 0.45, side * 0.85), 0, width,
                                   joint='curve')
        return image
    rng = np.random.default_rng(0)
    photo = Image.new('L', (4000, 3000), 200)
    ImageDraw.Draw(photo).line((1700, 1000, 2300, 1000, 1950, 2000), 40, 25, joint='curve')
    photo = Image.fromarray(np.clip(np.asarray(photo, np.float32) + rng.normal(0, 6, (3000, 4000)), 0, 255)
                            .astype(np.uint8)).convert('RGB')
    noise = Image.fromarray(rng.integers(0, 256, (1024, 1024), dtype=np.uint8))
    kinds = {'thin pen, 1024x1024 PNG': (seven(1024, 3), 'PNG'), 'thin pen, 2000x2000 PNG': (seven(2000, 3), 'PNG'),
             'phone photo, 4000x3000 JPEG': (photo, 'JPEG'), 'noise, 1024x1024 PNG': (noise, 'PNG')}
    out = {}
    for name, (image, fmt) in kinds.items():
        buffer = io.BytesIO()
        image.save(buffer, fmt, **({'quality': 85} if fmt == 'JPEG' else {}))
        out[name] = buffer.getvalue()
    return out


def post(connection, body):
    start = time.perf_counter()
    connection.request('POST', '/predict', body=body, headers={'Content-Type': 'image/png'})
    response = connection.getresponse()
    response.read()
    return time.perf_counter() - start, response.status


def in_threads(count, target):
    threads = [threading.Thread(target=target, args=(k,)) for k in range(count)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def tree_pss(pid):
    """Proportional set size of a process and its children, in bytes (shared pages split between them)."""
    total = 0
    for p in [pid] + [int(c) for c in open(f'/proc/{pid}/task/{pid}/children').read().split()]:  # workers
        try:
            for line in open(f'/proc/{p}/smaps_rollup'):
                if line.startswith('Pss:'):
                    total += int(line.split()[1]) * 1024
        except FileNotFoundError:
            pass
    return total


def cpu_seconds(pid):
    fields = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def tree_cpu_seconds(pid):
    """CPU seconds of a process and its running children (the worker processes)."""
    total = cpu_seconds(pid)
    for child in open(f'/proc/{pid}/task/{pid}/children').read().split():
        try:
            total += cpu_seconds(int(child))
        except FileNotFoundError:
            pass
    return total


def scratch_folder():
    """A new temporary folder, removed when the benchmark ends."""
    folder = tempfile.mkdtemp(prefix='mnist-bench-')
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def baseline_serve(rev):
    """The path of serve.py as it was at git revision rev, with that revision's common.py beside it."""
    folder = scratch_folder()
    for name in ('serve.py', 'asgi.py', 'common.py', 'framing.py'):
        source = subprocess.run(['git', 'show', f'{rev}:{name}'], cwd=ROOT, capture_output=True)
        if source.returncode == 0:  # asgi.py, framing.py only where the revision has them
            with open(os.path.join(folder, name), 'wb') as f:
                f.write(source.stdout)
    return os.path.join(folder, 'serve.py')


class Server:
    """serve.py (or another revision's) started on a free port, ready."""

    def __init__(self, script, model_path, stderr=None, workers=None):
        with socket.socket() as s:
            s.bind(('127.0.0.1', 0))
            self.port = s.getsockname()[1]
        flags = ['--workers', str(workers)] if workers else []  # else serve.py's default: the usable CPUs
        log = stderr or tempfile.TemporaryFile()  # its log; read here only if it does not start
        path = os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')]))  # where its packages are too
        self.proc = subprocess.Popen([sys.executable, script, '--model', model_path, '--port', str(self.port), *flags],
                                     stdout=subprocess.PIPE, stderr=log, text=True,
                                     env=dict(os.environ, PYTHONPATH=path))
        line = self.proc.stdout.readline()
        if not line.startswith('Serving'):
            self.proc.kill()  # ended already, or saying something else
            self.proc.wait()
            log.seek(0)
            said = (line + log.read().decode(errors='replace')).strip()
            sys.exit(f'{script} did not start: {said or "it said nothing"}')
        self.serving = line.strip()  # its Serving line: the worker processes it runs

    def close(self):
        self.proc.terminate()
        self.proc.wait()


def measure(server, bodies, big, kinds, args):
    """The figures of one round against one server."""
    port, figures = server.port, {}
    time.sleep(3)  # every worker process started
    figures['idle'] = tree_pss(server.proc.pid)
    connection = http.client.HTTPConnection('127.0.0.1', port)
    for body in bodies:  # warm-up
        post(connection, body)
    latencies = sorted(post(connection, bodies[i % len(bodies)])[0] for i in range(args.requests))
    figures['p50'], figures['p99'] = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]

    per_client = args.requests // args.clients

    def kept_alive(k):
        own = http.client.HTTPConnection('127.0.0.1', port)
        for i in range(per_client):
            assert post(own, bodies[i % len(bodies)])[1] == 200
    figures['rate'] = per_client * args.clients / in_threads(args.clients, kept_alive)

    slow = []

    def new_connections(k):
        for i in range(args.requests // 16):
            own = http.client.HTTPConnection('127.0.0.1', port, timeout=30)
            elapsed, status = post(own, bodies[i % len(bodies)])
            own.close()
            slow.append(elapsed >= 1 or status != 200)
    figures['new_rate'] = args.requests // 16 * 16 / in_threads(16, new_connections)
    figures['slow'] = sum(slow)

    figures['kinds'] = {}
    for name, body in kinds.items():  # one at a time: wall time and the server's CPU per image
        start, cpu = time.perf_counter(), tree_cpu_seconds(server.proc.pid)
        status = post(http.client.HTTPConnection('127.0.0.1', port, timeout=300), body)[1]
        figures['kinds'][name] = (time.perf_counter() - start, tree_cpu_seconds(server.proc.pid) - cpu, status)
    before, peak, statuses = tree_cpu_seconds(server.proc.pid), [tree_pss(server.proc.pid)], []
    for body in big:  # one at a time first: the CPU one image costs
        start = tree_cpu_seconds(server.proc.pid)
        statuses.append(post(http.client.HTTPConnection('127.0.0.1', port, timeout=120), body)[1])
        figures[f'cpu{len(statuses)}'] = tree_cpu_seconds(server.proc.pid) - start
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak.append(tree_pss(server.proc.pid))
            time.sleep(0.02)
    sampler = threading.Thread(target=sample)
    sampler.start()

    def largest(k):
        statuses.append(post(http.client.HTTPConnection('127.0.0.1', port, timeout=120), big[k % len(big)])[1])
    in_threads(8, largest)
    done.set()
    sampler.join()
    figures['pss'], figures['big_statuses'] = max(peak), sorted(set(statuses))
    figures['big_cpu'] = tree_cpu_seconds(server.proc.pid) - before
    return figures


def model_or_fresh(path):
    """path, or a freshly initialised model's weights saved in a temporary folder: any model serves as fast."""
    if path:
        return path
    torch.manual_seed(0)
    path = os.path.join(scratch_folder(), 'best_model.pth')
    torch.save(common.SimpleCNN().state_dict(), path)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', help='best_model.pth to serve (default: a freshly initialised model)')
    parser.add_argument('--data-dir', help='torchvision root holding MNIST/raw (default: made-up images)')
    parser.add_argument('--requests', type=int, default=2000, help='requests in each part (default: 2000)')
    parser.add_argument('--clients', type=int, default=4, help='concurrent clients in the second part (default: 4)')
    parser.add_argument('--baseline', metavar='REV', help='also measure the serve.py of this git revision')
    parser.add_argument('--rounds', type=int, default=2, help='rounds, alternating servers (default: 2)')
    parser.add_argument('--workers', type=int, help="serve.py's --workers, and the baseline's where it has the flag "
                                                    "(default: their own)")
    args = parser.parse_args()
    model_path = model_or_fresh(args.model)
    scripts = {'serve.py': os.path.join(ROOT, 'serve.py')}
    if args.baseline:
        scripts[f'serve.py at {args.baseline}'] = baseline_serve(args.baseline)
    bodies, big, kinds = pngs(args.data_dir, 100), largest_images(), slow_kinds()
    chosen = f'--workers {args.workers}' if args.workers else 'its default --workers'
    print(f'{os.cpu_count()} CPU cores, serve.py {chosen}, torch {torch.__version__}, {len(bodies[0])}-byte 28x28 '
          f'PNGs; largest images: {len(big[0]) // 1000} KB 4096x4096 RGBA PNG, {len(big[1]) // 1000} KB 16384x16384 '
          f'JPEG', flush=True)
    takes_workers = {}  # a baseline without the flag (390c706: one process) runs as it was
    for name, script in scripts.items():
        with open(script) as source:
            takes_workers[name] = "'--workers'" in source.read()
    for round in range(args.rounds):
        for name, script in scripts.items():
            server = Server(script, model_path, workers=args.workers if takes_workers[name] else None)
            try:
                f = measure(server, bodies, big, kinds, args)
            finally:
                server.close()
            print(f'round {round + 1}, {name}:\n'
                  f'  {server.serving}\n'
                  f'  idle:        {f["idle"] / 2**20:.0f} MiB (PSS)\n'
                  f'  one client:  {args.requests} requests, latency p50 {f["p50"] * 1000:.2f} ms, p99 '
                  f'{f["p99"] * 1000:.2f} ms\n'
                  f'  {args.clients} clients:   {args.requests // args.clients * args.clients} requests, '
                  f'{f["rate"]:.0f} requests/s\n'
                  f'  16 clients, a new connection each request: {args.requests // 16 * 16} requests, '
                  f'{f["new_rate"]:.0f} requests/s, {f["slow"]} took 1 s or more (or failed)\n' +
                  ''.join(f'  {kind}: {wall:.3f} s, CPU {cpu:.2f} s, HTTP {status}\n'
                          for kind, (wall, cpu, status) in f['kinds'].items()) +
                  f'  8 clients sending the largest images: peak memory {f["pss"] / 2**20:.0f} MiB (PSS), CPU '
                  f'{f["cpu1"]:.2f} s (PNG) and {f["cpu2"]:.2f} s (JPEG) alone, HTTP {f["big_statuses"]}', flush=True)


if __name__ == '__main__':
    main()
