"""Serve a trained best_model.pth over HTTP: the document's last step, "deploy the trained model" (PAI-EAS).

Run command of an EAS service deployed from the training image, with the dataset mounted at /mnt/data:
  pip install -r /mnt/data/requirements-serve.txt && \
      exec python /mnt/data/serve.py --host 0.0.0.0 --model /mnt/data/output/best_model.pth
On your own machine (after ./run_local.sh; or ./run_local.sh serve):
  python serve.py --model ./output/single/best_model.pth
  python serve.py --model ./output/single/best_model.pth --predict digit.png ...   (no server)

POST /predict (or POST /, where EAS's SDK posts) an image of any size, as the body, a form upload or JSON:
{"digit": d, "probabilities": [p0, ..., p9]}. GET /health, GET / a page; errors are JSON {"error": "..."}.
Gunicorn runs --workers processes of uvicorn serving asgi.py's application and replaces any that dies or
hangs. No authentication (on EAS the gateway checks the token). Request forms, limits, replies: docs/serving.md.
"""
import argparse
import contextlib
import errno
import logging
import math
import multiprocessing
import os
import signal
import socket
import sys
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
    import asgi
except ModuleNotFoundError as e:
    if e.name in ('common', 'framing', 'asgi'):  # the script uploaded alone
        sys.exit(f'error: {e.name}.py is missing: upload it beside {os.path.abspath(__file__)} (on DLC, to the same '
                 f'folder of the dataset as the script).')
    requirements = os.path.join(os.path.dirname(__file__), 'requirements-serve.txt')
    sys.exit(f'error: serve.py needs {e.name}: pip install -r {requirements} (./run_local.sh serve installs it).')

MAX_HEAD_BYTES = 16384  # the request line and headers; more get uvicorn's 400
MAX_WORKERS = 1024  # each has memory of its own: some hundreds filled 24 GiB here; 10**12 hung at start


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
    """A worker process serving asgi.App with uvicorn: h11 (for its bound on the head), uvloop where installed. Windows'
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
    app = asgi.App(model, args, workers)
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
                data = f.read(asgi.MAX_BODY_BYTES + 1)  # what the service reads: /dev/zero would fill the memory
            if len(data) > asgi.MAX_BODY_BYTES:
                raise ValueError(f'the file has over {asgi.MAX_BODY_BYTES} bytes; at most that many are served')
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
