"""Speed of serve.py, measured as clients see it: a real PNG per request, over HTTP on this machine.

    python tests/bench_serve.py [--model best_model.pth] [--data-dir DIR]      (or: ./run_local.sh bench-serve)

Starts serve.py on a free port, then sends MNIST test images (the real ones from --data-dir, else
made-up digits) as 28x28 PNGs: first one client, one request after another on a kept-alive
connection (latency p50 and p99), then --clients clients at once (requests per second). Any model
serves at the same speed: without --model, a freshly initialised one. Not part of the test suite.
"""
import argparse
import http.client
import io
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402


def pngs(data_dir, count):
    if data_dir:
        from torchvision import datasets
        images = datasets.MNIST(root=data_dir, train=False).data[:count].numpy()
    else:
        images = np.random.default_rng(0).integers(0, 256, (count, 28, 28), dtype=np.uint8)
    out = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image, mode='L').save(buffer, format='PNG')
        out.append(buffer.getvalue())
    return out


def post(connection, body):
    start = time.perf_counter()
    connection.request('POST', '/predict', body=body, headers={'Content-Type': 'image/png'})
    response = connection.getresponse()
    response.read()
    assert response.status == 200, response.status
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', help='best_model.pth to serve (default: a freshly initialised model)')
    parser.add_argument('--data-dir', help='torchvision root holding MNIST/raw (default: made-up images)')
    parser.add_argument('--requests', type=int, default=2000, help='requests in each part (default: 2000)')
    parser.add_argument('--clients', type=int, default=4, help='concurrent clients in the second part (default: 4)')
    args = parser.parse_args()
    model_path = args.model
    if not model_path:
        torch.manual_seed(0)
        model_path = os.path.join(tempfile.mkdtemp(), 'best_model.pth')
        torch.save(common.SimpleCNN().state_dict(), model_path)
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, os.path.join(ROOT, 'serve.py'), '--model', model_path,
                               '--port', str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout.readline().startswith('Serving'), 'serve.py did not start'
        bodies = pngs(args.data_dir, 100)
        connection = http.client.HTTPConnection('127.0.0.1', port)
        for body in bodies:  # warm-up
            post(connection, body)
        latencies = sorted(post(connection, bodies[i % len(bodies)]) for i in range(args.requests))
        p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]

        per_client = args.requests // args.clients

        def client():
            own = http.client.HTTPConnection('127.0.0.1', port)
            for i in range(per_client):
                post(own, bodies[i % len(bodies)])
        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        rate = per_client * args.clients / (time.perf_counter() - start)
    finally:
        server.terminate()
        server.wait()
    print(f'serve.py on {os.cpu_count()} CPU cores, torch {torch.__version__}, {len(bodies[0])}-byte 28x28 PNGs')
    print(f'one client:  {args.requests} requests, latency p50 {p50 * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms, '
          f'mean {statistics.mean(latencies) * 1000:.2f} ms')
    print(f'{args.clients} clients:   {per_client * args.clients} requests, {rate:.0f} requests/s')


if __name__ == '__main__':
    main()
