"""Accuracy of serve.py on real MNIST test digits sent the ways people send digits, beside plain 28x28 PNGs.

    python tests/bench_digits.py --model best_model.pth --data-dir DIR [--count 1000] [--start 0] [--baseline REV]
    (or: ./run_local.sh bench-digits --model ... --data-dir ...)

Renders --count MNIST test digits from --start (from --data-dir, torchvision layout) in each of these
kinds, sends every image to a real serve.py over HTTP, and prints the share answered correctly:
  plain        the 28x28 image as in the data set (PNG)
  photo        dark ink on grey, unevenly lit paper, small in a 1280x960 frame, noise, blur (JPEG)
  canvas       drawn large, dark on a white 280x280 canvas (PNG)
  thick        the same drawn with a broad pen, 35 pixels (as broad as MNIST's broadest 5% of strokes)
  thicker      with a broader one, 45 pixels: loops close, a hard case
  thin         with a fine pen, 5 pixels
  off-centre   light on dark, off-centre in a larger frame (PNG)
  exif         the photo stored on its side, with the EXIF orientation that turns it upright (JPEG)
  transparent  light strokes, and dark strokes, on a transparent canvas (PNG)
  phone        the photo at a phone camera's 12 MP, 4000x3000 (JPEG, about 0.7 MB: an upscale, without grain)
  phone-page   that photo as the page uploads it under EAS's 1 MB cap: reduced to 1024 pixels a side (JPEG)
With --baseline REV, the serve.py of that git revision is measured too, for comparison.
Not part of the test suite (it needs the real MNIST files and a trained model).
"""
import argparse
import concurrent.futures
import http.client
import io
import json
import os
import random
import tempfile

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageOps

from bench_serve import ROOT, Server, baseline_serve, check_mnist  # beside this file


def encode(image, fmt='PNG', **options):
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def pen(digit, size, width=None):
    """The digit drawn at size x size, 0 to 1: with the strokes as MNIST has them, or with a round pen of width
    pixels drawn along their middle lines (MNIST's own strokes are about size / 10 wide)."""
    big = digit.resize((size, size), Image.BILINEAR)
    ink = np.clip((np.asarray(big, dtype=np.float32) / 255 - 0.25) / 0.5, 0, 1)  # solid, soft edges: not a scan
    if width:
        lines = Image.new('L', (size, size))
        draw, r = ImageDraw.Draw(lines), (width - 1) / 2
        for y, x in zip(*np.nonzero(thin(ink > 0.5))):  # round, as the page's pen (a square one is 1.4x on diagonals)
            draw.ellipse([x - r, y - r, x + r, y + r], fill=255)
        ink = np.asarray(lines.filter(ImageFilter.GaussianBlur(0.7)), dtype=np.float32) / 255
    return ink


def thin(solid):
    """Zhang and Suen's thinning: the one-pixel middle lines of a boolean image's strokes."""
    solid = np.pad(solid, 1).astype(np.uint8)
    while True:
        changed = False
        for step in (0, 1):
            p = [np.roll(solid, shift, axis=(0, 1)) for shift in
                 ((1, 0), (1, -1), (0, -1), (-1, -1), (-1, 0), (-1, 1), (0, 1), (1, 1))]  # P2..P9, clockwise
            count = sum(p)
            turns = sum((p[k] == 0) & (p[(k + 1) % 8] == 1) for k in range(8))
            if step == 0:
                ends = (p[0] * p[2] * p[4] == 0) & (p[2] * p[4] * p[6] == 0)
            else:
                ends = (p[0] * p[2] * p[6] == 0) & (p[0] * p[4] * p[6] == 0)
            remove = (solid == 1) & (count >= 2) & (count <= 6) & (turns == 1) & ends
            if remove.any():
                solid[remove], changed = 0, True
        if not changed:
            return solid[1:-1, 1:-1].astype(bool)


def photo(digit, rng):
    """Dark ink on grey, unevenly lit paper, small in a large frame: an RGB image."""
    height = rng.randint(70, 160)
    ink = pen(digit, height)
    frame = np.zeros((960, 1280), np.float32)
    ys, xs = np.mgrid[0:960, 0:1280]
    angle = rng.uniform(0, 2 * np.pi)
    frame[:] = rng.uniform(170, 215) + 30 * ((np.cos(angle) * xs + np.sin(angle) * ys) / 1280)
    top, left = rng.randint(100, 960 - height - 100), rng.randint(100, 1280 - height - 100)
    paper = frame[top:top + height, left:left + height]
    frame[top:top + height, left:left + height] = paper * (1 - ink) + rng.uniform(25, 80) * ink
    frame += np.random.default_rng(rng.randint(0, 2**31)).normal(0, 6, frame.shape)
    grey = Image.fromarray(np.clip(frame, 0, 255).astype(np.uint8)).filter(ImageFilter.GaussianBlur(1))
    return Image.merge('RGB', (grey.point(lambda v: min(255, v + 6)), grey, grey.point(lambda v: max(0, v - 12))))


def on_canvas(ink, dark=True):
    return Image.fromarray(((1 - ink if dark else ink) * 255).astype(np.uint8))


def as_the_page_sends(data, side=1024):
    """A picture as page/index.html uploads one over 1 MB or 1024 pixels a side: upright, reduced to 1024 pixels
    a side (side: another size, to compare) with a smooth filter, a JPEG of quality 0.92."""
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    image.thumbnail((side, side), Image.BICUBIC)
    return encode(image.convert('RGB'), 'JPEG', quality=92)


def kinds(digit, rng, phone=False, page_side=1024):
    """{kind: [image bytes, ...]} for one MNIST digit (a 28x28 'L' image, light on dark); phone: the phone kinds
    too (slow to make)."""
    picture = photo(digit, rng)
    taken = encode(picture.resize((4000, 3000), Image.BICUBIC), 'JPEG', quality=90) if phone else None
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: turn 90 degrees clockwise to view
    frame = Image.new('L', (rng.randint(48, 84), rng.randint(48, 84)))
    frame.paste(digit, (rng.randint(0, frame.width - 28), rng.randint(0, frame.height - 28)))
    ink = pen(digit, 280)
    alpha = Image.fromarray((ink * 255).astype(np.uint8))
    return {
        'plain': [encode(digit)],
        'photo': [encode(picture, 'JPEG', quality=75)],
        'canvas': [encode(on_canvas(ink))],
        'thick': [encode(on_canvas(pen(digit, 280, 35)))],
        'thicker': [encode(on_canvas(pen(digit, 280, 45)))],
        'thin': [encode(on_canvas(pen(digit, 280, 5)))],
        'off-centre': [encode(frame)],
        'exif': [encode(picture.rotate(90, expand=True), 'JPEG', quality=75, exif=exif)],
        'transparent': [encode(Image.merge('RGBA', [Image.new('L', alpha.size, 255)] * 3 + [alpha])),
                        encode(Image.merge('RGBA', [Image.new('L', alpha.size, 0)] * 3 + [alpha]))],
        **({'phone': [taken], 'phone-page': [as_the_page_sends(taken, page_side)]} if phone else {}),
    }


def digit_of(port, body):
    connection = http.client.HTTPConnection('127.0.0.1', port, timeout=60)
    connection.request('POST', '/predict', body=body)
    response = connection.getresponse()
    reply = json.loads(response.read())
    return reply.get('digit') if response.status == 200 else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', required=True, help='best_model.pth written by the training scripts')
    parser.add_argument('--data-dir', required=True, help='torchvision root holding MNIST/raw')
    parser.add_argument('--count', type=int, default=1000, help='test digits to render (default: 1000)')
    parser.add_argument('--start', type=int, default=0, help='index of the first of them (default: 0)')
    parser.add_argument('--baseline', metavar='REV', help='also measure the serve.py of this git revision')
    parser.add_argument('--kinds', nargs='+', metavar='KIND',
                        help='only these kinds (default: all but the phone kinds, slow to make)')
    parser.add_argument('--page-side', type=int, default=1024,
                        help='pixels a side of phone-page, the page reduces to 1024 (default: %(default)s)')
    parser.add_argument('--save', metavar='DIR', help='also write the first digit of each kind there, to look at')
    args = parser.parse_args()
    from torchvision import datasets
    check_mnist(args.data_dir)
    test_set = datasets.MNIST(root=args.data_dir, train=False)
    rng = random.Random(0)
    phone = any(kind.startswith('phone') for kind in args.kinds or [])
    samples = [(kinds(Image.fromarray(test_set.data[i].numpy()), rng, phone, args.page_side), int(test_set.targets[i]))
               for i in range(args.start, args.start + args.count)]
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        for kind, bodies in samples[0][0].items():
            for k, body in enumerate(bodies):
                extension = 'jpg' if body.startswith(b'\xff\xd8') else 'png'
                with open(os.path.join(args.save, f'{kind}-{k}.{extension}'), 'wb') as f:
                    f.write(body)
    scripts = {'serve.py': os.path.join(ROOT, 'serve.py')}
    if args.baseline:
        scripts[f'at {args.baseline}'] = baseline_serve(args.baseline)
    names = args.kinds or list(samples[0][0])
    print(f'{args.count} MNIST test digits from #{args.start}, model {args.model}')
    print(f'{"kind":12s} ' + ' '.join(f'{name:>12s}' for name in scripts))
    results = {}
    for name, script in scripts.items():
        log = open(os.path.join(tempfile.gettempdir(), 'bench_digits_server.log'), 'w+b')  # its errors, if any
        server = Server(script, args.model, stderr=log)
        try:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                for kind in names:
                    jobs = [(pool.submit(digit_of, server.port, body), label) for sample, label in samples
                            for body in sample[kind]]
                    results[name, kind] = sum(job.result() == label for job, label in jobs) / len(jobs)
        finally:
            server.close()
            log.close()
    for kind in names:
        print(f'{kind:12s} ' + ' '.join(f'{results[name, kind]:12.1%}' for name in scripts))


if __name__ == '__main__':
    main()
