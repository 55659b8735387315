"""Serve a trained best_model.pth over HTTP: the document's last step, "deploy the trained model" (PAI-EAS).

Run command of an EAS service deployed from the training image, with the dataset mounted at /mnt/data:
  pip install -r /mnt/data/requirements-serve.txt && \
      python /mnt/data/serve.py --host 0.0.0.0 --model /mnt/data/output/best_model.pth
On your own machine (after ./run_local.sh; or ./run_local.sh serve):
  python serve.py --model ./output/single/best_model.pth
  python serve.py --model ./output/single/best_model.pth --predict digit.png ...   (no server)

POST /predict answers {"digit": d, "probabilities": [p0, ..., p9]} for an image of any size (framing.py
reads it as MNIST framed its digits), sent as the body (curl --data-binary @digit.png URL/predict), as a
form upload (curl -F file=@digit.png ...) or as JSON {"image": "<base64 or data: URL>"}; several
images in a form or as {"images": [...]} answer {"predictions": [...]}. POST / is the same (EAS's SDK
posts to the service's root). GET /health, and GET / a page.
Errors are JSON: {"error": "..."} with the HTTP status. uvicorn serves, on --workers processes; it has
no authentication: on EAS, the gateway checks the token. Limits and replies: docs/serving.md.
"""
import argparse
import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import email.parser
import email.policy
import errno
import io
import json
import math
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import traceback

try:
    import torch
    import uvicorn

    import common
    import framing
except ModuleNotFoundError as e:
    if e.name in ('common', 'framing'):  # the script uploaded alone
        sys.exit(f'error: {e.name}.py is missing: upload it beside {os.path.abspath(__file__)} (on DLC, to the same '
                 f'folder of the dataset as the script).')
    requirements = os.path.join(os.path.dirname(__file__), 'requirements-serve.txt')
    sys.exit(f'error: serve.py needs {e.name}: pip install -r {requirements} (./run_local.sh serve installs it).')

MAX_BODY_BYTES = 10 * 1024 * 1024
MAX_IMAGES = 16  # in one request
MAX_HEAD_BYTES = 16384  # the request line and headers; more get uvicorn's 400
MAX_WAITING = 256  # requests of a worker process waiting for its prediction threads; more get 503
BODY_BUDGET = 8 * MAX_BODY_BYTES  # bytes of request bodies a worker process holds at once; more wait their turn
FORMS = ('send the image file as the body (curl --data-binary @digit.png), as a form upload (curl -F '
         'file=@digit.png), or as JSON {"image": "<base64 or data: URL>"}')
ROUTES = {'/': ('GET', 'HEAD', 'POST'), '/predict': ('POST',), '/health': ('GET', 'HEAD')}  # POST /: EAS's SDK
CGROUP = '/sys/fs/cgroup'  # a Linux container's own CPU limits, where it has them
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'page', 'index.html')  # GET /: try the model


def usable_cpus():
    """Worker processes by default: the CPUs this process may use, its affinity (where the platform has one) and a
    container's CPU quota."""
    if sys.platform == 'win32':  # no fork, and no SIGTERM to stop a worker gracefully: one process
        return 1
    count = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(count, math.ceil(quota)) if quota else count)


def cgroup_cpu_quota():
    """CPUs' worth of time a Linux container may use (Docker --cpus, Kubernetes limits), or None: cgroup v2, then v1."""
    try:
        with open(os.path.join(CGROUP, 'cpu.max')) as f:
            quota, period = f.read().split()[:2]
        return None if quota == 'max' else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(CGROUP, 'cpu', 'cpu.cfs_quota_us')) as q, \
                open(os.path.join(CGROUP, 'cpu', 'cpu.cfs_period_us')) as p:
            quota, period = int(q.read()), int(p.read())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default='/mnt/data/output/best_model.pth',
                        help='best_model.pth of either training script (default: %(default)s)')
    parser.add_argument('--host', default='127.0.0.1',
                        help='address to listen on; 0.0.0.0 on EAS, :: for IPv6 (default: %(default)s, this machine '
                             'only)')
    parser.add_argument('--port', type=int, default=8000, help='port to listen on; 0 picks a free one (default: '
                                                               '%(default)s)')
    parser.add_argument('--workers', type=common.positive(int), default=usable_cpus(),
                        help='server processes, each with the model (default: the CPUs this process may use, '
                             '%(default)s)')
    parser.add_argument('--threads', type=common.positive(int), default=1,
                        help='threads of each worker that read images and run the model (default: %(default)s)')
    parser.add_argument('--timeout', type=common.positive(float), default=30,
                        help='seconds a client may take to send a request body (default: %(default)s)')
    parser.add_argument('--deadline', type=common.positive(float), default=10,
                        help='seconds to answer a request once its body is in; then 503 or 504 (default: %(default)s)')
    parser.add_argument('--grace', type=common.positive(float), default=30,
                        help='seconds to finish the requests in progress on SIGTERM or Ctrl-C (default: %(default)s)')
    parser.add_argument('--predict', nargs='+', metavar='FILE', help='print the digit of each image and exit')
    parser.add_argument('--debug', action='store_true', help='show tracebacks for start-up errors (default: off)')
    return parser.parse_args()


def load_model(path):
    """The trained SimpleCNN in eval mode, or SetupError: weights only, no arbitrary objects unpickled."""
    advice = 'pass --model with a best_model.pth written by mnist_train.py or mnist_train_distributed.py'
    try:
        state = torch.load(path, map_location='cpu', weights_only=True)
    except FileNotFoundError:
        raise common.SetupError(f'there is no model at {path}: train one first (python mnist_train.py writes '
                                f'<output-dir>/best_model.pth) and pass it with --model.') from None
    except Exception as e:  # not a torch file, a truncated one, one that holds more than weights
        raise common.SetupError(f'cannot load {path}: it is not a file of model weights ({type(e).__name__}); '
                                f'{advice}.') from None
    try:
        if isinstance(state, dict) and 'model' in state:  # checkpoint.pth works too
            state = state['model']
        state = {key.removeprefix('module.'): value for key, value in state.items()}  # a DDP model's own save
        model = common.SimpleCNN()
        model.load_state_dict(state)
    except Exception as e:  # another model's weights
        reason = f'{type(e).__name__}: {e}'.splitlines()[0][:200]
        raise common.SetupError(f'cannot load {path}: it holds the weights of another model ({reason}); '
                                f'{advice}.') from None
    return model.eval()


class Refused(Exception):
    """A request that cannot be served: .status is the HTTP status to answer with, .headers go with it."""

    def __init__(self, status, message, **headers):
        super().__init__(message)
        self.status, self.headers = status, headers


def predict(model, batch):
    """Digits and probabilities for a batch of preprocessed images."""
    with torch.inference_mode():
        probabilities = torch.softmax(model(batch), dim=1)
    return probabilities.argmax(dim=1).tolist(), probabilities.tolist()


def images_in(body, content_type):
    """The image files a request body carries, in any of the accepted forms, and whether several were asked for."""
    if content_type.split(';')[0].strip().lower() == 'multipart/form-data':
        form = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b'Content-Type: ' + content_type.encode('latin-1') + b'\r\n\r\n' + body)
        parts = form.iter_parts() if form.is_multipart() else []
        files = [part.get_payload(decode=True) for part in parts
                 if part.get_filename() is not None or part.get_content_maintype() == 'image']
        files = [data for data in files if data]  # an empty file field is no image
        if not files:
            raise Refused(400, f'the form holds no file; {FORMS}')
        return files, len(files) > 1
    if body.lstrip()[:1] == b'{':  # JSON, whatever its Content-Type (curl -d says form-urlencoded)
        try:
            fields = json.loads(body)
            images = fields['images'] if 'images' in fields else [fields['image']]
            if not isinstance(images, list) or not all(isinstance(image, str) for image in images):
                raise TypeError
            return [base64.b64decode(image.partition('base64,')[2] if image.startswith('data:') else image)
                    for image in images], 'images' in fields
        except (ValueError, KeyError, TypeError, binascii.Error):
            raise Refused(400, f'the JSON body is not {{"image": "<base64>"}} nor {{"images": [...]}}; {FORMS}') \
                from None
    return [body], False


def read_image(data):
    """One image as MNIST framed its digits (a 28x28 'L' image), or Refused with the status its problem gets."""
    try:
        return framing.to_mnist(data)
    except framing.NotAnImage as e:
        raise Refused(400, f'the body is {e}; {FORMS}') from None
    except framing.TooLarge as e:
        raise Refused(413, str(e)) from None
    except framing.NoDigit as e:
        raise Refused(422, str(e)) from None
    except ValueError as e:  # framing.Damaged
        raise Refused(400, str(e)) from None


def answer(model, body, content_type, dropped, framed=False):
    """The JSON reply to a POST /predict body, on a prediction thread; gives up once dropped (an Event) is set.
    framed: each prediction also carries the 28x28 image the model read, as a PNG data: URL."""
    images, several = images_in(body, content_type)
    if len(images) > MAX_IMAGES:
        raise Refused(413, f'the request holds {len(images)} images; at most {MAX_IMAGES} are served at once')
    batch = []
    for k, image in enumerate(images):
        if dropped.is_set():  # past the deadline, or the client has gone: nobody reads the answer
            return None
        try:
            batch.append(read_image(image))
        except Refused as e:
            e.args = (f'image {k + 1} of {len(images)}: {e}',) if several else e.args
            raise
    digits, probabilities = predict(model, torch.cat([framing.mnist_tensor(image) for image in batch]))
    replies = [{'digit': d, 'probabilities': [round(p, 6) for p in ps]} for d, ps in zip(digits, probabilities)]
    for reply, image in zip(replies, batch if framed else []):
        png = io.BytesIO()
        image.save(png, 'PNG')
        reply['framed'] = 'data:image/png;base64,' + base64.b64encode(png.getvalue()).decode()
    return {'predictions': replies} if several else replies[0]


class App:
    """The ASGI application of one worker process: routes and request forms; images are read and the model run
    on a pool of threads, within a budget of body bytes, a queue bound and a deadline."""

    def __init__(self, model, args, in_progress):
        self.model, self.args, self.in_progress = model, args, in_progress  # in_progress: a shared counter
        self.pool = concurrent.futures.ThreadPoolExecutor(args.threads, thread_name_prefix='predict')
        self.waiting, self.budget, self.queued, self.room = 0, BODY_BUDGET, 0, asyncio.Condition()

    async def __call__(self, scope, receive, send):
        if scope['type'] != 'http':
            return
        started = time.perf_counter()
        self.in_progress.value += 1
        try:
            status, body, headers = await self.respond(scope, receive)
        except Refused as e:
            status, body, headers = e.status, {'error': str(e)}, e.headers
        except ConnectionError:  # the client went away: nobody to answer
            status = 499
        except Exception as e:  # a bug of ours: the client gets JSON, the log one line with where it happened
            where = traceback.extract_tb(e.__traceback__)[-1]
            sys.stderr.write(f'error: {type(e).__name__}: {e} at {os.path.basename(where.filename)}:{where.lineno}\n')
            status, body, headers = 500, {'error': f'the server failed on this request ({type(e).__name__})'}, {}
        finally:
            self.in_progress.value -= 1
        if status != 499:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            headers = {'content-type': 'application/json', 'content-length': str(len(data)), **headers}
            await send({'type': 'http.response.start', 'status': status,
                        'headers': [(name.encode(), value.encode()) for name, value in headers.items()]})
            await send({'type': 'http.response.body', 'body': data})
        query = scope['query_string'].decode('latin-1')
        target = scope['path'] + ('?' + query if query else '')
        sys.stderr.write(f'{scope["method"]} {target} {status} {(time.perf_counter() - started) * 1000:.1f} ms\n')

    async def respond(self, scope, receive):
        """(status, JSON body or bytes, headers) for one request."""
        path, method = scope['path'], scope['method']
        if method not in ('GET', 'HEAD', 'POST', 'PUT', 'DELETE', 'PATCH', 'OPTIONS', 'CONNECT', 'TRACE'):
            raise Refused(501, 'the method is not served: POST /predict, GET /health', connection='close')
        if path not in ROUTES:
            raise Refused(404, f'no such path: {path}; POST /predict, GET /health, or GET / for a page')
        allow = ', '.join(ROUTES[path] + ('OPTIONS',))
        if method == 'OPTIONS':
            return 200, {'allow': allow}, {'allow': allow}
        if method not in ROUTES[path]:
            raise Refused(405, f'{path} takes {" or ".join(m for m in ROUTES[path] if m != "HEAD")}', allow=allow)
        if path == '/health':
            return 200, {'status': 'ok', 'model': self.args.model}, {}
        if method != 'POST':  # GET or HEAD /
            try:
                with open(PAGE, 'rb') as f:
                    return 200, f.read(), {'content-type': 'text/html; charset=utf-8'}
            except FileNotFoundError:
                raise Refused(404, 'the page is missing: upload page/index.html beside serve.py; POST /predict and '
                                   'GET /health work without it') from None
        headers = dict(scope['headers'])
        if b'content-length' not in headers and b'transfer-encoding' not in headers:
            raise Refused(411, f'the request has no Content-Length; {FORMS}')
        size = int(headers.get(b'content-length', MAX_BODY_BYTES))
        if size > MAX_BODY_BYTES:  # refused before its body is read
            raise Refused(413, f'the body has {size} bytes; at most {MAX_BODY_BYTES} are served', connection='close')
        deadline = asyncio.get_running_loop().time() + self.args.timeout
        async with self.body_room(size, deadline):
            body = await read_body(receive, deadline, self.args.timeout)
            if not body:
                raise Refused(400, f'the body is empty; {FORMS}')
            framed = b'framed=1' in scope['query_string'].split(b'&')  # opt-in: the 28x28 images too
            return 200, await self.run(body, headers.get(b'content-type', b'').decode('latin-1'), framed, receive), {}

    @contextlib.asynccontextmanager
    async def body_room(self, size, deadline):
        """Hold size bytes of the body budget while a body is read and answered; wait for them until the deadline."""
        if self.budget < size:
            self.queued += 1
            try:
                async with self.room:
                    await asyncio.wait_for(self.room.wait_for(lambda: self.budget >= size),
                                           deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                raise Refused(503, 'the server is busy reading other requests; try again shortly',
                              connection='close', **{'retry-after': '1'}) from None
            finally:
                self.queued -= 1
        self.budget -= size
        try:
            yield
        finally:
            self.budget += size
            if self.queued:
                async with self.room:
                    self.room.notify_all()

    async def run(self, body, content_type, framed, receive):
        """The reply, from a prediction thread, dropped when the client goes or the deadline passes."""
        if self.waiting >= MAX_WAITING:
            raise Refused(503, f'{MAX_WAITING} requests are waiting already; try again shortly', **{'retry-after': '1'})
        dropped = threading.Event()
        job = self.pool.submit(answer, self.model, body, content_type, dropped, framed)
        work, gone, quick = asyncio.wrap_future(job), None, min(0.05, self.args.deadline)
        self.waiting += 1
        try:  # most answers come within 50 ms; one still at work then also watches for its client leaving
            done, _ = await asyncio.wait({work}, timeout=quick)
            if not done:
                gone = asyncio.ensure_future(receive())  # http.disconnect, once the client closes its connection
                done, _ = await asyncio.wait({work, gone}, timeout=self.args.deadline - quick,
                                             return_when=asyncio.FIRST_COMPLETED)
                gone.cancel()
        finally:
            self.waiting -= 1
        if work in done:
            return work.result()
        dropped.set()
        queued = job.cancel()  # a job not begun is never run; one begun stops at its next image
        work.add_done_callback(lambda future: future.cancelled() or future.exception())  # its end goes unread
        if gone in done:
            raise ConnectionResetError
        raise Refused(503 if queued else 504, f'the image(s) were not read within {self.args.deadline:g}s; try '
                                              f'again, or send smaller images', **{'retry-after': '1'})


async def read_body(receive, deadline, timeout):
    """The whole request body (sent with a Content-Length or chunked), at most MAX_BODY_BYTES, by the deadline."""
    chunks, size = [], 0
    loop = asyncio.get_running_loop()
    timer = loop.call_at(deadline, asyncio.current_task().cancel)  # one timer for the whole body
    try:
        while True:
            message = await receive()
            if message['type'] == 'http.disconnect':
                raise ConnectionResetError
            chunks.append(message.get('body', b''))
            size += len(chunks[-1])
            if size > MAX_BODY_BYTES:
                raise Refused(413, f'the body is over {MAX_BODY_BYTES} bytes; at most that many are served',
                              connection='close')
            if not message.get('more_body'):
                return b''.join(chunks)
    except asyncio.CancelledError:
        if loop.time() < deadline:  # cancelled for another reason
            raise
        raise Refused(408, f'the request did not arrive whole within {timeout:g}s', connection='close') from None
    finally:
        timer.cancel()

def listen(host, port):
    """A socket listening on host:port (IPv4 or IPv6), or SetupError in one line."""
    if not 0 <= port <= 65535:
        raise common.SetupError(f'--port {port} is not a port: pass one from 1 to 65535 (or 0 for any free one).')
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise common.SetupError(f'cannot listen on {host}: no such address on this machine ({e.strerror}); pass '
                                f'--host 0.0.0.0 (every IPv4 address), :: (IPv6) or 127.0.0.1.') from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)  # bursts of new connections wait here, not in a SYN retry a second later
    except OSError as e:
        sock.close()
        advice = ('pass another --port, or stop what is using it' if e.errno == errno.EADDRINUSE else
                  'pass --host with an address of this machine, or 0.0.0.0')
        raise common.SetupError(f'cannot listen on {host}:{port} ({e.strerror}); {advice}.') from None
    return sock


def server_of(model, args, in_progress):
    """uvicorn, with its documented settings, serving App."""
    return uvicorn.Server(uvicorn.Config(
        App(model, args, in_progress), http='h11', h11_max_incomplete_event_size=MAX_HEAD_BYTES, ws='none',
        lifespan='off', log_level='warning', access_log=False, server_header=False, timeout_keep_alive=60,
        timeout_graceful_shutdown=args.grace))


def worker(model, args, sock, in_progress):
    """A worker process: uvicorn on the shared socket, stopped by its own signals (SIGTERM from the first process)."""
    torch.set_num_threads(1)
    server_of(model, args, in_progress).run(sockets=[sock])


def serve(model, args):
    """Serve on --workers processes: this one and workers - 1 more, sharing one listening socket."""
    sock = listen(args.host, args.port)
    torch.set_num_threads(1)  # a tiny model: one torch thread per request, requests on --threads threads
    # fork on Linux (the processes share torch's memory; no thread runs yet), spawn where fork is unsafe or absent
    context = multiprocessing.get_context('fork' if sys.platform == 'linux' else 'spawn')
    in_progress = [context.RawValue('i', 0) for _ in range(args.workers)]
    workers = [context.Process(target=worker, args=(model, args, sock, count), daemon=True)
               for count in in_progress[1:]]
    for process in workers:
        process.start()
    server = server_of(model, args, in_progress[0])
    thread = threading.Thread(target=server.run, kwargs={'sockets': [sock]})  # signals stay with this thread

    def stop(sig, frame):
        if not server.should_exit:
            print(f'Stopping on {signal.Signals(sig).name}: accepting no new connections, answering the requests '
                  f'in progress ({sum(count.value for count in in_progress)}) within {args.grace:g}s.', flush=True)
        server.should_exit = True
        for process in workers:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    thread.start()
    host, port = sock.getsockname()[:2]
    print(f'Serving {args.model} on http://{f"[{host}]" if ":" in host else host}:{port} with {args.workers} worker '
          f'process{"es" * (args.workers > 1)}: POST /predict, GET /health, and a page to try it at /', flush=True)
    reported = set()
    while thread.is_alive():
        thread.join(0.5)
        for process in workers:
            if process.exitcode not in (None, 0) and process.pid not in reported and not server.should_exit:
                reported.add(process.pid)
                print(f'warning: worker process {process.pid} ended with exit code {process.exitcode}; the others '
                      f'go on serving', file=sys.stderr, flush=True)
    for process in workers:
        process.join(args.grace + 5)
    return 0


def main(args):
    model = load_model(args.model)
    if not args.predict:
        return serve(model, args)
    failed = False
    for path in args.predict:
        try:
            with open(path, 'rb') as f:
                digits, probabilities = predict(model, framing.mnist_tensor(read_image(f.read())))
            print(f'{path}: {digits[0]} ({max(probabilities[0]):.1%})')
        except (OSError, Refused) as e:
            print(f'{path}: error: {e}', file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == '__main__':
    sys.stdout.reconfigure(line_buffering=True, write_through=False)
    args = parse_args()
    try:
        sys.exit(main(args))
    except common.SetupError as e:
        if args.debug:
            raise
        sys.exit(f'error: {e}')
    except KeyboardInterrupt:
        sys.exit(130)
