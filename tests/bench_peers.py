"""serve.py beside its peers, as clients see them: one client's median latency, requests per second of 4 and of
16 clients on kept-alive connections, of 16 that open a new connection per request, and of 4 kept-alive clients
whose connections one worker process accepted (the other workers stopped meanwhile: not for LitServe, whose
processes are no peers), and idle memory.

    PYTHONPATH=DIR python tests/bench_peers.py [--model M] [--data-dir DIR] [--seconds 8] [--rounds 3]
        [--form multipart|json] [--baseline REV] [--only NAME ...]
    (DIR: where `pip install --target DIR litserve fastapi httptools python-multipart` put the peers, kept
    out of the project's environment)

All serve the same model with framing.py and get the same bodies (a form upload of a 28x28 MNIST-style PNG,
or JSON {"image": "<base64>"}): serve.py with its defaults; LitServe with batching (max_batch_size 16,
batch_timeout 5 ms), one worker per CPU core, fast_queue, torch at one thread; a plain FastAPI app on
`uvicorn --workers 2 --http httptools` (FastAPI: a sync endpoint taking an UploadFile, or a dict for JSON;
FastAPI raw: an async one reading the body as sent, with framing.py's own parsing, on the event loop); with
--baseline, the serve.py of that git revision. The servers alternate, each round; each phase runs --seconds.
Not part of the test suite.
"""
import argparse
import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

from bench_serve import (ROOT, baseline_serve, in_threads, model_or_fresh, pngs, scratch_folder,  # beside this file
                         tree_pss)

LITSERVE_APP = '''
import base64, os, sys
import torch
import litserve as ls
sys.path.insert(0, {root!r})
import framing

class MNIST(ls.LitAPI):
    def setup(self, device):
        torch.set_num_threads(1)
        self.model = framing.load_model({model!r})

    def decode_request(self, request):
        data = request['file'].file.read() if 'file' in request else base64.b64decode(request['image'])
        return framing.to_tensor(data)[0]

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


FASTAPI_APP = '''
import base64, sys, threading
import torch
from fastapi import FastAPI, File, Request, UploadFile
sys.path.insert(0, {root!r})
import framing

torch.set_num_threads(1)
model = framing.load_model({model!r})
app = FastAPI()


def reply(data):
    digits, probabilities = framing.predict(model, framing.to_tensor(data))
    return {{'digit': digits[0], 'probabilities': [round(p, 6) for p in probabilities[0]]}}


@app.post('/predict')
def predict(file: UploadFile = File(...)):
    return reply(file.file.read())


@app.post('/predict-json')
def predict_json(body: dict):
    return reply(base64.b64decode(body['image']))


@app.post('/predict-raw')
async def predict_raw(request: Request):  # written for speed: the body as sent, read on the event loop
    body = await request.body()
    images, several = framing.images_in(body, request.headers.get('content-type', ''))
    return framing.answer(model, images, several, threading.Event())


@app.get('/health')
def health():
    return {{'status': 'ok'}}
'''


def start(command, port):
    # In a folder of its own: nothing a server writes where it runs lands in the project
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir(),
                            start_new_session=True)  # its process group: stop() ends its workers too
    for _ in range(1800):  # ready when it answers
        try:
            import http.client
            connection = http.client.HTTPConnection('127.0.0.1', port, timeout=5)
            connection.request('GET', '/health')
            if connection.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.1)
    stop(proc)
    raise SystemExit(f'{command} did not start')


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of it is left


def phases(port, bodies, seconds, path, workers=()):
    """The figures clients see, each phase for `seconds`: one client's median latency (kept alive), requests per
    second of 4 and of 16 clients kept alive, and of 16 clients opening a new connection for each request; with
    the workers' pids, also of 4 kept-alive clients whose connections one worker accepted (the others stopped)."""
    import http.client

    def ask(connection, body):
        connection.request('POST', path, body=body[0], headers=body[1])
        response = connection.getresponse()
        assert response.status == 200, (response.status, response.read())
        json.loads(response.read())

    def run(clients, kept_alive, connections=None):
        counts, latencies, end = [0] * clients, [], time.perf_counter() + seconds

        def client(k):
            connection = connections[k] if connections else http.client.HTTPConnection('127.0.0.1', port, timeout=30)
            while time.perf_counter() < end:
                if not kept_alive:
                    connection = http.client.HTTPConnection('127.0.0.1', port, timeout=30)
                started = time.perf_counter()
                ask(connection, bodies[(k + counts[k]) % len(bodies)])
                latencies.append(time.perf_counter() - started)
                counts[k] += 1
                if not kept_alive:
                    connection.close()
        elapsed = in_threads(clients, client)
        return sum(counts) / elapsed, sorted(latencies)[len(latencies) // 2]
    for body in bodies[:50]:  # warm-up
        ask(http.client.HTTPConnection('127.0.0.1', port, timeout=30), body)
    figures = {'p50': run(1, True)[1], '4 kept': run(4, True)[0], '16 kept': run(16, True)[0],
               '16 new': run(16, False)[0]}
    if len(workers) > 1:
        for pid in workers[1:]:
            os.kill(pid, signal.SIGSTOP)
        try:
            connections = [http.client.HTTPConnection('127.0.0.1', port, timeout=30) for _ in range(4)]
            for connection in connections:
                ask(connection, bodies[0])  # accepted by the one worker running
        finally:
            for pid in workers[1:]:
                os.kill(pid, signal.SIGCONT)
        figures['4 on one'] = run(4, True, connections)[0]
    return figures


def children(pid):
    """A server's worker processes: the children of its first process (Gunicorn's master, uvicorn's supervisor),
    but multiprocessing's resource tracker."""
    pids = [int(child) for child in open(f'/proc/{pid}/task/{pid}/children').read().split()]
    return [child for child in pids if b'resource_tracker' not in open(f'/proc/{child}/cmdline', 'rb').read()]


def multipart(png):
    boundary = 'bench-boundary-7MA4YWxkTrZu0gW'
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="digit.png"\r\nContent-Type: '
            f'image/png\r\n\r\n').encode() + png + f'\r\n--{boundary}--\r\n'.encode()
    return body, {'Content-Type': f'multipart/form-data; boundary={boundary}'}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', help='best_model.pth to serve (default: a freshly initialised model)')
    parser.add_argument('--data-dir', help='torchvision root holding MNIST/raw (default: made-up images)')
    parser.add_argument('--seconds', type=float, default=8, help='seconds each phase runs (default: 8)')
    parser.add_argument('--rounds', type=int, default=3, help='rounds, alternating servers (default: 3)')
    parser.add_argument('--form', choices=('multipart', 'json'), default='multipart',
                        help='request bodies: a form upload, or JSON with base64 (default: multipart)')
    parser.add_argument('--baseline', metavar='REV', help='also measure the serve.py of this git revision')
    parser.add_argument('--only', nargs='+', help='measure only these servers (default: all)')
    args = parser.parse_args()
    model = os.path.abspath(model_or_fresh(args.model))  # the servers run in a folder of their own
    images = pngs(args.data_dir, 100)
    bodies = ([multipart(png) for png in images] if args.form == 'multipart' else
              [(json.dumps({'image': base64.b64encode(png).decode()}).encode(), {'Content-Type': 'application/json'})
               for png in images])
    folder = scratch_folder()
    for name, source in (('litserve_app.py', LITSERVE_APP), ('fastapi_app.py', FASTAPI_APP)):
        with open(os.path.join(folder, name), 'w') as f:
            f.write(source.format(root=ROOT, model=model, port=8765))
    servers = {'serve.py': ([sys.executable, os.path.join(ROOT, 'serve.py'), '--model', model, '--port', '8764'],
                            8764, '/predict'),
               'LitServe': ([sys.executable, os.path.join(folder, 'litserve_app.py')], 8765, '/predict'),
               'FastAPI': ([sys.executable, '-m', 'uvicorn', 'fastapi_app:app', '--app-dir', folder, '--workers', '2',
                            '--http', 'httptools', '--no-access-log', '--log-level', 'warning', '--port', '8766'],
                           8766, '/predict' if args.form == 'multipart' else '/predict-json')}
    servers['FastAPI raw'] = (servers['FastAPI'][0], 8766, '/predict-raw')
    if args.baseline:
        servers[f'serve.py at {args.baseline}'] = ([sys.executable, baseline_serve(args.baseline), '--model', model,
                                                     '--port', '8767'], 8767, '/predict')
    servers = {name: server for name, server in servers.items() if not args.only or name in args.only}
    print(f'{os.cpu_count()} CPU cores, torch {torch.__version__}, {args.form} bodies, {args.seconds:g} s a phase',
          flush=True)
    for round in range(args.rounds):
        for name, (command, port, path) in servers.items():
            proc = start(command, port)
            try:
                time.sleep(2)  # every worker process started
                idle = tree_pss(proc.pid)
                workers = sorted(children(proc.pid)) if name != 'LitServe' else []  # its processes are no peers
                f = phases(port, bodies, args.seconds, path, workers)
            finally:
                stop(proc)
            print(f'round {round + 1}, {name:20s} one client p50 {f["p50"] * 1000:5.2f} ms; requests/s: 4 kept alive '
                  f'{f["4 kept"]:5.0f}, 16 kept alive {f["16 kept"]:5.0f}, 16 new connections {f["16 new"]:5.0f}, '
                  f'4 kept alive on one worker {f.get("4 on one", float("nan")):5.0f}; idle {idle / 2**20:4.0f} MiB',
                  flush=True)


if __name__ == '__main__':
    main()
