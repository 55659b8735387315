"""serve.py behind PAI-EAS as its users call it: EAS's own Python SDK (eas-prediction) through a stand-in for EAS's
gateway, and POST / answering exactly as POST /predict."""
import base64
import contextlib
import hashlib
import hmac
import http.client
import http.server
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import uuid

import pytest
from torchvision import datasets

import framing
from conftest import ROOT, LineReader, free_port, script_env, serving
from test_serve import SERVE, encode, forward

pytestmark = pytest.mark.one_leg  # HTTP between EAS's SDK, its gateway and serve.py: the same on either torch

TOKEN = 'test-token'
RUN_COMMAND = re.compile(r'`(pip install -r /mnt/data/requirements-serve\.txt && [^`]*)`')  # the docs' EAS command
GATEWAY_MAX_BODY = 1024 * 1024  # EAS's gateway takes request bodies of at most 1 MB
# The SDK as its users run it: its client sends each request, prints the reply (or the error) as one JSON line.
CLIENT = '''
import json, sys
from eas_prediction import PredictClient, StringRequest, PredictException
gateway, service, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
client = PredictClient(gateway, service)
client.set_token(%r)
client.init()
for path in paths:
    try:
        reply = client.predict(StringRequest(open(path, 'rb').read()))
        print(json.dumps({'status': 200, 'reply': json.loads(reply.response_data)}))
    except PredictException as e:
        print(json.dumps({'status': e.code, 'reply': json.loads(e.message)}))
''' % TOKEN


class Gateway(http.server.ThreadingHTTPServer):
    """A stand-in for EAS's gateway in front of a service on port `port`: it checks the token (sent as is, or as
    the SDK's signature; token None: no check, as a browser extension adding the header would pass), refuses
    bodies over 1 MB, and forwards /api/predict/<service>[/PATH] to the service's /PATH (its root where there is
    none). .forwarded lists (method, path, body size) of each request it forwarded."""

    def __init__(self, service, port, token=TOKEN):
        gateway, self.forwarded = self, []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.forward(b'')

            def do_POST(self):
                self.forward(self.rfile.read(int(self.headers.get('Content-Length', 0))))

            def forward(self, body):
                prefix = f'/api/predict/{service}'
                if self.path != prefix and not self.path.startswith((prefix + '/', prefix + '?')):
                    return self.reply(404, b'no such service')
                if token is not None and not authorised(self.headers, body, self.path.split('?')[0], token):
                    return self.reply(401, b'unauthorized')
                if len(body) > GATEWAY_MAX_BODY:
                    return self.reply(413, b'request entity too large')
                path = '/' + self.path[len(prefix):].lstrip('/')
                gateway.forwarded.append((self.command, path, len(body)))
                connection = http.client.HTTPConnection('127.0.0.1', port, timeout=60)
                headers = {'Content-Type': self.headers['Content-Type']} if self.headers['Content-Type'] else {}
                connection.request(self.command, path, body if self.command == 'POST' else None, headers)
                response = connection.getresponse()
                self.reply(response.status, response.read(), response.getheader('Content-Type'))

            def reply(self, status, data, content_type='text/plain'):
                self.send_response(status)
                self.send_header('Content-Type', content_type)
                self.send_header('Content-Length', str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass
        super().__init__(('127.0.0.1', 0), Handler)
        self.daemon_threads = True
        self.url = f'http://127.0.0.1:{self.server_port}'
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self):
        self.shutdown()
        self.server_close()


def authorised(headers, body, resource, token):
    """The token as is (curl -H 'Authorization: <token>'), or the SDK's HMAC of the request under it."""
    authorization = headers.get('Authorization', '')
    if authorization == token:
        return True
    signed = '\n'.join(['POST', hashlib.md5(body).hexdigest(), headers.get('Content-Type', ''),
                        headers.get('Date', ''), resource])
    digest = hmac.new(token.encode(), signed.encode(), hashlib.sha1).digest()
    return authorization == 'EAS ' + base64.b64encode(digest).decode()


@pytest.fixture(scope='module')
def sdk(tmp_path_factory):
    """A folder holding eas-prediction and what it needs (an old protobuf, so not in the test environment)."""
    folder = tmp_path_factory.mktemp('eas_sdk')
    result = subprocess.run([sys.executable, '-m', 'pip', 'install', '--quiet', '--disable-pip-version-check',
                             '--target', str(folder), 'eas-prediction>=0.30'], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f'eas-prediction could not be installed (no package index?): {result.stderr.strip()[-300:]}')
    return folder


@pytest.fixture(scope='module')
def service(model_file):
    port = free_port()
    with serving([sys.executable, ROOT / 'serve.py', '--model', model_file, '--port', str(port), '--workers', '1']):
        yield port


def ask_with_sdk(sdk, gateway, service_name, paths):
    result = subprocess.run([sys.executable, '-c', CLIENT, gateway.url, service_name, *map(str, paths)],
                            env=script_env(PYTHONPATH=str(sdk)), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.parametrize('service_name, path', [('mnist', '/'), ('mnist/predict', '/predict')])
def test_eas_sdk_through_the_gateway_at_the_root_and_at_predict(sdk, service, model_file, mnist_dir, tmp_path,
                                                                 service_name, path):
    images = datasets.MNIST(root=mnist_dir, train=False).data[:5].numpy()
    files = []
    for k, image in enumerate(images):
        files.append(tmp_path / f'{k}.png')
        files[-1].write_bytes(encode(image))
    (tmp_path / 'notes.txt').write_text('not an image')
    gateway = Gateway('mnist', service)
    try:
        replies = ask_with_sdk(sdk, gateway, service_name, [*files, tmp_path / 'notes.txt'])
    finally:
        gateway.close()
    expected = forward(model_file, framing.to_tensor(encode(images[0])))[0]
    assert replies[0]['status'] == 200 and replies[0]['reply']['digit'] == expected.argmax().item()
    assert replies[0]['reply']['probabilities'] == pytest.approx(expected.tolist(), abs=1e-6)
    for reply, image in zip(replies[1:5], images[1:]):
        assert reply['reply']['digit'] == forward(model_file, framing.to_tensor(encode(image)))[0].argmax().item()
    assert replies[5] == {'status': 400, 'reply': {'error': replies[5]['reply']['error']}}
    assert 'not an image in a format served' in replies[5]['reply']['error']
    assert [path for _, path, _ in gateway.forwarded] == [path] * 6  # a 400 is not retried (the SDK retries only 5xx)


def test_post_to_the_root_answers_as_predict_does(service, mnist_dir):
    image = encode(datasets.MNIST(root=mnist_dir, train=False).data[7].numpy())
    boundary = uuid.uuid4().hex
    form = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="d.png"\r\n'
            f'Content-Type: image/png\r\n\r\n').encode() + image + f'\r\n--{boundary}--\r\n'.encode()
    bodies = [(image, 'application/octet-stream'), (form, f'multipart/form-data; boundary={boundary}'),
              (json.dumps({'image': base64.b64encode(image).decode()}).encode(), 'application/json'),
              (json.dumps({'images': [base64.b64encode(image).decode()] * 2}).encode(), 'application/json'),
              (b'not an image', 'application/octet-stream')]
    for body, content_type in bodies:
        replies = []
        for path in ('/', '/predict', '/?framed=1', '/predict?framed=1'):
            connection = http.client.HTTPConnection('127.0.0.1', service, timeout=30)
            connection.request('POST', path, body, {'Content-Type': content_type})
            response = connection.getresponse()
            replies.append((response.status, json.loads(response.read())))
        assert replies[0] == replies[1] and replies[2] == replies[3], (content_type, replies)
    assert replies[0][0] == 400
    connection = http.client.HTTPConnection('127.0.0.1', service, timeout=30)
    connection.request('GET', '/')
    response = connection.getresponse()
    assert response.status == 200 and response.getheader('Content-Type') == 'text/html; charset=utf-8'
    assert response.read() == (ROOT / 'page' / 'index.html').read_bytes()  # the page as it is
    connection.request('PUT', '/', b'x')
    response = connection.getresponse()
    assert response.status == 405 and json.loads(response.read()) == {'error': '/ takes GET or POST'}


@pytest.mark.skipif(sys.platform == 'win32', reason='a POSIX shell runs the command')
def test_the_documented_run_command_stops_gracefully_when_its_process_gets_sigterm(model_file):
    """EAS runs the run command (it has an &&) in a shell and stops the service with SIGTERM to the process it
    started: the command execs serve.py, so that process is serve.py and stops gracefully, not the shell."""
    docs = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]
    commands = {command for doc in docs for command in RUN_COMMAND.findall(doc.read_text(encoding='utf-8'))}
    assert len(commands) == 1, commands  # the same command in every doc
    port = free_port()
    command = (commands.pop().replace('pip install -r /mnt/data/requirements-serve.txt', 'true')  # installed here
               .replace('python /mnt/data/serve.py', f'{shlex.quote(sys.executable)} {shlex.quote(str(SERVE))}')
               .replace('/mnt/data/output/best_model.pth', shlex.quote(str(model_file)))
               .replace('--host 0.0.0.0', f'--host 127.0.0.1 --port {port}'))
    proc = subprocess.Popen(['/bin/sh', '-c', command], cwd=ROOT, env=script_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    reader = LineReader(proc)
    try:
        reader.wait_for(lambda line: line.startswith('Serving'), timeout=60)
        proc.terminate()
        reader.wait_for(lambda line: line.startswith('Stopping on SIGTERM'), timeout=30)
        assert proc.wait(timeout=60) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a serve.py that a shell left running
