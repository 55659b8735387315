"""Serve a trained best_model.pth over HTTP: the document's last step, "deploy the trained model" (PAI-EAS).

Run command of an EAS service deployed from the training image, with the dataset mounted at /mnt/data:
  python /mnt/data/serve.py --host 0.0.0.0 --model /mnt/data/output/best_model.pth
On your own machine (after ./run_local.sh; or ./run_local.sh serve):
  python serve.py --model ./output/single/best_model.pth
  python serve.py --model ./output/single/best_model.pth --predict digit.png ...   (no server)

POST /predict with an image file as the body (PNG, JPEG, ...: any size, colour or grey) answers
{"digit": d, "probabilities": [p0, ..., p9]}; GET /health answers {"status": "ok", "model": path}.
The server has no authentication of its own: on EAS, its gateway checks the service token.
"""
import argparse
import io
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torchvision import transforms

try:
    import common
except ModuleNotFoundError as e:  # the script uploaded alone
    if e.name != 'common':
        raise
    sys.exit(f'error: common.py is missing: upload it beside {os.path.abspath(__file__)} (on DLC, to the same '
             f'folder of the dataset as the script).')

# The training data's preprocessing, as in the document
transform = transforms.Compose([
    transforms.ToTensor(),
    transforms.Normalize((0.5,), (0.5,))
])
MAX_BODY_BYTES = 10 * 1024 * 1024
MAX_PIXELS = 40_000_000  # about a 6000x6000 photo; larger images are refused before they are decoded
Image.MAX_IMAGE_PIXELS = MAX_PIXELS  # and Pillow refuses decompression bombs past twice this


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default='/mnt/data/output/best_model.pth',
                        help='best_model.pth of either training script (default: %(default)s)')
    parser.add_argument('--host', default='127.0.0.1',
                        help='address to listen on; 0.0.0.0 on EAS (default: %(default)s, this machine only)')
    parser.add_argument('--port', type=int, default=8000, help='port to listen on (default: %(default)s)')
    parser.add_argument('--timeout', type=common.positive(float), default=30,
                        help='seconds a client may take to send its request (default: %(default)s)')
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


class BadImage(Exception):
    """A request body that cannot be served; .status is the HTTP status to answer with."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def preprocess(data):
    """Image bytes -> [1, 1, 28, 28], exactly as the training data: grey, 28x28, light digit on dark."""
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
        if image.width * image.height > MAX_PIXELS:
            raise BadImage(413, f'the image has {image.width}x{image.height} pixels; at most {MAX_PIXELS} are served')
        if image.mode in ('RGBA', 'LA', 'PA') or 'transparency' in image.info:  # transparent: onto white paper
            image = Image.alpha_composite(Image.new('RGBA', image.size, 'white'), image.convert('RGBA'))
        image = image.convert('L')
    except Image.DecompressionBombError as e:
        raise BadImage(413, str(e)) from None
    except UnidentifiedImageError:
        raise BadImage(400, 'the body is not an image Pillow can read (PNG, JPEG, BMP, ...)') from None
    except (OSError, ValueError, SyntaxError) as e:  # a truncated or damaged image
        raise BadImage(400, f'the image cannot be decoded ({e})') from None
    if image.size != (28, 28):
        image = image.resize((28, 28), Image.BILINEAR)
    border = [image.getpixel((x, y)) for x in range(28) for y in (0, 27)] + \
             [image.getpixel((x, y)) for x in (0, 27) for y in range(1, 27)]
    if sum(border) / len(border) > 127:  # a dark digit on light paper: MNIST's digits are light on dark
        image = ImageOps.invert(image)
    return transform(image).unsqueeze(0)


def predict(model, batch):
    """Digits and probabilities for a batch of preprocessed images."""
    with torch.inference_mode():
        probabilities = torch.softmax(model(batch), dim=1)
    return probabilities.argmax(dim=1).tolist(), probabilities.tolist()


class Handler(BaseHTTPRequestHandler):
    """POST /predict and GET /health; every other request gets a JSON error with its status."""
    protocol_version = 'HTTP/1.1'  # keep-alive: a client sends many requests on one connection
    disable_nagle_algorithm = True  # headers and body go out at once, not 40 ms apart
    routes = {'/predict': 'POST', '/health': 'GET'}

    def do_GET(self):
        self.route()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_GET

    def route(self):
        path = self.path.split('?')[0]
        if path not in self.routes:
            return self.reply(404, {'error': f'no such path: {path}; POST /predict or GET /health'})
        if self.command != self.routes[path]:
            return self.reply(405, {'error': f'{path} takes {self.routes[path]}'}, Allow=self.routes[path])
        if path == '/health':
            return self.reply(200, {'status': 'ok', 'model': self.server.model_path})
        length = int(self.headers.get('Content-Length') or 0)
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # the body is left unread
            return self.reply(413, {'error': f'the body has {length} bytes; at most {MAX_BODY_BYTES} are served'})
        if length <= 0:
            return self.reply(400, {'error': 'send the image file as the request body'})
        try:
            data = self.rfile.read(length)
        except TimeoutError:
            self.close_connection = True
            return self.reply(408, {'error': f'the body did not arrive within {self.timeout:g}s'})
        try:
            batch = preprocess(data)
        except BadImage as e:
            return self.reply(e.status, {'error': str(e)})
        digits, probabilities = predict(self.server.model, batch)
        self.reply(200, {'digit': digits[0], 'probabilities': [round(p, 6) for p in probabilities[0]]})

    def reply(self, status, body, **headers):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(data)))
        for name, value in headers.items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header('Connection', 'close')
        self.end_headers()
        self.wfile.write(data)

    def parse_request(self):
        self.started = time.perf_counter()
        return super().parse_request()

    def log_request(self, code='-', size='-'):  # one line per request, with its time
        elapsed = (time.perf_counter() - getattr(self, 'started', time.perf_counter())) * 1000
        sys.stderr.write(f'{self.command} {self.path} {code} {elapsed:.1f} ms\n')

    def log_message(self, format, *args):  # http.server's own lines: the one above says it all
        pass


def main(args):
    model = load_model(args.model)
    if args.predict:
        failed = False
        for path in args.predict:
            try:
                with open(path, 'rb') as f:
                    digits, probabilities = predict(model, preprocess(f.read()))
                print(f'{path}: {digits[0]} ({max(probabilities[0]):.1%})')
            except (OSError, BadImage) as e:
                print(f'{path}: error: {e}', file=sys.stderr)
                failed = True
        return 1 if failed else 0
    torch.set_num_threads(1)  # a tiny model: one thread per request, the requests in parallel
    Handler.timeout = args.timeout  # a client that stalls mid-request does not hold its thread forever
    try:
        server = ThreadingHTTPServer((args.host, args.port), Handler)
    except OSError as e:
        raise common.SetupError(f'cannot listen on {args.host}:{args.port} ({e.strerror}); pass another '
                                f'--port, or stop what is using it.') from None
    server.daemon_threads = True
    server.handle_error = lambda request, address: sys.stderr.write(  # a client gone mid-reply: one line
        f'{address[0]}: {sys.exc_info()[0].__name__}: {sys.exc_info()[1]}\n')
    server.model, server.model_path = model, args.model
    print(f'Serving {args.model} on http://{args.host}:{server.server_port}: POST /predict, GET /health', flush=True)
    server.serve_forever()


if __name__ == '__main__':
    sys.stdout.reconfigure(line_buffering=True, write_through=False)
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # how EAS stops a service
    try:
        sys.exit(main(args))
    except common.SetupError as e:
        if args.debug:
            raise
        sys.exit(f'error: {e}')
    except KeyboardInterrupt:
        sys.exit(130)
