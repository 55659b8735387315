"""serve.py beside LitServe in its recommended CPU set-up, as clients see them: requests per second with 16
clients that each open a new connection per request, and with 4 on kept-alive connections.

    PYTHONPATH=DIR python tests/bench_peers.py [--model best_model.pth] [--requests 4000] [--rounds 2]
    (DIR: where `pip install --target DIR litserve` put LitServe, kept out of the project's environment)

Both serve the same model and read the same JSON bodies ({"image": "<base64 PNG>"}: a 28x28 MNIST-style
image) with framing.py: LitServe with batching (max_batch_size 16, batch_timeout 5 ms), one worker per
CPU core (workers_per_device), fast_queue, torch at one thread; serve.py with its defaults. The servers
alternate, each round. Not part of the test suite.
"""
import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from bench_serve import ROOT, in_threads, model_or_fresh, pngs  # beside this file

LITSERVE_APP = '''
import base64, os, sys
import torch
import litserve as ls
sys.path.insert(0, {root!r})
import framing, serve

class MNIST(ls.LitAPI):
    def setup(self, device):
        torch.set_num_threads(1)
        self.model = serve.load_model({model!r})

    def decode_request(self, request):
        return framing.to_tensor(base64.b64decode(request['image']))[0]

    def batch(self, inputs):
        return torch.stack(inputs)

    def predict(self, x):
        with torch.inference_mode():
            return torch.softmax(self.model(x), dim=1)

    def unbatch(self, output):
        return list(output)

    def encode_response(self, p):
        return {{'digit': int(p.argmax()), 'probabilities': [round(v, 6) for v in p.tolist()]}}

if __name__ == '__main__':
    api = MNIST(max_batch_size=16, batch_timeout=0.005)
    ls.LitServer(api, accelerator='cpu', workers_per_device=os.cpu_count(), fast_queue=True).run(
        port={port}, generate_client_file=False)
'''


def start(command, port):
    # In a folder of its own: nothing a server writes where it runs lands in the project
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    for _ in range(600):  # ready when it answers
        try:
            import http.client
            connection = http.client.HTTPConnection('127.0.0.1', port, timeout=5)
            connection.request('GET', '/health')
            if connection.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f'{command} did not start')


def rates(port, bodies, requests):
    import http.client

    def ask(connection, body):
        connection.request('POST', '/predict', body=body, headers={'Content-Type': 'application/json'})
        response = connection.getresponse()
        assert response.status == 200, (response.status, response.read())
        json.loads(response.read())

    def new_connections(k):
        for i in range(requests // 16):
            connection = http.client.HTTPConnection('127.0.0.1', port, timeout=30)
            ask(connection, bodies[(k + i) % len(bodies)])
            connection.close()

    def kept_alive(k):
        connection = http.client.HTTPConnection('127.0.0.1', port, timeout=30)
        for i in range(requests // 4):
            ask(connection, bodies[(k + i) % len(bodies)])
    for body in bodies[:50]:  # warm-up
        ask(http.client.HTTPConnection('127.0.0.1', port, timeout=30), body)
    return requests // 16 * 16 / in_threads(16, new_connections), requests // 4 * 4 / in_threads(4, kept_alive)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', help='best_model.pth to serve (default: a freshly initialised model)')
    parser.add_argument('--data-dir', help='torchvision root holding MNIST/raw (default: made-up images)')
    parser.add_argument('--requests', type=int, default=4000, help='requests in each part (default: 4000)')
    parser.add_argument('--rounds', type=int, default=2, help='rounds, alternating servers (default: 2)')
    args = parser.parse_args()
    model = os.path.abspath(model_or_fresh(args.model))  # the servers run in a folder of their own
    bodies = [json.dumps({'image': base64.b64encode(png).decode()}).encode() for png in pngs(args.data_dir, 100)]
    app = os.path.join(tempfile.mkdtemp(), 'litserve_app.py')
    with open(app, 'w') as f:
        f.write(LITSERVE_APP.format(root=ROOT, model=model, port=8765))
    servers = {'serve.py': ([sys.executable, os.path.join(ROOT, 'serve.py'), '--model', model, '--port', '8764'], 8764),
               'LitServe': ([sys.executable, app], 8765)}
    print(f'{os.cpu_count()} CPU cores, torch {torch.__version__}, {args.requests} requests a part', flush=True)
    for round in range(args.rounds):
        for name, (command, port) in servers.items():
            proc = start(command, port)
            try:
                new, kept = rates(port, bodies, args.requests)
            finally:
                proc.terminate()
                proc.wait()
            print(f'round {round + 1}, {name:9s} 16 clients, new connections: {new:5.0f} requests/s; '
                  f'4 clients, kept alive: {kept:5.0f} requests/s', flush=True)


if __name__ == '__main__':
    main()
