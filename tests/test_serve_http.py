"""serve.py as a service under real traffic: the request forms clients send, HTTP at its edges, slow and
bursty clients, large images, redeploys (signals) and start-up errors. Real sockets, a real server process."""
import base64
import contextlib
import http.client
import io
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

import common
import framing
from conftest import ROOT, SIGHUP, free_port, run, script_env, serving, skip_without_sighup, start

# serve.py over real sockets, as EAS runs it from the training image: PAI's torch 2.3 (test_serve.py, in-process,
# runs in both legs)
pytestmark = pytest.mark.one_leg

SERVE = ROOT / 'serve.py'


STARTED = []  # servers a test started: none outlives its test, even one whose assertion failed


RUN_SERVE_PY = 'sys.argv[0] = sys.argv[1]; del sys.argv[1]; runpy.run_path(sys.argv[0], run_name="__main__")'
# serve.py as on Windows, here on Linux: told it is on Windows once torch and uvicorn are imported (no Gunicorn)
AS_ON_WINDOWS = ('import multiprocessing.sharedctypes, runpy, sys, torch, uvicorn; sys.platform = "win32"; ' +
                 RUN_SERVE_PY)
# serve.py with a decoder that takes 2 s for a picture that begins with b'slow', and never returns for one that begins
# with b'stuck', as an endless loop in a decoder's C code would (none is known): the event loop turns on meanwhile
WITH_A_DECODER_THAT_STICKS = f'''
import framing, runpy, sys, threading, time
read_image = framing.read_image
def stalling(data):
    if data.startswith(b'slow'):
        time.sleep(2)
    if data.startswith(b'stuck'):
        threading.Event().wait()
    return read_image(data)
framing.read_image = stalling
{RUN_SERVE_PY}'''


def serve(model_file, *flags, as_on_windows=False, env=None, launch=None):
    """(proc, reader, port) of serve.py serving on a free port; launch: Python code that runs it, changed."""
    port = free_port()
    launch = launch or (AS_ON_WINDOWS if as_on_windows else None)
    launcher = [sys.executable, '-c', launch] if launch else [sys.executable]
    proc, reader = start([*launcher, SERVE, '--model', model_file, '--port', str(port), *flags], env=env)
    STARTED.append(proc)
    reader.wait_for(lambda line: line.startswith('Serving'), timeout=60)
    return proc, reader, port


@pytest.fixture(autouse=True)
def no_server_left():
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            if hasattr(signal, 'SIGSTOP'):  # the master stopped first: it forks no replacement for a worker killed
                os.kill(proc.pid, signal.SIGSTOP)
            for pid in workers_of(proc):  # a worker outlives a killed master (and a stopped one waits for ever)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait(timeout=30)


def workers_of(proc):
    """The worker processes' ids: the children of Gunicorn's master process."""
    return children(proc.pid)


def children(pid):
    try:
        return {int(child) for child in open(f'/proc/{pid}/task/{pid}/children').read().split()}
    except FileNotFoundError:
        return set()


def answering(port, count):
    """The worker processes that answer GET /health on new connections, once count of them have. Bounded by time,
    not by requests: on a busy machine a worker forked a moment ago may take seconds to start answering."""
    seen, asked, deadline = set(), 0, time.monotonic() + 60
    while time.monotonic() < deadline:
        connection = http.client.HTTPConnection('127.0.0.1', port, timeout=30)
        connection.request('GET', '/health')
        response = connection.getresponse()
        assert response.status == 200
        seen.add(json.loads(response.read())['pid'])
        asked += 1
        if len(seen) == count:
            return seen
        time.sleep(0.005)
    raise AssertionError(f'only {seen} answered {asked} requests in 60 s')


@pytest.fixture(scope='module')
def server(model_file):
    port = free_port()
    with serving([sys.executable, SERVE, '--model', model_file, '--port', str(port), '--timeout', '2']) as started:
        yield port, *started


def png(seed=0, size=28):
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size), dtype=np.uint8)).save(buffer, 'PNG')
    return buffer.getvalue()


def exchange(port, data, timeout=10, count=None):
    """Send raw bytes on a new connection; return every reply the server sends until it closes or goes quiet."""
    with socket.create_connection(('127.0.0.1', port), timeout=timeout) as s:
        s.sendall(data)
        return read_replies(s, count)


def read_replies(s, count=None):
    """[(status, headers, JSON body)] of the replies on a socket, and whether it closed: until it closes, goes
    quiet, or count replies came."""
    replies, buffer = [], b''
    closed = False
    while len(replies) != count:
        while b'\r\n\r\n' in buffer:
            head, _, rest = buffer.partition(b'\r\n\r\n')
            lines = head.decode().split('\r\n')
            headers = dict(line.lower().split(': ', 1) for line in lines[1:])
            length = int(headers['content-length'])
            if len(rest) < length and not closed:
                break
            replies.append((int(lines[0].split()[1]), headers, json.loads(rest[:length]) if length else None))
            buffer = rest[length:]
        if closed or len(replies) == count:
            return replies, closed
        try:
            data = s.recv(65536)
        except socket.timeout:
            return replies, False
        closed = not data
        buffer += data


def post(port, body, headers=None, timeout=30):
    connection = http.client.HTTPConnection('127.0.0.1', port, timeout=timeout)
    connection.request('POST', '/predict', body=body, headers=headers or {})
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def post_refusable(port, body, timeout=30):
    """(status, Retry-After header, JSON body) of a POST /predict that the server may refuse for now."""
    connection = http.client.HTTPConnection('127.0.0.1', port, timeout=timeout)
    connection.request('POST', '/predict', body=body)
    response = connection.getresponse()
    return response.status, response.getheader('retry-after'), json.loads(response.read())


def expected(model_file, *images):
    model = framing.load_model(model_file)
    digits, probabilities = framing.predict(model, torch.cat([framing.to_tensor(i) for i in images]))
    return [{'digit': d, 'probabilities': pytest.approx(p, abs=1e-6)} for d, p in zip(digits, probabilities)]


def multipart(*files, field='file'):
    boundary = '----form-boundary-7MA4YWxkTrZu0gW'
    body = b''.join(f'--{boundary}\r\nContent-Disposition: form-data; name="note"\r\n\r\nhello\r\n'.encode() +
                    f'--{boundary}\r\nContent-Disposition: form-data; name="{field}{k}"; filename="d{k}.png"\r\n'
                    f'Content-Type: image/png\r\n\r\n'.encode() + data + b'\r\n' for k, data in enumerate(files))
    return body + f'--{boundary}--\r\n'.encode(), {'Content-Type': f'multipart/form-data; boundary={boundary}'}


def test_every_request_form_gets_the_same_answer(server, model_file, tmp_path):
    port = server[0]
    image, other = png(1), png(2)
    one, two = expected(model_file, image)[0], expected(model_file, image, other)
    encoded = base64.b64encode(image).decode()
    assert post(port, image, {'Content-Type': 'image/png'}) == (200, one)
    assert post(port, *multipart(image)) == (200, one)
    # the form's file, byte for byte: without the CRLF that ends the part
    body, headers = multipart(image)
    assert framing.images_in(body, headers['Content-Type']) == ([image], False)
    assert post(port, json.dumps({'image': encoded})) == (200, one)  # no Content-Type, as curl -d sends it
    assert post(port, json.dumps({'image': 'data:image/png;base64,' + encoded}),
                {'Content-Type': 'application/json'}) == (200, one)
    # Several images: a list, from one forward pass (the batch's own probabilities).
    assert post(port, *multipart(image, other)) == (200, {'predictions': two})
    images = [encoded, base64.b64encode(other).decode()]
    assert post(port, json.dumps({'images': images})) == (200, {'predictions': two})
    indented = '\n  ' + json.dumps({'images': images}, indent=2)  # as a file or a template may hold it
    assert post(port, indented, {'Content-Type': 'application/json'}) == (200, {'predictions': two})
    # Chunked, as a client streaming a file sends it.
    connection = http.client.HTTPConnection('127.0.0.1', port, timeout=30)
    connection.request('POST', '/predict', body=iter([image[:100], image[100:]]), encode_chunked=True)
    response = connection.getresponse()
    assert (response.status, json.loads(response.read())) == (200, one)
    # curl, as the README shows it.
    if shutil.which('curl'):
        (tmp_path / 'digit.png').write_bytes(image)
        for flags in (['-F', f'file=@{tmp_path / "digit.png"}'], ['--data-binary', f'@{tmp_path / "digit.png"}']):
            reply = subprocess.run(['curl', '-s', *flags, f'http://127.0.0.1:{port}/predict'], capture_output=True,
                                   text=True, timeout=30).stdout
            assert json.loads(reply) == one


def test_framed_1_adds_the_28x28_image_the_model_read_and_only_then(server):
    port = server[0]
    image = png(4, size=120)
    status, plain = post(port, image)
    assert status == 200 and 'framed' not in plain, 'the default reply is as it was'
    connection = http.client.HTTPConnection('127.0.0.1', port, timeout=30)
    connection.request('POST', '/predict?framed=1', body=image)
    response = connection.getresponse()
    reply = json.loads(response.read())
    assert response.status == 200
    assert reply['digit'] == plain['digit'] and reply['probabilities'] == plain['probabilities']
    assert reply['framed'].startswith('data:image/png;base64,')
    shown = Image.open(io.BytesIO(base64.b64decode(reply['framed'].partition(',')[2])))
    assert shown.size == (28, 28) and shown.tobytes() == framing.to_mnist(image).tobytes()
    body, headers = multipart(png(1), png(2))
    connection.request('POST', '/predict?token=abc&framed=1', body=body, headers=headers)  # among other fields
    response = connection.getresponse()
    several = json.loads(response.read())['predictions']
    assert [p['framed'][:22] for p in several] == ['data:image/png;base64,'] * 2


@pytest.mark.parametrize('body, headers, message', [
    (json.dumps({'picture': 'x'}), {}, 'the JSON body is not {"image": "<base64>"}'),
    (json.dumps({'image': '%%% not base64'}), {}, 'the JSON body is not'),
    (json.dumps({'images': []}), {}, 'the JSON body is not'),  # no image: 400, not the model's 500 on nothing
    (json.dumps([{'image': 'x'}]), {}, 'the JSON body is not'),  # a list, TensorFlow Serving's instances say
    (b'null', {'Content-Type': 'application/json'}, 'the JSON body is not'),  # JSON as declared
    (b'[' * 30000 + b']' * 30000, {}, 'the JSON body is not'),  # nested past Python's recursion limit
    (b'[' * 100000 + b']' * 100000, {}, 'the JSON body is not'),  # the same, read on a prediction thread
    (b'--b\r\nContent-Disposition: form-data; name="a"\r\n\r\ntext\r\n--b--\r\n',
     {'Content-Type': 'multipart/form-data; boundary=b'}, 'the form holds no file'),
    (b'plain words', {'Content-Type': 'text/plain'}, 'not an image in a format served'),
])
def test_an_unrecognised_body_gets_400_naming_the_accepted_forms(server, body, headers, message):
    status, reply = post(server[0], body, headers)
    assert status == 400 and message in reply['error']
    assert 'curl --data-binary @digit.png' in reply['error'] and 'curl -F file=@digit.png' in reply['error']


def test_a_bad_image_among_several_is_named(server):
    status, reply = post(server[0], *multipart(png(1), b'not an image'))
    assert status == 400 and reply['error'].startswith('image 2 of 2: the body is not an image')
    sixteen = [base64.b64encode(png(1)).decode()] * 16
    status, reply = post(server[0], json.dumps({'images': sixteen}))
    assert status == 200 and len(reply['predictions']) == 16, 'at most 16: 16 are served'
    status, reply = post(server[0], json.dumps({'images': sixteen + sixteen[:1]}))
    assert status == 413 and reply['error'] == 'the request holds 17 images; at most 16 are served at once'


@pytest.mark.parametrize('raw, status, message', [
    (b'POST /predict HTTP/1.1\r\nHost: x\r\n\r\n', 411, 'the request has no Content-Length'),
    (b'POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 20000000\r\n\r\n', 413, 'at most 10485760'),
    (b'BREW /predict HTTP/1.1\r\nHost: x\r\n\r\n', 501, 'the method is not served'),
    (b'PUT /predict HTTP/1.1\r\nHost: x\r\n\r\n', 405, '/predict takes POST'),
])
def test_every_request_gets_a_json_reply(server, raw, status, message):
    replies, _ = exchange(server[0], raw, count=1)
    assert len(replies) == 1 and replies[0][0] == status and message in replies[0][2]['error'], replies


@pytest.mark.parametrize('raw', [
    b'POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n',
    b'GET /health?' + b'a' * 70000 + b' HTTP/1.1\r\nHost: x\r\n\r\n',
    b'GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ' + b'a' * 20000 + b'\r\n\r\n',
    b'POST /predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n',
    b'GET /health HTTP/1.1 extra\r\n\r\n',
    b'GARBAGE\r\n\r\n',
], ids=['length', 'url', 'headers', 'coding', 'version', 'garbage'])
def test_a_request_uvicorn_cannot_parse_gets_400_and_the_connection_closes(server, raw):
    """uvicorn's own reply (text, not JSON: docs/serving.md), before the application sees the request; a head
    (request line and headers) still incomplete past 16 KB is refused so."""
    with socket.create_connection(('127.0.0.1', server[0]), timeout=10) as s:
        try:  # the head's end apart: the server holds an incomplete head of at most 16 KB, whatever comes
            s.sendall(raw[:-4])
            time.sleep(0.2)
            s.sendall(raw[-4:])
        except OSError:  # closed while the oversized head was still being sent
            pass
        reply = b''.join(iter(lambda: s.recv(65536), b''))  # until the server closes
    assert reply.startswith(b'HTTP/1.1 400 '), reply[:200]
    assert post(server[0], png(5))[0] == 200


def test_a_chunked_body_is_served_up_to_10_mib_and_refused_past_them(server):
    """A chunked body has no length to refuse it by in advance: it is counted as it comes."""
    head = b'POST /predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n'
    body = png(7) + bytes(10 * 2**20 - len(png(7)))  # a PNG, then padding to exactly 10 MiB: Pillow reads the PNG
    chunks = b''.join(b'%x\r\n%s\r\n' % (2**20, body[k:k + 2**20]) for k in range(0, len(body), 2**20))  # of 1 MiB
    replies, _ = exchange(server[0], head + chunks + b'0\r\n\r\n', count=1)
    assert [status for status, _, _ in replies] == [200], replies
    over = body + b'x'  # in one chunk, sent up to its last byte: the reply comes once that byte, too many, is read
    replies, closed = exchange(server[0], head + b'%x\r\n' % len(over) + over)  # nothing unread: no reset
    message = 'the body is over 10485760 bytes; at most that many are served'
    assert [(status, reply) for status, _, reply in replies] == [(413, {'error': message})]
    assert closed and replies[0][1]['connection'] == 'close'


def test_head_and_options_and_405_name_the_methods_a_path_takes(server):
    connection = http.client.HTTPConnection('127.0.0.1', server[0], timeout=30)
    connection.request('GET', '/predict')
    response = connection.getresponse()
    assert response.status == 405 and response.headers['allow'] == 'POST, OPTIONS'  # as HTTP asks of a 405
    assert json.loads(response.read()) == {'error': '/predict takes POST'}
    connection.request('HEAD', '/health')
    response = connection.getresponse()
    assert response.status == 200 and response.read() == b'' and int(response.headers['content-length']) > 0
    connection.request('OPTIONS', '/predict')  # the same connection: HEAD's reply had no body
    response = connection.getresponse()
    assert response.status == 200
    assert response.headers['allow'] == 'POST, OPTIONS' == json.loads(response.read())['allow']


def test_an_upgrade_header_is_answered_over_http_1_1_and_not_warned_of(server):
    """curl --http2 asks to upgrade to h2c, a WebSocket client to websocket: the request is answered as it is
    (no WebSockets here), and the log has no word of it (uvicorn's warnings advise installing a library)."""
    for upgrade in ('h2c', 'websocket'):
        replies, _ = exchange(server[0], f'GET /health?{upgrade} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n'
                                         f'Upgrade: {upgrade}\r\n\r\n'.encode(), count=1)
        assert replies[0][0] == 200 and replies[0][2]['status'] == 'ok', replies
        server[2].wait_for(lambda line: line.startswith(f'GET /health?{upgrade} 200'))
    log = server[2].drain()
    assert 'Unsupported upgrade' not in log and 'WebSocket' not in log, log


@pytest.mark.parametrize('first', [
    b'POST /predict/ HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello',  # 404 with its body unread
    b'POST /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n',  # 405
    b'POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello',  # 400, not an image
    b'POST /predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n',  # 400, chunked
])
def test_a_kept_alive_connection_stays_usable_after_an_error(server, first):
    health = b'GET /health HTTP/1.1\r\nHost: x\r\n\r\n'
    replies, closed = exchange(server[0], first + health + health, count=3)  # a close shows at once
    assert [status for status, _, _ in replies][1:] == [200, 200] and replies[0][0] in (400, 404, 405), replies
    assert replies[2][2]['status'] == 'ok' and not closed


def test_a_body_has_one_deadline_however_slowly_it_trickles(server):
    port, _, reader = server  # --timeout 2
    head = b'POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 200\r\n\r\n'
    with socket.create_connection(('127.0.0.1', port), timeout=10) as s:
        sent = 0
        s.sendall(head)
        try:
            for _ in range(60):  # 60 bytes 0.1 s apart: each read is quick, the whole takes 6 s
                s.sendall(b'x')
                sent += 1
                time.sleep(0.1)
        except OSError:  # the server closed the connection
            pass
        replies, closed = read_replies(s)
    assert closed and [status for status, _, _ in replies] == [408], replies
    assert 'did not arrive whole within 2s' in replies[0][2]['error']
    assert sent < 60, 'cut off before the client finished'


@pytest.mark.skipif(sys.platform != 'linux', reason='reads the worker processes from /proc')
def test_connections_cost_no_threads(server):
    port, proc, _ = server
    answering(port, common.usable_cpus())  # every worker forked and serving (the serving line comes before the forks)
    threads = lambda: sum(int(re.search(r'^Threads:\s+(\d+)', open(f'/proc/{pid}/status').read(), re.M).group(1))
                          for pid in {proc.pid} | workers_of(proc))  # Gunicorn's master and its workers
    before = threads()
    held = [socket.create_connection(('127.0.0.1', port), timeout=30) for _ in range(200)]
    for s in held:
        s.sendall(b'GET /health HTTP/1.1\r\nHost: x\r\n')  # headers begun, never finished
    time.sleep(0.5)
    assert threads() == before, '200 held connections, no new threads'
    for s in held:
        s.sendall(b'\r\n')
    assert all(read_replies(s, count=1)[0][0][0] == 200 for s in held)
    for s in held:
        s.close()


@pytest.mark.skipif(sys.platform == 'win32', reason='Gunicorn (the workers) and the soft limit of open files')
def test_connections_past_the_soft_limit_of_open_files_are_answered(model_file):
    # Started with a soft limit of 64 open files (macOS's is 256): before, past about 40 connections the worker
    # closed new ones unanswered. serve.py raises the soft limit to the hard one.
    import resource
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1024:
        pytest.skip('the hard limit of open files is under 1024 here')
    lowered = ('import resource, runpy, sys; '
               'resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1])); ')
    port = serve(model_file, '--workers', '1', launch=lowered + RUN_SERVE_PY)[2]
    held = [socket.create_connection(('127.0.0.1', port), timeout=30) for _ in range(200)]
    for s in held:
        s.sendall(b'GET /health HTTP/1.1\r\nHost: x\r\n\r\n')
    assert [status for s in held for status, _, _ in read_replies(s, count=1)[0]] == [200] * 200
    for s in held:
        s.close()


@pytest.mark.skipif(not shutil.which('ss'), reason='reads the listen backlog with ss (iproute2), not installed')
@pytest.mark.parametrize('as_on_windows', [False, True], ids=['gunicorn', 'one-process'])
def test_the_listen_backlog_is_the_documented_one(server, model_file, as_on_windows):
    """Room for a burst of new connections while every process is busy: docs/serving.md's number (socketserver's
    default is 5), or the system's cap on any backlog where that is lower."""
    port = serve(model_file, as_on_windows=True)[2] if as_on_windows else server[0]
    documented = re.search(r'^\| connections waiting to be accepted \| (\d+) \(the listen backlog\) \|$',
                           (ROOT / 'docs' / 'serving.md').read_text(), re.M)
    assert documented, "docs/serving.md's limits table no longer names the listen backlog"
    with open('/proc/sys/net/core/somaxconn') as f:
        expected = min(int(documented.group(1)), int(f.read()))
    listening = subprocess.run(['ss', '-ltnH', f'sport = :{port}'], capture_output=True, text=True, check=True).stdout
    assert [int(line.split()[2]) for line in listening.splitlines()] == [expected], listening  # Send-Q: the backlog


def tree_pss(pid):
    """PSS of a process and its children, in bytes: shared pages split between them."""
    total = 0
    for p in [pid] + [int(c) for c in open(f'/proc/{pid}/task/{pid}/children').read().split()]:
        try:
            total += sum(int(line.split()[1]) for line in open(f'/proc/{p}/smaps_rollup') if line.startswith('Pss:'))
        except FileNotFoundError:
            pass
    return total * 1024


def at_once(count, client):
    """Run client() on count threads at the same time; return when all are done."""
    threads = [threading.Thread(target=client) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


class Peak:
    """The peak PSS of a server's processes, sampled every 20 ms on a thread while in a with block."""

    def __init__(self, pid):
        self.pid, self.samples, self.done = pid, [tree_pss(pid)], threading.Event()

    def __enter__(self):
        self.thread = threading.Thread(target=self.sample)
        self.thread.start()
        return self

    def sample(self):
        while not self.done.is_set():
            self.samples.append(tree_pss(self.pid))
            time.sleep(0.02)

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.samples)


def test_eight_largest_images_at_once_stay_under_the_memory_bound(model_file):
    # A few seconds on an idle 2-core machine; --deadline 120, so that a loaded one gets no 503 for its slowness
    proc, reader, port = serve(model_file, '--deadline', '120')
    big, results = largest_png(), []
    with Peak(proc.pid) as memory:
        at_once(8, lambda: results.append(post(port, big, timeout=150)[0]))
    proc.terminate()
    proc.wait(timeout=30)
    assert results == [200] * 8
    assert memory.peak < 1.5 * 2**30, f'peak PSS {memory.peak / 2**20:.0f} MiB'


@pytest.mark.slow
def test_200_clients_sending_10_mb_each_stay_under_the_memory_bound(model_file):
    """Bodies wait for room in each worker's budget of body bytes, unread (uvicorn stops reading them). 2 GB take
    about 20 s on an idle 2-core machine: --timeout 120, so that a loaded one gets no 408 for its slowness."""
    proc, reader, port = serve(model_file, '--workers', '2', '--timeout', '120')
    body = png(7) + bytes(10 * 2**20 - len(png(7)))  # a PNG, then padding to 10 MB: Pillow reads the PNG
    statuses = []

    def client():  # each body held 1.5 s short of its last byte: without the budget, 2 GB at once
        with socket.create_connection(('127.0.0.1', port), timeout=120) as s:
            s.sendall(b'POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n' % len(body))
            s.sendall(memoryview(body)[:-1])
            time.sleep(1.5)
            s.sendall(body[-1:])
            statuses.append(read_replies(s, count=1)[0][0][0])
    with Peak(proc.pid) as memory:
        at_once(200, client)
    proc.terminate()
    proc.wait(timeout=30)
    assert len(statuses) == 200 and set(statuses) <= {200, 503}, sorted(set(statuses))
    assert statuses.count(200) >= 100, statuses.count(200)
    assert memory.peak < 1.5 * 2**30, f'peak PSS {memory.peak / 2**20:.0f} MiB'


def largest_png():
    image = Image.new('RGBA', (4096, 4096), 'white')
    ImageDraw.Draw(image).ellipse((1300, 1000, 2800, 3000), outline='black', width=160)
    buffer = io.BytesIO()
    image.save(buffer, 'PNG')
    return buffer.getvalue()


def test_past_the_deadline_a_request_gets_503_or_504_and_its_work_is_dropped(model_file):
    proc, reader, port = serve(model_file, '--workers', '1', '--deadline', '0.05')
    big, statuses = largest_png(), []
    at_once(4, lambda: statuses.append(post_refusable(port, big)))
    assert sorted(status for status, _, _ in statuses) in ([503, 503, 503, 504], [503, 503, 504, 504]), statuses
    assert all(reply['error'].startswith('the image(s) were not read within 0.05s') for _, _, reply in statuses)
    assert [retry for _, retry, _ in statuses] == ['1'] * 4
    for _ in range(50):  # the server goes on serving, once the image begun is read (a 0.05 s deadline is short)
        if post(port, png(1))[0] == 200:
            break
        time.sleep(0.1)
    else:
        raise AssertionError('no 200 within 5 s of the 503s')
    proc.terminate()
    proc.wait(timeout=30)
    assert len(re.findall(r'POST /predict 504 ', reader.rest())) >= 1


def test_a_request_of_several_images_past_its_deadline_frees_the_thread_at_its_next_image(model_file):
    """16 of the largest images (0.2 s each) take the one prediction thread for some 3 s; past the 1 s deadline the
    request gets 504 and its work stops at the next image, so a request after it that needs the thread is answered
    within its own deadline (kept going, the work would hold the thread for 2 s more: 503)."""
    proc, reader, port = serve(model_file, '--workers', '1', '--threads', '1', '--deadline', '1')
    busy = json.dumps({'images': [base64.b64encode(largest_png()).decode()] * 16})
    status, _, reply = post_refusable(port, busy)
    assert (status, reply) == (504, {'error': 'the image(s) were not read within 1s; try again, or send smaller '
                                              'images'})
    assert post_refusable(port, png(3, size=29))[0] == 200  # 29x29: too large to be read on the event loop


@pytest.mark.slow
def test_past_256_requests_waiting_for_the_prediction_thread_a_request_gets_503_at_once(model_file):
    """Two requests of 16 of the largest images keep the one thread busy for seconds (0.2 s an image); meanwhile
    300 requests that need the thread (29x29: too large to be read on the event loop) arrive, in well under one.
    Before them 300 such requests were answered one after the other: the bound counts the requests waiting now."""
    proc, reader, port = serve(model_file, '--workers', '1', '--threads', '1', '--deadline', '120')
    small, statuses = png(3, size=29), []
    connection = http.client.HTTPConnection('127.0.0.1', port, timeout=30)
    for _ in range(300):
        connection.request('POST', '/predict', body=small)
        response = connection.getresponse()
        response.read()
        statuses.append(response.status)
    assert statuses == [200] * 300
    busy = json.dumps({'images': [base64.b64encode(largest_png()).decode()] * 16})
    blockers, replies = [], []
    threads = [threading.Thread(target=lambda: blockers.append(post(port, busy, timeout=150)[0])) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # their bodies in, their work begun
    at_once(300, lambda: replies.append(post_refusable(port, small, timeout=150)))
    for thread in threads:
        thread.join()
    assert blockers == [200, 200]
    refused = [reply for reply in replies if reply[0] == 503]
    message = {'error': '256 requests are waiting already; try again shortly'}
    assert refused and all(reply == (503, '1', message) for reply in refused), refused[:1]
    served = [reply for reply in replies if reply[0] == 200]
    assert len(served) + len(refused) == 300 and len(served) >= 256 - 2, len(served)  # 256 waiting, the 2 among them
    assert all(body == served[0][2] for _, _, body in served)  # the same image, the same answer
    assert post(port, small) == (200, served[0][2])  # the bound counts requests waiting now, not all so far


def test_a_client_that_goes_away_costs_no_more_work(model_file):
    proc, reader, port = serve(model_file, '--workers', '1')
    big = largest_png()
    for _ in range(3):  # each sent whole, then the client closes without waiting for its answer
        with socket.create_connection(('127.0.0.1', port), timeout=30) as s:
            s.sendall(b'POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n' % len(big) + big)
    line = reader.wait_for(lambda line: line.startswith('POST /predict'))
    assert post(port, png(1))[0] == 200
    proc.terminate()
    lines = [line] + [line for line in reader.rest().splitlines() if line.startswith('POST /predict')]
    assert sum(line.startswith('POST /predict 499 ') for line in lines) >= 2, lines  # dropped, not answered


def send_head_for_100_continue(s, length):
    """Send a POST's head asking for 100 Continue and wait for it: uvicorn sends it when the application first asks
    for the body, so the request is in progress (and counted) from then on."""
    s.sendall(b'POST /predict HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n' % length)
    interim = b''
    while not interim.endswith(b'\r\n\r\n'):
        byte = s.recv(1)
        assert byte, f'the connection closed after {interim!r}'
        interim += byte
    assert interim.startswith(b'HTTP/1.1 100 '), interim


def wait_until_refused(port):
    """Once every process has closed the listening socket (within the server's next tick of a stop)."""
    for _ in range(200):
        try:
            socket.create_connection(('127.0.0.1', port), timeout=5).close()
            time.sleep(0.05)
        except ConnectionRefusedError:
            return
    raise AssertionError('still accepting connections 10 s after the signal')


@pytest.mark.skipif(sys.platform == 'win32', reason="Gunicorn's stop: Windows' one process prints no Stopping line")
@pytest.mark.parametrize('sig, name', [(signal.SIGTERM, 'SIGTERM'), (signal.SIGINT, 'SIGINT'),
                                       pytest.param(SIGHUP, 'SIGHUP', marks=skip_without_sighup)])  # a closed terminal
def test_a_stop_answers_the_requests_in_progress_then_exits_0(model_file, sig, name):
    proc, reader, port = serve(model_file, '--workers', '2')
    image = png(3)
    with socket.create_connection(('127.0.0.1', port), timeout=30) as s, \
            socket.create_connection(('127.0.0.1', port), timeout=30) as idle:
        idle.sendall(b'GET /health HTTP/1.1\r\nHost: x\r\n\r\n')
        assert read_replies(idle, count=1)[0][0][0] == 200
        send_head_for_100_continue(s, len(image))
        proc.send_signal(sig)
        line = reader.wait_for(lambda line: line.startswith('Stopping'))
        assert line == f'Stopping on {name}: accepting no new connections, answering the requests in progress (1) ' \
                       f'within 30s.\n'
        wait_until_refused(port)
        s.sendall(image)  # the body, after the signal
        replies, closed = read_replies(s)
        assert [status for status, _, _ in replies] == [200] and closed
        assert idle.recv(100) == b'', 'an idle kept-alive connection is closed'
    assert proc.wait(timeout=30) == 0
    rest = reader.rest()
    assert 'Traceback' not in rest and '[ERROR]' not in rest  # workers end with exit 0, not killed by the signal


def ctrl_c_twice(proc, port, workers):
    """Ctrl-C in a terminal signals the master and every worker; the second one comes while stopping. Returns the
    master's Stopping line, of the first."""
    group = [proc.pid, *workers]
    for pid in group:
        os.kill(pid, signal.SIGINT)
    wait_until_refused(port)  # every process has taken the first Ctrl-C
    for pid in group:
        with contextlib.suppress(ProcessLookupError):  # the idle worker has ended
            os.kill(pid, signal.SIGINT)
    return 'Stopping on SIGINT: accepting no new connections, answering the requests in progress (1) within 600s.\n'


def kill_quit(proc, port, workers):
    """kill -QUIT, Gunicorn's quick stop (uvicorn's worker took no notice of it: the workers served on until Gunicorn
    killed them --grace and a second later, their connections closed unanswered). Returns the
    master's Stopping line."""
    proc.send_signal(signal.SIGQUIT)
    wait_until_refused(port)
    return ('Stopping on SIGQUIT: accepting no new connections, answering the requests in progress (1) at once, '
            'with 503.\n')


@pytest.mark.skipif(sys.platform == 'win32', reason="Gunicorn's stop: Windows has no SIGQUIT, and no second Ctrl-C")
@pytest.mark.parametrize('stop', [ctrl_c_twice, kill_quit])
def test_a_quick_stop_answers_the_request_in_progress_503_at_once(model_file, stop):
    """A second Ctrl-C, or Gunicorn's quick stop, while a request is in progress stops at once (not after --grace),
    the request answered 503, exit 0, without a traceback, an error or a warning."""
    proc, reader, port = serve(model_file, '--workers', '2', '--grace', '600')
    workers = answering(port, 2)  # both serving (a worker still starting: the next test)
    with socket.create_connection(('127.0.0.1', port), timeout=30) as s:
        send_head_for_100_continue(s, 100)  # its body never comes
        stopping = stop(proc, port, workers)
        assert proc.wait(timeout=60) == 0  # TimeoutExpired: waiting --grace
        replies, closed = read_replies(s)
    assert [(status, body) for status, _, body in replies] == [
        (503, {'error': 'the server stopped before answering this request; send it again'})] and closed
    rest = reader.rest()
    assert re.findall(r'^Stopping.*\n', rest, re.M) == [stopping]
    assert not re.search(r'Traceback|\[ERROR\]|\[WARNING\]', rest), rest


@pytest.mark.skipif(sys.platform == 'win32', reason="Gunicorn's workers: Windows has one process, and no SIGQUIT")
@pytest.mark.parametrize('sig', ['SIGTERM', 'SIGQUIT'])
def test_a_stop_once_the_workers_have_their_handlers_ends_them_with_exit_0(model_file, sig):
    """SIGTERM or kill -QUIT while the workers start, once their signal handlers are set, before uvicorn serves
    (held back here, as they load the app): each ends with exit 0, not killed by the signal (which Gunicorn logs as
    a warning or an error)."""
    code = ('import runpy, sys, time, uvicorn_worker; load = uvicorn_worker.UvicornWorker.load_wsgi; '
            'uvicorn_worker.UvicornWorker.load_wsgi = lambda worker: '
            '(print("held", flush=True), time.sleep(30), load(worker)); ' + RUN_SERVE_PY)
    proc, reader, _ = serve(model_file, '--workers', '2', '--grace', '600', launch=code)
    for _ in range(2):
        reader.wait_for(lambda line: line == 'held\n', timeout=60)
    proc.send_signal(getattr(signal, sig))
    assert proc.wait(timeout=60) == 0  # TimeoutExpired: a worker waiting out its 30 s, then --grace
    rest = reader.rest()
    assert not re.search(r'Traceback|\[ERROR\]|\[WARNING\]', rest), rest


@pytest.mark.skipif(sys.platform != 'linux', reason='reads the worker processes from /proc')
def test_ctrl_c_held_down_stops_as_two_do(model_file):
    """Ctrl-C held down: SIGINT to the master and its workers every millisecond until the master ends. As after two,
    every request in progress is answered 503, exit 0, without a traceback, an error or a warning (the signals that
    came while a process ended raised SystemExit in requests' clean-ups, or killed the process in Python's)."""
    proc, reader, port = serve(model_file, '--workers', '2', '--grace', '600')
    answering(port, 2)
    connections = [socket.create_connection(('127.0.0.1', port), timeout=30) for _ in range(40)]
    try:
        for s in connections:
            send_head_for_100_continue(s, 100)  # their bodies never come
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            for pid in [proc.pid, *children(proc.pid)]:  # its children only: a reaped worker's pid may be reused
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGINT)
            time.sleep(0.001)
        assert proc.wait(timeout=1) == 0  # TimeoutExpired: waiting --grace; -2: killed by a signal
        replies = [read_replies(s) for s in connections]
    finally:
        for s in connections:
            s.close()
    stopped = (503, {'error': 'the server stopped before answering this request; send it again'})
    assert [[(status, body) for status, _, body in got] + [closed] for got, closed in replies] == \
        [[stopped, True]] * len(connections)
    rest = reader.rest()
    assert not re.search(r'Traceback|\[ERROR\]|\[WARNING\]', rest), rest


@skip_without_sighup
def test_closing_its_terminal_stops_it_as_gracefully_as_sigterm(model_file):
    """The terminal it runs in closes: its output has nowhere to go, and SIGHUP reaches each of its processes (the
    shell's hang-up of its jobs). Left to Gunicorn, the workers died of it, dropping the request in progress, and
    the master started new ones: the service ran on without a terminal. Here the request is answered, then every
    process exits, 0."""
    import pty  # not on Windows
    terminal, tty = pty.openpty()
    port = free_port()
    proc = subprocess.Popen([sys.executable, SERVE, '--model', model_file, '--port', str(port), '--workers', '2'],
                            cwd=ROOT, env=script_env(), stdin=subprocess.DEVNULL, stdout=tty, stderr=tty,
                            start_new_session=True)
    STARTED.append(proc)
    os.close(tty)
    shown = b''
    while b'Serving' not in shown:
        assert select.select([terminal], [], [], 60)[0], f'no Serving line within 60 s: {shown!r}'
        shown += os.read(terminal, 4096)
    with socket.create_connection(('127.0.0.1', port), timeout=30) as s:
        image = png(3)
        send_head_for_100_continue(s, len(image))
        os.close(terminal)
        os.killpg(proc.pid, signal.SIGHUP)
        wait_until_refused(port)
        s.sendall(image)  # the body, after the hang-up
        replies, closed = read_replies(s)
        assert [status for status, _, _ in replies] == [200] and closed
    assert proc.wait(timeout=30) == 0
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # no worker left running


@pytest.mark.skipif(sys.platform == 'win32', reason='no nohup, no SIGHUP on Windows')
def test_under_nohup_sighup_changes_nothing_and_pkill_stops_it_gracefully(model_file):
    port = free_port()
    proc, reader = start(['nohup', sys.executable, SERVE, '--model', model_file, '--port', str(port),
                          '--workers', '2'])
    STARTED.append(proc)
    reader.wait_for(lambda line: line.startswith('Serving'), timeout=60)
    workers = answering(port, 2)
    with socket.create_connection(('127.0.0.1', port), timeout=30) as s:
        image = png(3)
        send_head_for_100_continue(s, len(image))
        for sig in (signal.SIGHUP, signal.SIGTERM):  # SIGTERM as pkill -f serve.py sends it: to each process
            for pid in (proc.pid, *workers):
                os.kill(pid, sig)
        assert reader.wait_for(lambda line: line.startswith('Stopping')).startswith('Stopping on SIGTERM:')
        s.sendall(image)
        replies, closed = read_replies(s)
        assert [status for status, _, _ in replies] == [200] and closed
    assert proc.wait(timeout=30) == 0
    rest = reader.rest()
    assert 'SIGHUP' not in rest, rest  # no worker ended by it (Gunicorn logs a worker killed by a signal)


@pytest.mark.skipif(sys.platform == 'win32', reason="Gunicorn's workers: Windows has one process, and no SIGQUIT")
@pytest.mark.parametrize('sig', ['SIGTERM', 'SIGQUIT'])
def test_a_stop_while_the_workers_start_is_not_lost(model_file, sig):
    """SIGTERM (or kill -QUIT) while the workers have not yet set their own signal handlers (held back a second
    here): the forked copy of Gunicorn's master handlers takes it and nothing acts on it (gunicorn#1910), so the
    stop would wait --grace; each worker checks whether a stop has begun once its handlers are set."""
    code = ('import runpy, sys, time, uvicorn_worker; init = uvicorn_worker.UvicornWorker.init_signals; '
            'uvicorn_worker.UvicornWorker.init_signals = lambda worker: (time.sleep(1), init(worker)); ' + RUN_SERVE_PY)
    proc, reader, _ = serve(model_file, '--workers', '2', '--grace', '600', launch=code)
    proc.send_signal(getattr(signal, sig))
    assert proc.wait(timeout=60) == 0  # a lost signal: TimeoutExpired, the stop waiting --grace (600 s)
    rest = reader.rest()
    assert not re.search(r'Traceback|\[ERROR\]|\[WARNING\]', rest), rest  # each worker ended with exit 0


@pytest.mark.skipif(sys.platform != 'linux', reason='reads the worker processes from /proc')
def test_its_processes_are_found_by_name(model_file):
    """pgrep -f serve.py / pkill -f serve.py: where setproctitle is installed (the test requirements have it),
    Gunicorn retitles its processes, by default gunicorn: master [gunicorn]."""
    proc, _, port = serve(model_file, '--workers', '2')
    for pid in (proc.pid, *answering(port, 2)):
        with open(f'/proc/{pid}/cmdline', 'rb') as f:
            title = f.read().replace(b'\0', b' ')
        assert re.search(rb'serve\.py .*--port %d\b' % port, title), (pid, proc.pid, title)  # its flags kept


@pytest.mark.skipif(sys.platform != 'linux', reason='a file name not in UTF-8; reads the titles from /proc')
def test_a_model_path_not_in_utf8_is_served(model_file, tmp_path):
    """A path in another encoding (GBK's 测, as unzipped from Windows): with setproctitle, Gunicorn crashed as it
    was imported (27: it reads the title) or as it titled the master (23); the serving line, as it was printed
    where stdout is strict (most UTF-8 locales)."""
    model = os.fsdecode(os.path.join(os.fsencode(tmp_path), b'\xb2\xe2.pth'))
    shutil.copy(model_file, model)
    proc, reader, port = serve(model, env=script_env(PYTHONIOENCODING='utf-8:strict'))
    assert reader.lines[-1].startswith(f'Serving {tmp_path}/\\xb2\\xe2.pth on http://127.0.0.1:{port} '), reader.lines
    assert post(port, png(7))[0] == 200
    with open(f'/proc/{proc.pid}/cmdline', 'rb') as f:
        title = f.read().replace(b'\0', b' ')
    assert re.search(rb'serve\.py --model \S+/\xef\xbf\xbd\xef\xbf\xbd\.pth --port %d\b' % port, title), title
    proc.terminate()
    assert proc.wait(timeout=60) == 0


def test_it_leaves_nothing_in_the_home_folder(model_file, tmp_path):
    """Gunicorn 25 and later open a control socket for gunicornc, ~/.gunicorn/gunicorn.ctl (or in $XDG_RUNTIME_DIR):
    one path for every service of a user, the last started taking it, and left there after a stop. serve.py turns
    it off."""
    env = script_env(HOME=str(tmp_path))
    env.pop('XDG_RUNTIME_DIR', None)
    proc, _, _ = serve(model_file, env=env)
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(sys.platform != 'linux', reason='reads the worker processes from /proc')
def test_workers_added_by_gunicorns_ttin_signal_serve_and_stop_with_the_others(model_file):
    """kill -TTIN adds a worker process (Gunicorn's documented signal). Once the shared counts had no slot left
    for one (8 more than --workers), the search for it raised StopIteration, which Gunicorn's master takes for a
    graceful stop: the service ended, saying nothing."""
    proc, reader, port = serve(model_file, '--workers', '1')
    for count in range(2, 12):  # one at a time: signals of one kind sent at once may arrive as one
        os.kill(proc.pid, signal.SIGTTIN)
        deadline = time.monotonic() + 30
        while len(workers_of(proc)) < count:
            assert proc.poll() is None, reader.drain()
            assert time.monotonic() < deadline, f'{workers_of(proc)} 30 s after the TTIN for worker {count}'
            time.sleep(0.05)
    assert {post(port, png(k))[0] for k in range(20)} == {200}
    proc.terminate()
    assert reader.wait_for(lambda line: line.startswith('Stopping')).startswith('Stopping on SIGTERM:')
    assert proc.wait(timeout=30) == 0


@pytest.mark.skipif(sys.platform != 'linux', reason='reads the worker processes from /proc')
def test_a_killed_worker_is_replaced_and_every_request_after_it_is_answered(model_file):
    """kill -9 of a worker, as the kernel's OOM killer does: Gunicorn starts another."""
    proc, reader, port = serve(model_file, '--workers', '2')
    before = answering(port, 2)
    assert before == workers_of(proc)
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    statuses, deadline = [], time.monotonic() + 30
    while victim in workers_of(proc) or len(workers_of(proc)) < 2:  # every request from the kill on
        assert time.monotonic() < deadline, f'no second worker 30 s after the kill: {workers_of(proc)}'
        statuses.append(post(port, png(1))[0])
    statuses += [post(port, png(k))[0] for k in range(20)]
    assert set(statuses) == {200}, statuses
    after = answering(port, 2)
    assert victim not in after and after == workers_of(proc), 'the new worker answers too'
    assert f'Worker (pid:{victim}) was sent SIGKILL!' in reader.wait_for(lambda line: f'(pid:{victim})' in line)


@pytest.mark.skipif(sys.platform != 'linux', reason='reads the worker processes from /proc')
def test_a_stopped_worker_is_killed_and_replaced_while_the_other_answers(model_file):
    """kill -STOP of a worker, as a worker whose event loop hangs: past --worker-timeout Gunicorn kills it and starts
    another; the other answers every request meanwhile."""
    proc, reader, port = serve(model_file, '--workers', '2', '--worker-timeout', '3')
    victim = min(answering(port, 2))
    os.kill(victim, signal.SIGSTOP)
    try:
        statuses, deadline = [], time.monotonic() + 60
        while victim in workers_of(proc) or len(workers_of(proc)) < 2:
            assert time.monotonic() < deadline, 'the stopped worker still there after 60 s'
            statuses.append(post(port, png(1))[0])  # a new connection each: only a running worker accepts it
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    assert set(statuses) == {200} and len(statuses) > 10, statuses
    assert reader.wait_for(lambda line: 'WORKER TIMEOUT' in line).endswith(f'WORKER TIMEOUT (pid:{victim})\n')
    assert victim not in answering(port, 2)


@pytest.mark.skipif(sys.platform != 'linux', reason='reads the worker processes from /proc')
@pytest.mark.slow
def test_a_worker_whose_prediction_thread_is_stuck_is_replaced_and_one_merely_slow_is_not(model_file):
    """A prediction thread still on a request --worker-timeout seconds after its deadline is stuck; the worker's
    event loop turns on (its heartbeat too), so the worker stops itself, gracefully, and Gunicorn starts another.
    A thread that ends before then changes nothing. Pictures over 64 KiB are read on the prediction thread."""
    proc, reader, port = serve(model_file, '--workers', '1', '--deadline', '1', '--worker-timeout', '4',
                               launch=WITH_A_DECODER_THAT_STICKS)
    first, = answering(port, 1)
    assert post(port, b'slow' + bytes(65536))[0] == 504
    time.sleep(5)  # past the slow job's end (2 s) and its check (--deadline + --worker-timeout: 5 s)
    assert post(port, png(2, size=300))[0] == 200  # on the prediction thread
    assert answering(port, 1) == {first} == workers_of(proc)
    assert post(port, b'stuck' + bytes(65536))[0] == 504
    statuses, until = [], time.monotonic() + 2  # 2 s before the worker stops (4 s after its 504 was sent)
    while time.monotonic() < until:  # none as it stops: one whose head is still coming would be dropped
        statuses.append(post(port, png(1))[0])  # MNIST-sized: read on the event loop, which turns on
        time.sleep(0.05)
    assert set(statuses) == {200} and len(statuses) > 5, statuses
    deadline = time.monotonic() + 60
    while first in workers_of(proc) or not workers_of(proc):
        assert time.monotonic() < deadline, 'the stuck worker still there after 60 s'
        time.sleep(0.1)
    second, = answering(port, 1)
    assert second != first and post(port, png(2, size=300))[0] == 200  # a new prediction thread
    assert reader.wait_for(lambda line: 'stuck' in line) == (
        f'error: a prediction thread of worker process {first} is stuck on a request dropped 4s ago; the worker '
        f'stops and another takes its place\n')
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    assert 'Worker (pid:' not in reader.rest(), 'Gunicorn saw the stuck worker end as it should: exit 0'


@pytest.mark.skipif(sys.platform != 'linux', reason='reads the worker processes from /proc')
def test_the_workers_of_a_killed_master_stop_and_the_port_is_free_again(model_file):
    """kill -9 of Gunicorn's master reaches it alone; its workers hold the listening socket. Each stops once its
    heartbeat (every --worker-timeout/2 seconds) finds the master gone, as Gunicorn's own workers do, and the next
    start on the port serves (before: the workers served on for ever, and the next start failed, port in use)."""
    proc, reader, port = serve(model_file, '--workers', '2', '--worker-timeout', '4')  # a heartbeat every 2 s
    workers = answering(port, 2)
    master = proc.pid
    proc.kill()
    proc.wait()
    try:
        stopping = {reader.wait_for(lambda line: line.startswith('warning: the master')) for _ in workers}
        assert stopping == {f'warning: the master process {master} is gone; worker process {pid} stops\n'
                            for pid in workers}
        deadline = time.monotonic() + 30
        while any(running(pid) for pid in workers):
            assert time.monotonic() < deadline, 'a worker of the killed master still running 30 s later'
            time.sleep(0.1)
        with serving([sys.executable, SERVE, '--model', model_file, '--port', str(port)]):
            assert post(port, png(1))[0] == 200
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def running(pid):
    """Whether the process is there and not a zombie (ended, not yet reaped by whoever inherited it)."""
    try:
        return not re.search(r'^State:\s+Z', open(f'/proc/{pid}/status').read(), re.M)
    except FileNotFoundError:
        return False


@pytest.mark.skipif(sys.platform != 'linux', reason='reads the worker processes from /proc')
def test_gunicorns_usr2_upgrade_serves_on_from_a_new_master_once_the_old_one_is_stopped(model_file, tmp_path):
    """Gunicorn's upgrade, as it documents it: USR2 starts a new master (serve.py's command again, the model read
    anew) on the old one's listening socket; SIGTERM then stops the old one, and the new one serves on, on the same
    socket. Before, the new master found the port in use and ended."""
    served = tmp_path / 'best_model.pth'
    shutil.copy(model_file, served)
    proc, reader, port = serve(served, '--workers', '1')
    old = answering(port, 1)
    retrained = {name: weights / 2 for name, weights in torch.load(model_file, weights_only=True).items()}
    torch.save(retrained, served)  # the file the new master reads
    os.kill(proc.pid, signal.SIGUSR2)
    line = reader.wait_for(lambda line: line.startswith(('Serving', 'error')))  # the new master's
    assert line.startswith(f'Serving {served} on http://127.0.0.1:{port} with 1 worker process:'), line
    new_master, = workers_of(proc) - old  # a child of the old master
    try:
        new = answering(port, 2) - old  # both masters' workers answer
        assert new == children(new_master)
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        assert answering(port, 1) == new == children(new_master)
        status, reply = post(port, png(1))
        assert status == 200 and reply == expected(served, png(1))[0] and reply != expected(model_file, png(1))[0]
    finally:
        os.kill(new_master, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while running(new_master) and time.monotonic() < deadline:
            time.sleep(0.1)


@pytest.mark.skipif(sys.platform != 'linux', reason='reads the worker processes from /proc')
def test_a_stop_kills_a_worker_still_there_a_second_past_the_grace(model_file):
    """A worker whose event loop is stuck (here: stopped) never ends on the stop's SIGTERM: Gunicorn kills it once
    --grace and a second have passed (whole seconds), and the service exits 0."""
    proc, reader, port = serve(model_file, '--workers', '2', '--grace', '1')
    stuck = min(answering(port, 2))
    os.kill(stuck, signal.SIGSTOP)
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=20) == 0  # TimeoutExpired: waiting for the stuck worker (Gunicorn's default: 30 s)
        assert not running(stuck)  # gone, or killed and not yet reaped by the master's heir
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stuck, signal.SIGKILL)


@pytest.mark.skipif(sys.platform != 'linux', reason='reads the worker processes from /proc')
def test_kept_alive_connections_all_on_one_worker_are_spread_over_both(model_file):
    """4 clients keeping their connections, all accepted by one worker (the other stopped meanwhile): the crowded
    worker closes some, and they are opened again on the other; every request is answered."""
    proc, _, port = serve(model_file, '--workers', '2')
    running, stopped = answering(port, 2)

    def worker_of(connection):
        connection.request('GET', '/health')
        return json.loads(connection.getresponse().read())['pid']
    os.kill(stopped, signal.SIGSTOP)
    try:
        connections = [http.client.HTTPConnection('127.0.0.1', port, timeout=30) for _ in range(4)]
        assert {worker_of(connection) for connection in connections} == {running}
    finally:
        os.kill(stopped, signal.SIGCONT)
    replies, free = [], list(connections)

    def client():
        connection = free.pop()
        for n in range(300):
            connection.request('POST', '/predict', body=png(n))
            response = connection.getresponse()
            response.read()  # then http.client opens the connection again if the reply closed it
            replies.append((response.status, response.getheader('connection')))
    at_once(4, client)
    assert {status for status, _ in replies} == {200} and len(replies) == 1200
    assert 'close' in {connection for _, connection in replies}, 'no connection was closed'
    assert {worker_of(connection) for connection in connections} == {running, stopped}


def test_where_gunicorn_does_not_run_one_process_serves(model_file):
    """Windows (no Gunicorn, no fork): serve.py serves from its own process with uvicorn; here on Linux, told it
    is on Windows once torch and uvicorn are imported."""
    proc, reader, port = serve(model_file, '--workers', '2', as_on_windows=True)
    assert reader.lines[-1] == (
        f'Serving {model_file} on http://127.0.0.1:{port} with 1 worker process: POST /predict, GET /health, and a '
        f'page to try it at /\n')
    assert post(port, png(1)) == (200, expected(model_file, png(1))[0])
    assert workers_of(proc) == set() and answering(port, 1) == {proc.pid}
    kept = [http.client.HTTPConnection('127.0.0.1', port, timeout=30) for _ in range(2)]
    closes = []
    for n in range(120):  # two busy kept-alive connections: no other process to spread them to
        kept[n % 2].request('GET', '/health')
        response = kept[n % 2].getresponse()
        response.read()
        closes.append(response.getheader('connection'))
    assert closes == [None] * 120, 'one process closed a connection to spread it'
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize('as_on_windows', [False, True], ids=['gunicorn', 'one-process-as-on-windows'])
def test_uvicorn_is_set_up_alike_under_gunicorn_and_alone(model_file, as_on_windows):
    """uvicorn's settings, wherever it runs: no Server header, no log lines but serve.py's own, an idle kept-alive
    connection kept (60 s: past uvicorn's default 5 s and Gunicorn's 2 s), and a stop that waits --grace for a request
    in progress, then answers it 503 and exits 0."""
    proc, reader, port = serve(model_file, '--grace', '1', '--timeout', '600', as_on_windows=as_on_windows)
    with socket.create_connection(('127.0.0.1', port), timeout=30) as kept, \
            socket.create_connection(('127.0.0.1', port), timeout=30) as held:
        kept.sendall(b'GET /health HTTP/1.1\r\nHost: x\r\n\r\n')
        (status, headers, _), = read_replies(kept, count=1)[0]
        idle_since = time.monotonic()
        assert status == 200 and 'server' not in headers, headers
        time.sleep(6)
        kept.sendall(b'GET /health HTTP/1.1\r\nHost: x\r\n\r\n')
        assert [status for status, _, _ in read_replies(kept, count=1)[0]] == [200], \
            f'closed after {time.monotonic() - idle_since:.1f} s idle'
        ours = re.compile(r'(Serving .*|GET /health 200 \d+\.\d ms)\n')
        assert all(ours.fullmatch(line) for line in reader.drain().splitlines(keepends=True)), reader.lines
        send_head_for_100_continue(held, 100)  # its body never comes: --timeout would wait 600 s for it
        proc.send_signal(signal.SIGINT if as_on_windows else signal.SIGTERM)  # Ctrl-C on Windows; EAS's SIGTERM
        assert proc.wait(timeout=20) == 0  # TimeoutExpired: the stop waited for the body, not --grace
        replies, closed = read_replies(held)
    # uvicorn cancels the request past --grace: serve.py answers it (not a connection dropped by a killed worker)
    assert [(status, headers['retry-after'], body) for status, headers, body in replies] == [
        (503, '1', {'error': 'the server stopped before answering this request; send it again'})] and closed
    rest = reader.rest()
    assert 'Cancel 1 running task(s), timeout graceful shutdown exceeded' in rest and 'Traceback' not in rest, rest
    assert as_on_windows or re.search(r'^Stopping on SIGTERM: .* within 1s\.$', rest, re.M), rest


def test_without_its_page_the_service_says_so_at_the_root_and_serves_on(model_file, tmp_path):
    for name in ('serve.py', 'asgi.py', 'framing.py', 'common.py'):  # uploaded without page/
        shutil.copy(ROOT / name, tmp_path / name)
    port = free_port()
    proc, reader = start([sys.executable, tmp_path / 'serve.py', '--model', model_file, '--port', str(port)])
    STARTED.append(proc)
    reader.wait_for(lambda line: line.startswith('Serving'), timeout=60)
    connection = http.client.HTTPConnection('127.0.0.1', port, timeout=30)
    connection.request('GET', '/')
    response = connection.getresponse()
    missing = ('the page is missing: upload page/index.html beside serve.py; POST /predict and GET /health work '
               'without it')
    assert response.status == 404 and json.loads(response.read()) == {'error': missing}
    assert post(port, png(1))[0] == 200


@pytest.mark.parametrize('flags, message', [
    (['--port', '65536'], 'error: --port 65536 is not a port: pass one from 1 to 65535 (or 0 for any free one).'),
    (['--host', 'no-such-host.invalid'],
     'error: cannot listen on no-such-host.invalid: no such address on this machine'),
    (['--port', 'IN_USE'], 'Address already in use); pass another --port, or stop what is using it.'),
    (['--host', '192.0.2.1'], '); pass --host with an address of this machine, or 0.0.0.0.'),  # TEST-NET-1: not ours
])
def test_start_up_errors_are_one_line(model_file, flags, message):
    with socket.socket() as taken:
        taken.bind(('127.0.0.1', 0))
        taken.listen()
        flags = [str(taken.getsockname()[1]) if flag == 'IN_USE' else flag for flag in flags]
        returncode, stdout, stderr = run([sys.executable, SERVE, '--model', model_file, *flags], check=False,
                                         timeout=60)
    assert returncode == 1 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr


def test_a_port_below_1024_without_root_is_named(model_file):
    """As Linux refuses a port below 1024 to a user without root (simulated: the tests may run as root)."""
    code = ('import errno, runpy, socket, sys\n'
            'def bind(sock, address):\n'
            '    raise PermissionError(errno.EACCES, "Permission denied")\n'
            'socket.socket.bind = bind\n'
            'sys.argv = sys.argv[1:]\n'
            'runpy.run_path(sys.argv[0], run_name="__main__")\n')
    returncode, _, stderr = run([sys.executable, '-c', code, SERVE, '--model', model_file, '--port', '80'],
                                check=False, timeout=60)
    assert returncode == 1 and stderr == 'error: cannot listen on 127.0.0.1:80 (Permission denied); the port needs ' \
                                         'privileges (below 1024: root, on Linux); pass another --port.\n', stderr


@pytest.mark.parametrize('host, address, url_host, as_on_windows', [
    ('::1', '::1', '[::1]', False), ('localhost', '127.0.0.1', '127.0.0.1', False),  # as Gunicorn binds it
    ('::1', '::1', '[::1]', True)], ids=['ipv6', 'hostname', 'ipv6-one-process-as-on-windows'])
def test_ipv6_and_a_hostname(model_file, host, address, url_host, as_on_windows):
    try:
        socket.socket(socket.AF_INET6 if ':' in address else socket.AF_INET).bind((address, 0))
    except OSError:
        pytest.skip(f'no {address} loopback here')
    _, reader, port = serve(model_file, '--host', host, as_on_windows=as_on_windows)
    assert reader.lines[-1].startswith(f'Serving {model_file} on http://{url_host}:{port} ')
    connection = http.client.HTTPConnection(address, port, timeout=30)
    connection.request('GET', '/health')
    assert connection.getresponse().status == 200
