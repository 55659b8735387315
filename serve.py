"""Serve a trained best_model.pth over HTTP: the document's last step, "deploy the trained model" (PAI-EAS).

Run command of an EAS service deployed from the training image, with the dataset mounted at /mnt/data:
  pip install -r /mnt/data/requirements-serve.txt && python /mnt/data/serve.py --host 0.0.0.0 --model /mnt/data/output/best_model.pth
On your own machine (after ./run_local.sh; or ./run_local.sh serve):
  python serve.py --model ./output/single/best_model.pth
  python serve.py --model ./output/single/best_model.pth --predict digit.png ...   (no server)

POST /predict answers {"digit": d, "probabilities": [p0, ..., p9]} for one image (PNG, JPEG, ...: any
size, colour or grey), sent in any of these forms:
  the file as the body               curl --data-binary @digit.png http://127.0.0.1:8000/predict
  a form upload, any field name      curl -F file=@digit.png http://127.0.0.1:8000/predict
  JSON: base64, or a data: URL       curl -d '{"image": "iVBORw0KGgo..."}' http://127.0.0.1:8000/predict
Several images (several files in one form, or {"images": [...]}) answer {"predictions": [{"digit": d,
"probabilities": [...]}, ...]}, from one forward pass. GET /health answers {"status": "ok", "model": path}.
Every reply is JSON, errors too: {"error": "..."} with the HTTP status.

Limits: 10 MB a request, 16 images, 4096x4096 pixels an image (a JPEG may be larger: it is decoded at
reduced size); the whole request (headers and body) within --timeout seconds. On SIGTERM (how EAS stops
and rolls a service) or Ctrl-C it stops accepting, answers the requests it has, and exits 0.
The server (uvicorn) has no authentication of its own: on EAS, its gateway checks the service token.
"""
import argparse
import asyncio
import base64
import binascii
import concurrent.futures
import errno
import http
import io
import json
import os
import re
import signal
import socket
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from PIL import Image, ImageOps, UnidentifiedImageError
from torchvision import transforms

try:
    import common
except ModuleNotFoundError as e:  # the script uploaded alone
    if e.name != 'common':
        raise
    sys.exit(f'error: common.py is missing: upload it beside {os.path.abspath(__file__)} (on DLC, to the same '
             f'folder of the dataset as the script).')
try:
    import httptools
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ModuleNotFoundError as e:
    sys.exit(f'error: serve.py needs {e.name}: pip install -r {os.path.join(os.path.dirname(__file__), "requirements-serve.txt")}'
             f' (./run_local.sh serve installs it).')

# The training data's preprocessing, as in the document
transform = transforms.Compose([
    transforms.ToTensor(),
    transforms.Normalize((0.5,), (0.5,))
])
MAX_BODY_BYTES = 10 * 1024 * 1024
MAX_IMAGES = 16  # in one request
MAX_PIXELS = 4096 * 4096  # decoded at full size; a JPEG may have 16 times as many: it is decoded at 1/4-1/8 scale
WORK_SIDE = 1024  # a decoded image is reduced to about this many pixels a side before anything else
Image.MAX_IMAGE_PIXELS = 16 * MAX_PIXELS  # Pillow's own decompression-bomb check, past our limits
MAX_URL_BYTES, MAX_HEADER_BYTES = 8192, 16384
MNIST_BOX, MNIST_STROKE = 20, 2.9  # MNIST fitted its digits into 20x20; its strokes' median width
MIN_CONTRAST = 0.1  # of the ink against the paper, in 0-1: below it, no digit
NO_DIGIT = 'the image has no digit: it is blank or all of one colour (send a dark digit on light paper, or light on dark)'
MAX_WAITING = 256  # requests queued for the prediction threads; more get 503
FORMS = ('send the image file as the body (curl --data-binary @digit.png), as a form upload (curl -F '
         'file=@digit.png), or as JSON {"image": "<base64 or data: URL>"}')
ROUTES = {'/': ('GET', 'HEAD'), '/predict': ('POST',), '/health': ('GET', 'HEAD')}
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'page', 'index.html')  # GET /: try the model


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default='/mnt/data/output/best_model.pth',
                        help='best_model.pth of either training script (default: %(default)s)')
    parser.add_argument('--host', default='127.0.0.1',
                        help='address to listen on; 0.0.0.0 on EAS, :: for IPv6 (default: %(default)s, this machine '
                             'only)')
    parser.add_argument('--port', type=int, default=8000, help='port to listen on; 0 picks a free one (default: '
                                                               '%(default)s)')
    parser.add_argument('--timeout', type=common.positive(float), default=30,
                        help='seconds a client may take to send a whole request (default: %(default)s)')
    parser.add_argument('--threads', type=common.positive(int), default=len(os.sched_getaffinity(0)),
                        help='threads that decode images and run the model (default: the CPU cores, %(default)s)')
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
    """A request that cannot be served: .status is the HTTP status to answer with, .close drops the connection."""

    def __init__(self, status, message, close=False):
        super().__init__(message)
        self.status, self.close = status, close


def decode(data):
    """Image bytes -> a PIL image at most about WORK_SIDE pixels a side, decoded within bounded memory and CPU."""
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
        width, height = image.size
        limit = 16 * MAX_PIXELS if image.format == 'JPEG' else MAX_PIXELS
        if width * height > limit:
            raise Refused(413, f'the image has {width}x{height} pixels; at most {limit} are served')
        if image.format == 'JPEG':  # decoded at 1/2, 1/4 or 1/8 scale, still at least WORK_SIDE a side
            scale = max(1, max(width, height) // WORK_SIDE)
            image.draft(image.mode, (width // scale, height // scale))
        image.load()
        if image.getexif().get(0x0112, 1) != 1:  # a phone photo's orientation
            image = ImageOps.exif_transpose(image)
        if image.mode not in ('L', 'LA', 'RGB', 'RGBA'):  # palette, 1-bit, CMYK, 16-bit: what reduce() takes
            image = image.convert('RGBA' if 'transparency' in image.info or image.mode.endswith('A') else 'RGB')
        factor = max(image.size) // WORK_SIDE
        return image.reduce(factor) if factor > 1 else image
    except Image.DecompressionBombError as e:
        raise Refused(413, str(e)) from None
    except UnidentifiedImageError:
        raise Refused(400, f'the body is not an image Pillow can read (PNG, JPEG, BMP, ...); {FORMS}') from None
    except (OSError, ValueError, SyntaxError) as e:  # a truncated or damaged image
        raise Refused(400, f'the image cannot be decoded ({e})') from None


def preprocess(data):
    """Image bytes -> [1, 1, 28, 28] as MNIST framed its digits, then the document's transform.

    A 28x28 image is taken as MNIST's own format (an MNIST test image gives bit for bit the tensor the scripts
    validate on); any other is framed: the ink told from the paper, fitted into a 20x20 box keeping its aspect
    ratio, with its centre of mass at the centre of 28x28, light on dark."""
    image = decode(data)
    if image.size == (28, 28) and image.mode in ('L', 'RGB'):
        image = image.convert('L')
        border = [image.getpixel((x, y)) for x in range(28) for y in (0, 27)] + \
                 [image.getpixel((x, y)) for x in (0, 27) for y in range(1, 27)]
        if sum(border) / len(border) > 127:  # a dark digit on light paper: MNIST's digits are light on dark
            image = ImageOps.invert(image)
        low, high = image.getextrema()
        if high - low < 32:
            raise Refused(422, NO_DIGIT)
        return transform(image).unsqueeze(0)
    return transform(frame(*ink_of(image))).unsqueeze(0)


def ink_of(image):
    """The ink of a picture, light on dark whichever it was, as float tensors [H, W]: 0 on the paper, up to 1 at
    the strokes' cores; and the same averaged over 3x3 pixels, to tell ink from noise."""
    if image.mode in ('LA', 'RGBA'):
        alpha = image.getchannel('A')
        drawn = sum(alpha.histogram()[128:]) < alpha.width * alpha.height / 2
        low, high = alpha.getextrema()
        # Strokes on a transparent canvas, light or dark: the ink is where it is opaque. Otherwise onto white.
        image = alpha if high - low > 64 and drawn else \
            Image.alpha_composite(Image.new('RGBA', image.size, 'white'), image.convert('RGBA'))
    grey = image.convert('L')
    x = torch.frombuffer(bytearray(grey.tobytes()), dtype=torch.uint8).reshape(grey.height, grey.width)
    x = x.float().div(255)[None, None]
    smooth = F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)  # noise and JPEG speckle averaged
    ring = max(1, min(grey.size) // 16)
    paper = torch.cat([x[..., :ring, :].flatten(), x[..., -ring:, :].flatten(), x[..., :ring].flatten(),
                       x[..., -ring:].flatten()]).median()
    if paper - smooth.min() > smooth.max() - paper:  # the ink is darker than the paper: make it light on dark
        x, smooth = 1 - x, 1 - smooth
    # Uneven paper or light: the paper's level is the lowest nearby, over blocks wider than a stroke.
    block = max(1, max(grey.size) // 8)
    paper = -F.max_pool2d(-x, block, stride=block, ceil_mode=True)
    paper = -F.max_pool2d(-paper, 3, stride=1, padding=1)
    paper = F.interpolate(paper, size=x.shape[2:], mode='bilinear', align_corners=False)
    return (x - paper).clamp(min=0)[0, 0], (smooth - paper).clamp(min=0)[0, 0]


def stroke_width(solid):
    """The median width of a boolean image's strokes: at each ink pixel, the shorter of its runs of ink along
    its row and its column."""
    def runs(solid):
        height, width = solid.shape
        index = torch.arange(width).expand(height, width)
        before = torch.where(solid, -1, index).cummax(1).values  # the last background pixel at or before
        after = torch.where(solid, width, index).flip(1).cummin(1).values.flip(1)
        return after - before - 1
    return torch.minimum(runs(solid), runs(solid.T).T)[solid].float().median().item()


def frame(ink, smooth):
    """MNIST's framing of an ink map: a 28x28 'L' image of the digit, light on dark."""
    peak = smooth.max().item()
    if peak < MIN_CONTRAST:
        raise Refused(422, NO_DIGIT)
    threshold = 0.35 * peak
    mask = smooth > threshold
    rows, cols = mask.any(1).nonzero()[:, 0], mask.any(0).nonzero()[:, 0]
    top, bottom, left, right = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
    strokes = ink[top:bottom, left:right]
    core = max(strokes[mask[top:bottom, left:right]].quantile(0.9).item(), threshold)
    strokes = ((strokes - threshold / 2) / (core - threshold / 2)).clamp(0, 1)[None, None]
    # Strokes as thick, for the digit's size, as MNIST's: about 2.9 pixels in its 20-pixel box.
    height, width = strokes.shape[2:]
    scale = MNIST_BOX / max(height, width)
    thickness = stroke_width(strokes[0, 0] > 0.5) * scale
    radius = round((MNIST_STROKE - thickness) / 2 / scale)
    if thickness < 0.7 * MNIST_STROKE and radius > 0:  # a fine pen: broadened, the box grown to hold it
        strokes = F.max_pool2d(F.pad(strokes, [radius] * 4), 2 * radius + 1, stride=1, padding=radius)
        height, width = strokes.shape[2:]
        scale = MNIST_BOX / max(height, width)
    size = (max(1, round(height * scale)), max(1, round(width * scale)))
    digit = F.interpolate(strokes, size=size, mode='area' if scale < 1 else 'bilinear')[0, 0]
    digit = digit / digit.max()
    # Centre of mass at MNIST's (14, 14), in whole pixels as MNIST placed its digits.
    mass = digit.sum()
    y = round(14 - (digit.sum(1) * torch.arange(size[0])).sum().item() / mass.item())
    x = round(14 - (digit.sum(0) * torch.arange(size[1])).sum().item() / mass.item())
    canvas = torch.zeros(28 + 2 * MNIST_BOX, 28 + 2 * MNIST_BOX)  # room for any shift; cropped below
    canvas[MNIST_BOX + y:MNIST_BOX + y + size[0], MNIST_BOX + x:MNIST_BOX + x + size[1]] = digit
    pixels = canvas[MNIST_BOX:MNIST_BOX + 28, MNIST_BOX:MNIST_BOX + 28].mul(255).round().to(torch.uint8)
    return Image.frombytes('L', (28, 28), bytes(pixels.flatten().tolist()))


def predict(model, batch):
    """Digits and probabilities for a batch of preprocessed images."""
    with torch.inference_mode():
        probabilities = torch.softmax(model(batch), dim=1)
    return probabilities.argmax(dim=1).tolist(), probabilities.tolist()


def images_in(body, content_type):
    """The image files a request body carries, in any of the accepted forms, and whether several were asked for."""
    if content_type.split(';')[0].strip().lower() == 'multipart/form-data':
        boundary = re.search(r'boundary="?([^";]+)"?', content_type)
        parts = body.split(b'--' + boundary.group(1).encode()) if boundary else []
        files = []
        for part in parts[1:-1]:  # between the preamble and the closing delimiter
            head, _, content = part.partition(b'\r\n\r\n')
            head = head.lower()
            if (b'filename=' in head or b'content-type: image/' in head) and content[:-2]:
                files.append(content[:-2])  # less the CRLF before the next delimiter
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


def answer(model, body, content_type):
    """The JSON reply to a POST /predict body (on a prediction thread)."""
    images, several = images_in(body, content_type)
    if len(images) > MAX_IMAGES:
        raise Refused(413, f'the request holds {len(images)} images; at most {MAX_IMAGES} are served at once')
    batch = []
    for k, image in enumerate(images):
        try:
            batch.append(preprocess(image))
        except Refused as e:
            e.args = (f'image {k + 1} of {len(images)}: {e}',) if several else e.args
            raise
    digits, probabilities = predict(model, torch.cat(batch))
    replies = [{'digit': d, 'probabilities': [round(p, 6) for p in ps]} for d, ps in zip(digits, probabilities)]
    return {'predictions': replies} if several else replies[0]


def log_request(method, target, status, started):
    sys.stderr.write(f'{method} {target} {status} {(time.perf_counter() - started) * 1000:.1f} ms\n')


def json_response(status, body, close=False, **headers):
    """The status line, headers and body of a JSON reply, as bytes."""
    data = json.dumps(body).encode()
    lines = [f'HTTP/1.1 {status} {http.HTTPStatus(status).phrase}', 'content-type: application/json',
             f'content-length: {len(data)}'] + [f'{name}: {value}' for name, value in headers.items()]
    return '\r\n'.join(lines + ['connection: close'] * close + ['', '']).encode() + data


class App:
    """The ASGI application: routes and request forms; decoding and the model run on a fixed pool of threads."""

    def __init__(self, model, model_path, threads):
        self.model, self.model_path = model, model_path
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix='predict')
        self.waiting = self.in_progress = 0

    async def __call__(self, scope, receive, send):
        started = time.perf_counter()
        self.in_progress += 1
        try:
            status, body, headers = await self.respond(scope, receive)
        except Refused as e:
            status, body, headers = e.status, {'error': str(e)}, {'connection': 'close'} if e.close else {}
        except ConnectionError:  # the client went away before its request was whole
            return
        except Exception as e:  # a bug of ours: the client gets JSON, the log one line with where it happened
            where = traceback.extract_tb(e.__traceback__)[-1]
            sys.stderr.write(f'error: {type(e).__name__}: {e} at {os.path.basename(where.filename)}:{where.lineno}\n')
            status, body, headers = 500, {'error': f'the server failed on this request ({type(e).__name__})'}, {}
        finally:
            self.in_progress -= 1
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {'content-type': 'application/json', 'content-length': str(len(data)), **headers}
        await send({'type': 'http.response.start', 'status': status,
                    'headers': [(name.encode(), value.encode()) for name, value in headers.items()]})
        await send({'type': 'http.response.body', 'body': data})
        query = scope['query_string'].decode('latin-1')
        log_request(scope['method'], scope['path'] + ('?' + query if query else ''), status, started)

    async def respond(self, scope, receive):
        """(status, JSON body, headers) for one request."""
        path, method = scope['path'], scope['method']
        if path not in ROUTES:
            raise Refused(404, f'no such path: {path}; POST /predict, GET /health, or GET / for a page')
        allow = ', '.join(ROUTES[path] + ('OPTIONS',))
        if method == 'OPTIONS':
            return 200, {'allow': allow}, {'allow': allow}
        if method not in ROUTES[path]:
            return 405, {'error': f'{path} takes {ROUTES[path][0]}'}, {'allow': allow}
        if path == '/health':
            return 200, {'status': 'ok', 'model': self.model_path}, {}
        if path == '/':
            try:
                with open(PAGE, 'rb') as f:
                    return 200, f.read(), {'content-type': 'text/html; charset=utf-8'}
            except FileNotFoundError:
                raise Refused(404, 'the page is missing: upload page/index.html beside serve.py; POST /predict and '
                                   'GET /health work without it') from None
        headers = dict(scope['headers'])
        if b'content-length' not in headers and b'transfer-encoding' not in headers:
            raise Refused(411, f'the request has no Content-Length; {FORMS}')
        if int(headers.get(b'content-length', 0)) > MAX_BODY_BYTES:  # refused before its body is read
            raise Refused(413, f'the body has {int(headers[b"content-length"])} bytes; at most {MAX_BODY_BYTES} are '
                               f'served', close=True)
        body = await read_body(receive)
        if not body:
            raise Refused(400, f'the body is empty; {FORMS}')
        if self.waiting >= MAX_WAITING:
            return 503, {'error': f'{MAX_WAITING} requests are waiting already; try again shortly'}, {'retry-after': '1'}
        self.waiting += 1
        try:
            content_type = headers.get(b'content-type', b'').decode('latin-1')
            reply = await asyncio.get_running_loop().run_in_executor(self.pool, answer, self.model, body, content_type)
        finally:
            self.waiting -= 1
        return 200, reply, {}


async def read_body(receive):
    """The whole request body (sent with a Content-Length or chunked), at most MAX_BODY_BYTES."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message['type'] == 'http.disconnect':
            raise ConnectionResetError
        chunks.append(message.get('body', b''))
        size += len(chunks[-1])
        if size > MAX_BODY_BYTES:
            raise Refused(413, f'the body is over {MAX_BODY_BYTES} bytes; at most that many are served', close=True)
        if not message.get('more_body'):
            return b''.join(chunks)


class Protocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol, plus what a public service needs: one deadline for each whole request
    (headers and body), limits on the URL and headers, and a JSON reply to every malformed request."""
    timeout = 30

    def connection_made(self, transport):
        super().connection_made(transport)
        self.request_begun, self.refusal = False, None
        self.deadline = self.loop.call_later(self.timeout, self.time_out)  # a connection that sends nothing

    def connection_lost(self, exc):
        self.deadline.cancel()
        super().connection_lost(exc)

    def on_message_begin(self):
        super().on_message_begin()
        self.deadline.cancel()
        self.deadline = self.loop.call_later(self.timeout, self.time_out)
        self.request_begun, self.header_bytes, self.started = True, 0, time.perf_counter()

    def on_url(self, url):
        super().on_url(url)
        if len(self.url) > MAX_URL_BYTES:
            self.refuse(414, f'the URL is over {MAX_URL_BYTES} bytes')

    def on_header(self, name, value):
        super().on_header(name, value)
        self.header_bytes += len(name) + len(value) + 4
        if self.header_bytes > MAX_HEADER_BYTES:
            self.refuse(431, f'the headers are over {MAX_HEADER_BYTES} bytes')

    def on_message_complete(self):
        self.deadline.cancel()
        self.request_begun = False
        super().on_message_complete()

    def refuse(self, status, message):
        self.refusal = (status, message)
        raise ValueError(message)  # httptools stops parsing; data_received answers

    def data_received(self, data):
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.send_error(501, 'protocol upgrades (WebSocket, h2c) are not served')
        except httptools.HttpParserError as e:
            if isinstance(e, httptools.HttpParserInvalidMethodError):
                self.refusal = (501, 'the method is not served: POST /predict, GET /health')
            elif 'Transfer-Encoding' in str(e):
                self.refusal = (501, 'the Transfer-Encoding is not served: send the body as it is, or chunked')
            self.send_error(*(self.refusal or (400, f'the request is malformed: {e}')))

    def time_out(self):
        this_cycle = self.cycle is not None and self.cycle.scope is self.scope
        if self.request_begun and not (this_cycle and self.cycle.response_started):
            self.send_error(408, f'the request did not arrive whole within {self.timeout:g}s')
        elif not self.transport.is_closing():
            self.transport.close()

    def send_error(self, status, message):
        """Answer a request the application never sees, and close the connection (it cannot be read on)."""
        if not self.transport.is_closing():
            self.transport.write(json_response(status, {'error': message}, close=True))
            self.transport.close()
        url = self.url.decode('latin-1')[:200] if self.request_begun or self.refusal else '-'
        log_request('-', url or '-', status, getattr(self, 'started', time.perf_counter()))


class Server(uvicorn.Server):
    def handle_exit(self, sig, frame):
        if not self.should_exit:
            app = self.config.app
            print(f'Stopping on {signal.Signals(sig).name}: accepting no new connections, answering the requests in '
                  f'progress ({app.in_progress}) within {self.config.timeout_graceful_shutdown:g}s.', flush=True)
        super().handle_exit(sig, frame)


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


def main(args):
    model = load_model(args.model)
    if args.predict:
        failed = False
        for path in args.predict:
            try:
                with open(path, 'rb') as f:
                    digits, probabilities = predict(model, preprocess(f.read()))
                print(f'{path}: {digits[0]} ({max(probabilities[0]):.1%})')
            except (OSError, Refused) as e:
                print(f'{path}: error: {e}', file=sys.stderr)
                failed = True
        return 1 if failed else 0
    sock = listen(args.host, args.port)
    torch.set_num_threads(1)  # a tiny model: one torch thread per request, the requests on --threads threads
    Protocol.timeout = args.timeout
    app = App(model, args.model, args.threads)
    server = Server(uvicorn.Config(app, http=Protocol, ws='none', lifespan='off', log_level='warning',
                                   access_log=False, timeout_keep_alive=60, backlog=2048,
                                   timeout_graceful_shutdown=args.grace))
    host, port = sock.getsockname()[:2]
    print(f'Serving {args.model} on http://{f"[{host}]" if ":" in host else host}:{port} with {args.threads} '
          f'threads: POST /predict, GET /health, and a page to try it at /', flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn handles them, then raises them again: nothing more to do
        signal.signal(sig, signal.SIG_IGN)
    server.run(sockets=[sock])
    app.pool.shutdown()
    return 0


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
