"""Serve a trained best_model.pth over HTTP: the document's last step, "deploy the trained model" (PAI-EAS).

Run command of an EAS service deployed from the training image, with the dataset mounted at /mnt/data:
  pip install -r /mnt/data/requirements-serve.txt && \
      exec python /mnt/data/serve.py --host 0.0.0.0 --model /mnt/data/output/best_model.pth
On your own machine (after ./run_local.sh; or ./run_local.sh serve):
  python serve.py --model ./output/single/best_model.pth
  python serve.py --model ./output/single/best_model.pth --predict digit.png ...   (no server)

POST /predict (or POST /, where EAS's SDK posts) an image of any size, as the body, a form upload or JSON:
{"digit": d, "probabilities": [p0, ..., p9]}. GET /health, GET / a page; errors are JSON {"error": "..."}.
Gunicorn runs --workers processes of uvicorn and replaces any that dies or hangs. No authentication (on EAS the
gateway checks the token). Request forms, limits, replies: docs/serving.md.
"""
import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import errno
import json
import logging
import math
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings

# The processes' title, Gunicorn's too where setproctitle is installed (gunicorn: master [serve.py --port 8000 ...]):
# pkill -f 'serve.py.*--port 8000' finds one service of several. In UTF-8: a GBK path's bytes would crash Gunicorn.
TITLE = ' '.join(['serve.py', *(os.fsencode(arg).decode(errors='replace') for arg in sys.argv[1:])])

try:
    import torch
    import uvicorn
    if sys.platform != 'win32':  # Gunicorn manages the worker processes where it runs: not on Windows
        if __name__ == '__main__' and sys.platform != 'darwin':  # before Gunicorn reads it (macOS: titles none)
            with contextlib.suppress(ImportError):
                from setproctitle import setproctitle
                setproctitle(TITLE)
        import resource
        from gunicorn.app.base import BaseApplication
        from gunicorn.arbiter import Arbiter
        from uvicorn_worker import UvicornWorker
    else:
        BaseApplication = Arbiter = UvicornWorker = object  # unused: one process serves

    import common
    import framing
    from framing import FORMS, Refused
except ModuleNotFoundError as e:
    if e.name in ('common', 'framing'):  # the script uploaded alone
        sys.exit(f'error: {e.name}.py is missing: upload it beside {os.path.abspath(__file__)} (on DLC, to the same '
                 f'folder of the dataset as the script).')
    requirements = os.path.join(os.path.dirname(__file__), 'requirements-serve.txt')
    sys.exit(f'error: serve.py needs {e.name}: pip install -r {requirements} (./run_local.sh serve installs it).')

MAX_BODY_BYTES = 10 * 1024 * 1024
MAX_HEAD_BYTES = 16384  # the request line and headers; more get uvicorn's 400
MAX_WAITING = 256  # requests of a worker process waiting for its prediction threads; more get 503
BODY_BUDGET = 8 * MAX_BODY_BYTES  # bytes of request bodies a worker process holds at once; more wait their turn
QUICK_BYTES, QUICK_PIXELS = 65536, 28 * 28  # a body and its images this small are read on the event loop
MAX_WORKERS = 1024  # each has memory of its own: some hundreds filled 24 GiB here; 10**12 hung at start
SPREAD_CHECK = 100  # replies between a worker's counts of the kept-alive connections it serves
ROUTES = {'/': ('GET', 'HEAD', 'POST'), '/predict': ('POST',), '/health': ('GET', 'HEAD')}  # POST /: EAS's SDK
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'page', 'index.html')  # GET /: try the model


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default='/mnt/data/output/best_model.pth',
                        help='best_model.pth of either training script (default: %(default)s)')
    parser.add_argument('--host', default='127.0.0.1',
                        help='address to listen on: 0.0.0.0 on EAS, :: for IPv6 (default: %(default)s, local only)')
    parser.add_argument('--port', type=int, default=8000,
                        help='port to listen on; 0 picks a free one (default: %(default)s)')
    parser.add_argument('--workers', type=common.positive(int, most=MAX_WORKERS),  # Windows: no fork, no graceful stop
                        default=1 if sys.platform == 'win32' else common.usable_cpus(),
                        help=f'worker processes, at most {MAX_WORKERS} (default: the CPUs this process may use, '
                             f'%(default)s)')
    parser.add_argument('--threads', type=common.positive(int), default=1,
                        help='threads of each worker that read images and run the model (default: %(default)s)')
    parser.add_argument('--timeout', type=common.positive(float, most=common.MAX_SECONDS), default=30,
                        help='seconds a client may take to send a request body (default: %(default)s)')
    parser.add_argument('--deadline', type=common.positive(float, most=common.MAX_SECONDS), default=10,
                        help='seconds to answer a request once its body is in; then 503 or 504 (default: %(default)s)')
    parser.add_argument('--worker-timeout', type=common.positive(int, most=common.MAX_SECONDS), default=30,
                        help='seconds a worker process may stop answering (a stuck event loop, a stopped process), '
                             'or a prediction thread stay on a request past its deadline, before the worker is '
                             'replaced (default: %(default)s)')
    parser.add_argument('--grace', type=common.positive(float, most=common.MAX_SECONDS), default=30,
                        help='seconds to finish the requests in progress on SIGTERM or Ctrl-C (default: %(default)s)')
    parser.add_argument('--predict', nargs='+', metavar='FILE', help='print the digit of each image and exit')
    parser.add_argument('--debug', action='store_true', help='show tracebacks for start-up errors (default: off)')
    return parser.parse_args()


class App:
    """The ASGI application of a worker process: routes, request forms, limits. Images are read and the model run on
    a pool of threads (MNIST-sized ones on the event loop), within a body budget, a queue bound and a deadline."""

    def __init__(self, model, args, workers):
        self.model, self.args, self.workers, self.slot = model, args, workers, 0  # slot: this worker's (pre_fork)
        slots = workers + 1024  # shared, a slot each (1024 for TTIN's): requests in progress, busy connections
        self.counts, self.held = multiprocessing.RawArray('i', slots), multiprocessing.RawArray('i', slots)
        self.clients, self.replies = collections.Counter(), 0  # replies by connection, and in all
        self.pool = concurrent.futures.ThreadPoolExecutor(args.threads, thread_name_prefix='predict')
        self.waiting, self.budget = 0, BODY_BUDGET
        self.room = asyncio.Condition()  # told when bytes of the budget come free; bound to the worker's event loop

    async def __call__(self, scope, receive, send):  # an HTTP request: no lifespan events, no WebSockets (Worker)
        started = time.perf_counter()
        self.counts[self.slot] += 1
        try:
            status, body, headers = await self.respond(scope, receive)
        except Refused as e:
            status, body, headers = e.status, {'error': str(e)}, e.headers
        except ConnectionError:  # the client went away: nobody to answer
            status = 499
        except asyncio.CancelledError:  # a quick stop, or --grace run out: uvicorn cancels what is in progress
            status, headers = 503, {'connection': 'close', 'retry-after': '1'}
            body = {'error': 'the server stopped before answering this request; send it again'}
        except Exception as e:  # a bug of ours: the client gets JSON, the log one line with where it happened
            where = traceback.extract_tb(e.__traceback__)[-1]
            sys.stderr.write(f'error: {type(e).__name__}: {e} at {os.path.basename(where.filename)}:{where.lineno}\n')
            status, body, headers = 500, {'error': f'the server failed on this request ({type(e).__name__})'}, {}
        finally:
            self.counts[self.slot] -= 1
        if status != 499:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            headers = {'content-type': 'application/json', 'content-length': str(len(data)), **headers}
            if self.crowded(scope['client']):
                headers['connection'] = 'close'
            await send({'type': 'http.response.start', 'status': status,
                        'headers': [(name.encode(), value.encode()) for name, value in headers.items()]})
            await send({'type': 'http.response.body', 'body': data})
        query = scope['query_string']  # with the path as sent: %0A stays, and no line is forged in the log
        target = (scope['raw_path'] + b'?' * bool(query) + query).decode('latin-1')
        sys.stderr.write(f'{scope["method"]} {target} {status} {(time.perf_counter() - started) * 1000:.1f} ms\n')

    def crowded(self, client):
        """Whether this reply closes its connection, to spread kept-alive clients over the workers: every SPREAD_CHECK
        replies, a worker holding 2 more busy connections (3 replies or more) than another closes one."""
        self.clients[client] += 1
        self.replies += 1
        if self.replies % SPREAD_CHECK:
            return False
        busy = {other for other, replies in self.clients.items() if replies >= 3}
        self.clients.clear()
        self.held[self.slot] = len(busy)
        others = [self.held[k] for k in range(self.workers) if k != self.slot]  # pre_fork: the lowest slots
        return client in busy and bool(others) and len(busy) > min(others) + 1

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
            return 200, {'status': 'ok', 'model': self.args.model, 'pid': os.getpid()}, {}  # the worker's
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
        """Hold size bytes of the body budget while a body is read and answered, waiting until the deadline."""
        if self.budget < size:
            try:
                async with self.room:
                    await asyncio.wait_for(self.room.wait_for(lambda: self.budget >= size),
                                           deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                raise Refused(503, 'the server is busy reading other requests; try again shortly',
                              connection='close', **{'retry-after': '1'}) from None
        self.budget -= size
        try:
            yield
        finally:
            self.budget += size
            async with self.room:
                self.room.notify_all()

    async def run(self, body, content_type, framed, receive):
        """The reply: at once for MNIST-sized images (0.1 ms, less than a thread's hand-off), else from a thread,
        dropped when the client goes or the deadline passes."""
        images = framing.images_in(body, content_type) if len(body) <= QUICK_BYTES else None
        dropped = threading.Event()
        if images and all(framing.pixel_count(image) <= QUICK_PIXELS for image in images[0]):
            return framing.answer(self.model, *images, dropped, framed)
        if self.waiting >= MAX_WAITING:
            raise Refused(503, f'{MAX_WAITING} requests are waiting already; try again shortly', **{'retry-after': '1'})
        job = self.pool.submit(lambda: framing.answer(self.model, *(images or framing.images_in(body, content_type)),
                                                      dropped, framed))
        work = asyncio.wrap_future(job)
        gone = asyncio.ensure_future(receive())  # http.disconnect, once the client closes its connection
        self.waiting += 1
        try:
            done, _ = await asyncio.wait({work, gone}, timeout=self.args.deadline, return_when=asyncio.FIRST_COMPLETED)
        finally:  # answered, or not: past the deadline, the client gone, or cancelled by a stop
            self.waiting -= 1
            gone.cancel()
            dropped.set()  # a job still running stops at its next image
        if work in done:
            return work.result()
        queued = job.cancel()  # a job not begun is never run (one begun stops at its next image: above)
        work.add_done_callback(lambda future: future.cancelled() or future.exception())  # its end goes unread
        if not queued and sys.platform != 'win32':  # Windows: the only process, never replaced
            asyncio.get_running_loop().call_later(self.args.worker_timeout, self.end_if_stuck, job)
        if gone in done:
            raise ConnectionResetError
        raise Refused(503 if queued else 504, f'the image(s) were not read within {self.args.deadline:g}s; try '
                                              f'again, or send smaller images', **{'retry-after': '1'})

    def end_if_stuck(self, job):
        """A thread still on a dropped job --worker-timeout seconds later is stuck, which the heartbeat (sent from
        the event loop) does not show: this worker stops, and Gunicorn starts another."""
        if not job.done():
            sys.stderr.write(f'error: a prediction thread of worker process {os.getpid()} is stuck on a request '
                             f'dropped {self.args.worker_timeout}s ago; the worker stops and another takes its place\n')
            os.kill(os.getpid(), signal.SIGTERM)  # a graceful stop: the other requests in progress are answered


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


def check_address(host, port):
    """Gunicorn's bind for host:port once it is known to be free (or handed down by USR2), or SetupError in one line.
    IPv6 where the host has a ':', as Gunicorn and uvicorn bind."""
    if not 0 <= port <= 65535:
        raise common.SetupError(f'--port {port} is not a port: pass one from 1 to 65535 (or 0 for any free one).')
    family = socket.AF_INET6 if ':' in host else socket.AF_INET
    bind = f'[{host}]:{port}' if family == socket.AF_INET6 else f'{host}:{port}'
    if 'GUNICORN_FD' in os.environ:  # a new master started by USR2: it takes the old one's socket
        return bind
    with socket.socket(family) as probe:  # Gunicorn binds it again
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except socket.gaierror as e:
            raise common.SetupError(f'cannot listen on {host}: no such address on this machine ({e.strerror}); pass '
                                    f'--host 0.0.0.0 (every IPv4 address), :: (IPv6) or 127.0.0.1.') from None
        except OSError as e:
            advice = {errno.EADDRINUSE: 'pass another --port, or stop what is using it',
                      errno.EACCES: 'the port needs privileges (below 1024: root, on Linux); pass another --port'
                      }.get(e.errno, 'pass --host with an address of this machine, or 0.0.0.0')
            raise common.SetupError(f'cannot listen on {host}:{port} ({e.strerror}); {advice}.') from None
    return bind


class Worker(UvicornWorker):
    """A worker process serving App with uvicorn: h11 (for its bound on the head), uvloop where installed. Windows'
    one process runs uvicorn with the same settings."""
    CONFIG_KWARGS = {'loop': 'auto', 'http': 'h11', 'h11_max_incomplete_event_size': MAX_HEAD_BYTES, 'ws': 'none',
                     'lifespan': 'off', 'access_log': False, 'server_header': False}

    def init_signals(self):
        super().init_signals()  # uvicorn-worker's: the master's handlers, copied by the fork, reset to the defaults
        # Exit 0 (not killed: Gunicorn logs that) on the stop signal uvicorn raises again once stopped, or on one
        # that comes before uvicorn's handlers; SIGQUIT: uvicorn-worker's own once serving
        for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            signal.signal(stop, end_worker)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal: the master stops the workers as on SIGTERM
        # A stop signalled before the reset reached the master's handlers, and was lost (gunicorn#1910)
        if self.app.stopping.value:
            sys.exit(0)

    def run(self):
        try:
            super().run()
        except SystemExit as e:  # a stop, once asyncio has cleaned up: no Python clean-up (0.5 s with torch loaded)
            os._exit(e.code or 0)

    def notify(self):  # the heartbeat, sent from the event loop every --worker-timeout/2 seconds
        super().notify()
        if os.getppid() != self.ppid:  # the master is gone (kill -9): nothing replaces this worker or stops it
            sys.stderr.write(f'warning: the master process {self.ppid} is gone; worker process {os.getpid()} stops\n')
            os.kill(os.getpid(), signal.SIGTERM)  # gracefully, as Gunicorn's own workers stop then

    def handle_exit(self, sig, frame):  # uvicorn-worker's handler of SIGQUIT, which stops nothing (uvicorn-worker#2)
        super().handle_exit(sig, frame)
        if sig == signal.SIGQUIT:  # Gunicorn's quick stop (kill -QUIT): passed to uvicorn as two Ctrl-C, its own
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)


class Master(Arbiter):
    """Gunicorn's master process, saying what a stop waits for. Ctrl-C and SIGHUP (a closed terminal; not under
    nohup) stop as gracefully as SIGTERM, where Gunicorn's own would drop the requests in progress or reload; a
    second Ctrl-C stops at once."""

    def handle_term(self, name='SIGTERM'):
        self.say_stopping(name, f'within {self.app.application.args.grace:g}s')
        raise StopIteration  # Gunicorn's graceful stop

    def handle_quit(self):  # kill -QUIT, Gunicorn's quick stop: uvicorn's too, in the workers (Worker.handle_exit)
        self.say_stopping('SIGQUIT', 'at once, with 503')
        super().handle_quit()

    def say_stopping(self, name, when):
        self.app.stopping.value = 1  # for the workers still starting (Worker.init_signals)
        with contextlib.suppress(OSError):  # no terminal to print on any more (SIGHUP)
            print(f'Stopping on {name}: accepting no new connections, answering the requests in progress '
                  f'({sum(self.app.application.counts)}) {when}.', flush=True)

    def handle_int(self):
        self.handle_term('SIGINT')

    def handle_hup(self):
        if not self.app.nohup:
            self.handle_term('SIGHUP')


class Service(BaseApplication):
    """Gunicorn through its custom application API, preload_app: the workers, forked with the model loaded, share
    its memory; one that dies, or stops answering for --worker-timeout seconds, is replaced."""

    def __init__(self, application, options):
        self.application, self.options = application, options
        self.stopping = multiprocessing.RawValue('b', 0)  # shared with the workers: set once a stop has begun
        self.nohup = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN  # started by nohup: SIGHUP ignored
        super().__init__()

    def load_config(self):
        for key, value in self.options.items():
            if key in self.cfg.settings:  # control_socket_disable: Gunicorn 25 and later
                self.cfg.set(key, value)

    def load(self):
        return self.application


def serve(model, args):
    """Serve on --workers processes under Gunicorn; on Windows, where Gunicorn does not run, on this one."""
    bind = check_address(args.host, args.port)
    torch.set_num_threads(1)  # a tiny model: one torch thread per request, requests on --threads threads
    # uvicorn warns twice of each request asking to upgrade (curl --http2), answered over HTTP/1.1 as it should be
    logging.getLogger('uvicorn.error').addFilter(
        lambda record: not record.getMessage().startswith(('Unsupported upgrade', 'No supported WebSocket')))
    # uvicorn's settings, under Gunicorn and alone: past --grace a stop cancels what is in progress (answered 503)
    Worker.CONFIG_KWARGS = {**Worker.CONFIG_KWARGS, 'timeout_graceful_shutdown': args.grace}
    workers = 1 if sys.platform == 'win32' else args.workers  # on Windows one process, whatever --workers says
    app = App(model, args, workers)
    if sys.platform == 'win32':
        config = uvicorn.Config(app, host=args.host, port=args.port, timeout_keep_alive=60, log_level='warning',
                                **Worker.CONFIG_KWARGS)
        server = uvicorn.Server(config)
        sock = config.bind_socket()
        sock.listen(2048)  # connections wait from now on, not from when uvicorn's loop starts
        print(serving_line(args.model, sock.getsockname(), 1), flush=True)
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises the signal again once it has stopped
            server.run(sockets=[sock])
        return 0

    raise_open_files_limit()

    def pre_fork(arbiter, worker):  # a free slot of the counts for each worker (app.slot: the fork's copy)
        taken = {other.slot for other in arbiter.WORKERS.values()}
        # once all are taken, the last one is shared (a StopIteration here would stop the service)
        worker.slot = app.slot = next((k for k in range(len(app.counts)) if k not in taken), len(app.counts) - 1)
        app.counts[worker.slot] = app.held[worker.slot] = 0

    # graceful_timeout: a worker not ended a second after uvicorn's --grace (a stuck event loop) is killed
    options = {'bind': [bind], 'workers': args.workers, 'worker_class': Worker, 'preload_app': True,
               'timeout': args.worker_timeout, 'graceful_timeout': math.ceil(args.grace) + 1, 'keepalive': 60,
               'backlog': 2048, 'loglevel': 'warning', 'control_socket_disable': True, 'pre_fork': pre_fork,
               'worker_tmp_dir': '/dev/shm' if os.path.isdir('/dev/shm') else None,  # heartbeats in memory
               'on_exit': ignore_stop_signals,  # the workers have ended; the master ends too
               'proc_name': TITLE,
               'when_ready': lambda arbiter: print(serving_line(
                   args.model, arbiter.LISTENERS[0].sock.getsockname(), args.workers), flush=True)}
    Master(Service(app, options)).run()
    return 0


def end_worker(signum, frame):
    ignore_stop_signals()
    sys.exit(0)  # asyncio's clean-up first lets the requests cancelled by the stop send their 503 (Worker.run)


def ignore_stop_signals(arbiter=None):
    """An ending process ignores stop signals (Ctrl-C held down): each would raise SystemExit again inside a
    request's clean-up, or kill the process in Python's own clean-up, which restores the default handlers."""
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(stop, signal.SIG_IGN)


def raise_open_files_limit():
    """Each connection is an open file: past the soft limit (macOS: 256) new ones are closed unanswered. Raised to
    the hard limit, as Go's runtime does (macOS: at most OPEN_MAX, 10240, as its setrlimit man page asks)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, 10240) if sys.platform == 'darwin' else hard
    with contextlib.suppress(ValueError, OSError):  # a limit refused: connections stay bounded by the soft one
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))


def serving_line(model, address, workers):
    host, port = address[:2]
    return (f'Serving {model} on http://{f"[{host}]" if ":" in host else host}:{port} with {workers} worker '
            f'process{"es" * (workers > 1)}: POST /predict, GET /health, and a page to try it at /')


def main(args):
    warnings.filterwarnings('ignore', module='PIL')  # of a client's damaged or huge picture: its reply says what
    model = framing.load_model(args.model)
    if not args.predict:
        return serve(model, args)
    failed = False
    for path in args.predict:
        try:
            with open(path, 'rb') as f:
                data = f.read(MAX_BODY_BYTES + 1)  # what the service reads: /dev/zero would fill the memory
            if len(data) > MAX_BODY_BYTES:
                raise ValueError(f'the file has over {MAX_BODY_BYTES} bytes; at most that many are served')
            digits, probabilities = framing.predict(model, framing.mnist_tensor(framing.to_mnist(data)))
        except (OSError, ValueError) as e:  # unreadable; or framing's: not an image, damaged, too large, no digit
            print(f'{path}: error: {getattr(e, "strerror", None) or e}', file=sys.stderr)
            failed = True
        else:  # not in the try: a closed output (| head) is no error of the image
            print(f'{path}: {digits[0]} ({max(probabilities[0]):.1%})')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.stdout.reconfigure(line_buffering=True, write_through=False, errors='surrogateescape')  # a GBK path's bytes
    args = parse_args()
    try:
        sys.exit(main(args))
    except common.SetupError as e:
        if args.debug:
            raise
        sys.exit(f'error: {e}')
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # the reader of its output is gone (--predict ... | head): end quietly
        sys.exit(141)
