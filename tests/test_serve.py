"""serve.py as EAS runs it: a subprocess on a port, real HTTP requests, real PNG and JPEG files."""
import argparse
import asyncio
import gc
import io
import json
import os
import re
import socket
import sys
import threading
import urllib.error
import urllib.request
import uuid

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import datasets

import common
import framing
import mnist_train  # its transform: what the model was trained on
from conftest import ROOT, free_port, png_header, run, run_into_a_closed_pipe, serving, skip_on_windows_pipes

SERVE = ROOT / 'serve.py'


@pytest.fixture(scope='module')
def server(model_file):
    port = free_port()
    with serving([sys.executable, SERVE, '--model', model_file, '--port', str(port), '--timeout', '2']) as (_, reader):
        yield f'http://127.0.0.1:{port}', port, reader


def request(url, data=None, method=None):
    """(status, JSON body) of one request; error statuses too."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method), timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def encode(array, fmt='PNG', mode='L'):
    buffer = io.BytesIO()
    Image.fromarray(array.astype(np.uint8)).convert(mode).save(buffer, format=fmt)
    return buffer.getvalue()


def forward(model_file, images):
    """The model's own predictions on training-style tensors."""
    model = common.SimpleCNN()
    model.load_state_dict(torch.load(model_file, weights_only=True))
    with torch.no_grad():
        return torch.softmax(model(images), dim=1)


def healthy(url):
    status, reply = request(url + '/health')
    assert (status, reply['status'], set(reply)) == (200, 'ok', {'status', 'model', 'pid'}), reply
    assert isinstance(reply['pid'], int) and reply['model'].endswith('.pth')


def test_predictions_equal_the_models_own(server, model_file, mnist_dir):
    url, _, _ = server
    dataset = datasets.MNIST(root=mnist_dir, train=False, transform=mnist_train.transform)
    expected = forward(model_file, torch.stack([dataset[i][0] for i in range(30)]))
    for i in range(30):
        status, body = request(url + '/predict', encode(dataset.data[i].numpy()))
        assert status == 200 and body['digit'] == expected[i].argmax().item()
        assert body['probabilities'] == pytest.approx(expected[i].tolist(), abs=1e-6)
    assert len({request(url + '/predict', encode(dataset.data[i].numpy()))[1]['digit'] for i in range(30)}) > 1


def test_a_dark_digit_on_light_paper_of_any_size_and_colour_is_inverted(server, model_file, mnist_dir):
    url, _, _ = server
    image = datasets.MNIST(root=mnist_dir, train=False).data[3].numpy()
    light = 255 - image
    assert torch.equal(framing.to_tensor(encode(light)), framing.to_tensor(encode(image)))
    # A bigger colour photo of it: resized and inverted, the same digit as the model's own reading.
    big = np.array(Image.fromarray(light).resize((280, 280), Image.NEAREST))
    for data in (encode(big, 'PNG', 'RGB'), encode(big, 'JPEG', 'RGB')):
        status, body = request(url + '/predict', data)
        assert status == 200
        assert body['digit'] == forward(model_file, framing.to_tensor(data))[0].argmax().item()
    assert framing.to_tensor(encode(big, 'PNG', 'RGB')).mean() < 0, 'mostly dark after the inversion, as MNIST'


def test_bad_requests_get_their_status_and_the_server_keeps_serving(server, tmp_path):
    url, port, reader = server
    cases = [
        (request(url + '/predict', b'', 'POST'), 400, 'the body is empty; send the image file as the body'),
        (request(url + '/predict', b'this is not an image'), 400, 'not an image in a format served'),
        (request(url + '/predict', encode(np.random.default_rng(0).integers(0, 256, (28, 28)))[:300]), 400,
         'cannot be decoded'),
        (request(url + '/nowhere'), 404, 'no such path'),
        (request(url + '/predict'), 405, '/predict takes POST'),
        (request(url + '/health', b'x'), 405, '/health takes GET'),
    ]
    buffer = io.BytesIO()
    Image.new('1', (4097, 4096)).save(buffer, format='PNG')  # 16.8 million pixels in a small file
    cases.append((request(url + '/predict', buffer.getvalue()), 413, 'at most 16777216 are served'))
    for (status, body), expected_status, message in cases:
        assert status == expected_status and message in body['error'], (status, body)
        healthy(url)

    # Over 10 MB: refused from the header alone, before the body is read.
    with socket.create_connection(('127.0.0.1', port), timeout=10) as s:
        s.sendall(b'POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 20000000\r\n\r\n' + b'x' * 1000)
        reply = b''.join(iter(lambda: s.recv(4096), b'')).decode()  # until the server closes
    assert reply.startswith('HTTP/1.1 413 ') and 'at most 10485760' in reply
    healthy(url)


def test_eight_clients_at_once(server, model_file, mnist_dir):
    url, _, _ = server
    images = datasets.MNIST(root=mnist_dir, train=False).data[:25].numpy()
    pngs = [encode(image) for image in images]
    expected = forward(model_file, torch.cat([framing.to_tensor(png) for png in pngs])).argmax(dim=1).tolist()
    results = [[] for _ in range(8)]

    def client(k):
        for png in pngs:
            results[k].append(request(url + '/predict', png))
    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for k in range(8):
        assert [(status, body['digit']) for status, body in results[k]] == [(200, d) for d in expected]


def test_one_log_line_per_request(server):
    # The server is shared with this module's other tests and its worker processes write to one log: this test
    # finds its own requests' lines by a tag no other request carries, in whatever order the workers wrote them.
    url, _, reader = server
    tag = uuid.uuid4().hex
    request(url + f'/health?from={tag}')
    request(url + f'/log-test-{tag}')
    forged = f'/x%0AGET%20/forged-{tag}%20200%201.0%20ms'  # a newline, decoded, would forge a line
    request(url + forged)
    for _ in range(3):
        reader.wait_for(lambda line: tag in line)
    mine = sorted(line for line in reader.lines if tag in line)
    assert len(mine) == 3, mine
    assert re.fullmatch(rf'GET /health\?from={tag} 200 \d+\.\d ms\n', mine[0]), mine
    assert re.fullmatch(rf'GET /log-test-{tag} 404 \d+\.\d ms\n', mine[1]), mine
    assert re.fullmatch(rf'GET {forged} 404 \d+\.\d ms\n', mine[2]), 'the path as sent, on one line'


def test_serve_py_loads_no_torchvision():
    # The model, the pictures and the server need torch and PIL only: torchvision (and the torch compiler it loads)
    # would add seconds to every start and 160 MiB to the memory the workers share.
    _, stdout, _ = run([sys.executable, '-c', 'import sys, serve; '
                                              'print(sorted({"torchvision", "torch._dynamo"} & set(sys.modules)))'])
    assert stdout == '[]\n'


def test_predict_files_without_a_server(model_file, mnist_dir, tmp_path):
    image = datasets.MNIST(root=mnist_dir, train=False).data[0].numpy()
    (tmp_path / 'digit.png').write_bytes(encode(image))
    (tmp_path / 'notes.txt').write_text('not an image')
    expected = forward(model_file, framing.to_tensor(encode(image)))[0].argmax().item()
    returncode, alone, _ = run([sys.executable, SERVE, '--model', model_file, '--predict', tmp_path / 'digit.png'],
                               check=False)
    assert returncode == 0 and re.fullmatch(rf'{tmp_path}/digit.png: {expected} \(\d+\.\d%\)\n', alone)
    (tmp_path / 'huge.png').write_bytes(png_header(20000, 15000))  # Pillow warns of so many pixels, then refused
    with open(tmp_path / 'long.png', 'wb') as f:  # read no further than the service would: not /dev/zero for ever
        f.write(encode(image))
        f.truncate(10 * 1024 * 1024 + 1)
    returncode, stdout, stderr = run([sys.executable, SERVE, '--model', model_file, '--predict', tmp_path / 'digit.png',
                                      tmp_path / 'notes.txt', tmp_path / 'gone.png', tmp_path / 'long.png',
                                      tmp_path / 'huge.png'], check=False)
    assert returncode == 1 and stdout == alone  # one file's error: exit 1, the others printed
    assert stderr.startswith(f'{tmp_path}/notes.txt: error: not an image in a format served (PNG, JPEG, ')
    assert f'\n{tmp_path}/gone.png: error: No such file or directory\n' in stderr
    assert f'\n{tmp_path}/long.png: error: the file has over 10485760 bytes; at most that many are served\n' in stderr
    assert stderr.endswith(f'{tmp_path}/huge.png: error: the image has 20000x15000 pixels; at most 16777216 are '
                           f'served\n') and len(stderr.splitlines()) == 4, 'no warning of Pillow besides'


@skip_on_windows_pipes
def test_predict_into_a_closed_pipe_ends_quietly(model_file):
    # Before: each file not yet printed said "error: [Errno 32] Broken pipe", as if its image were bad.
    assert run_into_a_closed_pipe([sys.executable, SERVE, '--model', model_file, '--predict',
                                   *[ROOT / 'page' / 'seven.png'] * 3]) == (141, '')


@pytest.mark.parametrize('content, message', [
    (None, 'there is no model at'),
    (b'not a model', 'it is not a file of model weights'),
    ('linear', 'it holds the weights of another model'),
    ('folder', '{folder} is a folder, with no best_model.pth in it; pass --model with a best_model.pth'),
    ('output folder', '{folder} is a folder: pass --model {folder}/best_model.pth.'),  # the training's --output-dir
])
def test_a_missing_or_wrong_model_stops_at_start_up(content, message, tmp_path):
    path = tmp_path / 'best_model.pth'
    if content == 'linear' or content == 'output folder':
        torch.save((torch.nn.Linear(2, 2) if content == 'linear' else common.SimpleCNN()).state_dict(), path)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    if content in ('folder', 'output folder'):
        path, message = tmp_path, message.format(folder=tmp_path)
    returncode, stdout, stderr = run([sys.executable, SERVE, '--model', path, '--port', str(free_port())],
                                     check=False, timeout=60)
    assert returncode == 1 and 'Traceback' not in stderr and 'Serving' not in stdout
    assert stderr.startswith(f'error: cannot load {path}: {message}') or stderr.startswith(f'error: {message}')
    assert len(stderr.strip().splitlines()) == 1


class MakesAFolder:
    """Unpickled freely, it makes a folder: a model file that runs code as torch.load reads it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_a_model_file_that_would_run_code_is_refused_and_runs_none(tmp_path):
    # torch 2.3 (PAI's) unpickles anything unless told weights_only; a model may come from anywhere (EAS: OSS)
    ran = tmp_path / 'ran'
    torch.save({**common.SimpleCNN().state_dict(), 'conv1.weight': MakesAFolder(ran)}, tmp_path / 'best_model.pth')
    with pytest.raises(common.SetupError, match=r'it is not a file of model weights \(UnpicklingError\)'):
        framing.load_model(tmp_path / 'best_model.pth')
    assert not ran.exists()


def test_the_distributed_scripts_model_and_a_checkpoint_load_too(tmp_path):
    model = common.SimpleCNN()
    ddp_style = {'module.' + key: value for key, value in model.state_dict().items()}
    torch.save(ddp_style, tmp_path / 'ddp.pth')
    torch.save({'model': model.state_dict(), 'epochs_done': 1}, tmp_path / 'checkpoint.pth')
    for name in ('ddp.pth', 'checkpoint.pth'):
        loaded = framing.load_model(tmp_path / name)
        assert not loaded.training
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize('image', [Image.new('L', (28, 28), 0), Image.new('RGB', (300, 200), (200, 190, 180)),
                                   Image.new('RGBA', (64, 64), (0, 0, 0, 0)), Image.new('L', (500, 500), 255)])
def test_an_image_without_a_digit_gets_422(server, image):
    url, _, _ = server
    buffer = io.BytesIO()
    image.save(buffer, 'PNG')
    status, body = request(url + '/predict', buffer.getvalue())
    assert status == 422 and body['error'].startswith('the image has no digit: it is blank or all of one colour')


def test_a_worker_holding_2_more_busy_connections_than_another_closes_one():
    """asgi.App.crowded, the decision behind the Connection: close that spreads kept-alive clients."""
    import asgi
    app = asgi.App(None, argparse.Namespace(threads=1), 2)
    app.slot, check = 0, asgi.SPREAD_CHECK
    kept = [('127.0.0.1', 50000 + k) for k in range(4)]  # 4 connections, 25 replies each in a check
    assert [app.crowded(kept[n % 4]) for n in range(check)] == [False] * (check - 1) + [True]  # the other: 0
    assert app.held[0] == 4
    app.held[1] = 3  # within one of the other worker's: kept
    assert not any(app.crowded(kept[n % 4]) for n in range(check))
    app.held[1] = 2
    assert [app.crowded(kept[n % 4]) for n in range(check)][-1]
    app.held[1] = 0  # a new connection for each request, or two replies a connection: none is busy
    assert not any(app.crowded(('127.0.0.1', 40000 + n // 2)) for n in range(check)) and app.held[0] == 0
    three = [('127.0.0.1', 30000 + n // 3) for n in range(check - 1)] + [('127.0.0.1', 30000)]  # 3 replies: busy
    assert [app.crowded(client) for client in three][-1] and app.held[0] == 33
    alone = asgi.App(None, argparse.Namespace(threads=1), 1)  # one worker: nowhere to go
    assert not any(alone.crowded(kept[n % 4]) for n in range(check))


def test_a_worker_holds_80_mib_of_bodies_at_once_and_the_rest_wait_their_turn():
    """asgi.App.body_room, the body budget, with 10 MiB bodies: 8 at once; a 9th waits for room, till its deadline
    (503), or till one of the 8 is answered. (The 200-client test's memory bound alone cannot tell: without the
    budget its peak was under 1.5 GiB once in four runs.)"""
    import asgi
    app = asgi.App(None, argparse.Namespace(threads=1), 1)
    size, inside = asgi.MAX_BODY_BYTES, []

    async def body(name, answered, deadline=5):
        async with app.body_room(size, asyncio.get_running_loop().time() + deadline):
            inside.append(name)
            await answered.wait()

    async def requests():
        done = [asyncio.Event() for _ in range(9)]
        held = [asyncio.ensure_future(body(k, done[k])) for k in range(8)]
        await asyncio.sleep(0.1)
        assert inside == list(range(8))  # 80 MiB: room for all eight
        answered = asyncio.Event()
        answered.set()
        with pytest.raises(framing.Refused) as refused:
            await body('too late', answered, deadline=0.2)
        assert refused.value.status == 503 and str(refused.value).startswith('the server is busy reading other')
        ninth = asyncio.ensure_future(body(8, done[8]))
        await asyncio.sleep(0.1)
        assert inside == list(range(8))  # waiting
        done[0].set()
        await asyncio.sleep(0.1)
        assert inside == list(range(9))  # in, once the first was answered
        for event in done:
            event.set()
        await asyncio.gather(*held, ninth)
        assert app.budget == asgi.BODY_BUDGET  # all given back
    asyncio.run(requests())


def test_a_bug_of_the_servers_gets_500_in_json_and_one_log_line_saying_where(monkeypatch, capsys):
    """asgi.App.__call__ around a request whose handling raises what no reply was made for."""
    import asgi
    app = asgi.App(None, argparse.Namespace(threads=1), 1)

    def look_up():
        return {}['digit']  # the line named

    async def respond(scope, receive):
        return look_up()
    monkeypatch.setattr(app, 'respond', respond)
    sent = []

    async def send(message):
        sent.append(message)
    scope = {'type': 'http', 'method': 'POST', 'path': '/predict', 'raw_path': b'/predict', 'query_string': b'',
             'headers': [],
             'client': ('127.0.0.1', 50000)}
    asyncio.run(app(scope, None, send))
    assert sent[0]['status'] == 500
    assert json.loads(sent[1]['body']) == {'error': 'the server failed on this request (KeyError)'}
    where = f'test_serve.py:{look_up.__code__.co_firstlineno + 1}'
    log = capsys.readouterr().err
    assert re.fullmatch(rf"error: KeyError: 'digit' at {where}\nPOST /predict 500 \d+\.\d ms\n", log), log


def test_work_that_fails_after_its_deadline_leaves_no_error_in_the_log(monkeypatch, caplog):
    """asgi.App.run: a prediction begun, past --deadline (504), that then fails. Its error has no request left to
    go to; it is read and dropped, not logged by asyncio as an exception never retrieved (a traceback per request)."""
    import asgi
    begun = threading.Event()

    def fails_slowly(*args):
        begun.set()
        threading.Event().wait(2)  # still reading long after the deadline
        raise framing.Refused(400, 'the image cannot be decoded')
    monkeypatch.setattr(asgi.framing, 'answer', fails_slowly)
    # a second to begin: begun on any machine
    app = asgi.App(None, argparse.Namespace(threads=1, deadline=1, worker_timeout=30), 1)

    async def never_disconnects():
        await asyncio.Event().wait()

    async def request():
        with pytest.raises(framing.Refused) as refused:
            await app.run(bytes(asgi.QUICK_BYTES + 1), 'image/png', False, never_disconnects)
        assert begun.is_set() and refused.value.status == 504
        await asyncio.sleep(1.5)  # the work ends meanwhile, in error
    asyncio.run(request())
    gc.collect()  # where an unread error would be logged
    assert not [record for record in caplog.records if record.name == 'asyncio'], caplog.text


@pytest.mark.skipif(sys.platform == 'win32', reason='Gunicorn, whose hook this is, does not run on Windows')
def test_each_worker_is_forked_with_a_slot_of_its_own_and_a_replacement_reuses_a_freed_one(monkeypatch):
    """Gunicorn's pre_fork hook of serve.serve, called as Gunicorn's master calls it before each fork: the App the
    worker is forked with (a copy) holds the worker's slot of the shared counts, and a freed slot is reused, zeroed;
    once every slot is taken, the last one is shared."""
    import serve
    services = []

    class Master:  # Gunicorn's master, not run: its pre_fork hook is called below as it calls it
        def __init__(self, service):
            services.append(service)

        def run(self):
            pass
    monkeypatch.setattr(serve, 'Master', Master)
    monkeypatch.setattr(serve.torch, 'set_num_threads', lambda threads: None)  # this test process's torch: as it was
    args = argparse.Namespace(model='model.pth', host='127.0.0.1', port=0, workers=2, threads=1, timeout=30,
                              deadline=10, worker_timeout=30, grace=30)
    assert serve.serve(None, args) == 0
    pre_fork, app = services[0].options['pre_fork'], services[0].application
    arbiter, workers = argparse.Namespace(WORKERS={}), [argparse.Namespace() for _ in range(3)]
    for pid, worker in enumerate(workers[:2]):
        pre_fork(arbiter, worker)
        assert app.slot == worker.slot == pid  # what the forked worker's App holds
        arbiter.WORKERS[pid] = worker
    app.counts[0], app.held[0] = 1, 4  # left by the first worker, then killed
    del arbiter.WORKERS[0]
    pre_fork(arbiter, workers[2])
    assert app.slot == workers[2].slot == 0 and app.counts[0] == app.held[0] == 0
    arbiter.WORKERS = {pid: argparse.Namespace(slot=pid) for pid in range(len(app.counts))}  # 1024 added by TTIN
    pre_fork(arbiter, workers[0])  # one more: it shares the last slot (StopIteration would stop the service)
    assert workers[0].slot == app.slot == len(app.counts) - 1 and len(app.counts) == 2 + 1024


def test_the_default_workers_are_the_usable_cpus_and_one_on_windows(monkeypatch):
    import serve
    monkeypatch.setattr(serve.sys, 'argv', ['serve.py'])
    monkeypatch.setattr(serve.common, 'usable_cpus', lambda: 3)
    assert serve.parse_args().workers == 3
    monkeypatch.setattr(serve.sys, 'platform', 'win32')  # one process: no fork, no graceful stop of others
    assert serve.parse_args().workers == 1


SECONDS = 'float of at most 1,000,000,000'  # a timeout flag names its range


@pytest.mark.parametrize('flag, value, kind', [
    ('--workers', '0', 'int of at most 1,024'), ('--workers', '1025', 'int of at most 1,024'),
    ('--threads', '0', 'int'), ('--timeout', '0', SECONDS), ('--deadline', '-1', SECONDS), ('--grace', 'soon', SECONDS),
    ('--grace', 'inf', SECONDS), ('--timeout', '1e99', SECONDS),
    ('--worker-timeout', '1.5', 'int of at most 1,000,000,000'),
    ('--worker-timeout', '1000000001', 'int of at most 1,000,000,000')])
def test_a_flag_value_that_is_no_positive_number_is_named(monkeypatch, capsys, flag, value, kind):
    import serve
    monkeypatch.setattr(sys, 'argv', ['serve.py', flag, value])
    with pytest.raises(SystemExit) as stop:
        serve.parse_args()
    assert stop.value.code == 2
    assert capsys.readouterr().err.endswith(f'error: argument {flag}: must be a positive {kind}, got {value!r}\n')
