"""The ASGI application serve.py runs in each worker process: routes, request forms, limits, replies.

Any ASGI server can run App for HTTP requests (no lifespan events, no WebSockets); serve.py runs it on Gunicorn
and uvicorn and gives each worker its slot of the shared counts. framing.py reads the pictures and makes the
replies. Routes, request forms, limits: docs/serving.md.
"""
import asyncio
import collections
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback

import framing
from framing import FORMS, Refused

MAX_BODY_BYTES = 10 * 1024 * 1024
MAX_WAITING = 256  # requests of a worker process waiting for its prediction threads; more get 503
BODY_BUDGET = 8 * MAX_BODY_BYTES  # bytes of request bodies a worker process holds at once; more wait their turn
QUICK_BYTES, QUICK_PIXELS = 65536, 28 * 28  # a body and its images this small are read on the event loop
SPREAD_CHECK = 100  # replies between a worker's counts of the kept-alive connections it serves
ROUTES = {'/': ('GET', 'HEAD', 'POST'), '/predict': ('POST',), '/health': ('GET', 'HEAD')}  # POST /: EAS's SDK
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'page', 'index.html')  # GET /: try the model


class App:
    """The ASGI application of a worker process. Images are read and the model run on a pool of --threads threads
    (MNIST-sized ones on the event loop), within a body budget, a queue bound and a deadline. args: serve.py's flags
    (--model, --threads, --timeout, --deadline, --worker-timeout); workers: how many processes run it."""

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
