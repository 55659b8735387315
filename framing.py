"""Any picture of a digit framed as MNIST framed its digits, for the model the training scripts train.

MNIST's digits were fitted into a 20x20 box keeping their aspect ratio, then placed with their centre
of mass at the centre of a 28x28 image, light on dark. This module does the same to a photo, a
drawing or a scan, and applies the document's transform:

    import framing
    framing.to_mnist(open('digit.jpg', 'rb').read())   # the 28x28 'L' image the model reads
    framing.to_tensor(pil_image)                        # [1, 1, 28, 28], as the training data

Bytes (PNG, JPEG, GIF, BMP, WebP, TIFF, PPM, AVIF) or a PIL image go in. A 28x28 image is taken as
MNIST's own format (only inverted if dark on light): an MNIST test image gives bit for bit the tensor
the scripts validate on. Errors: NotAnImage, Damaged and TooLarge (all ValueErrors), and NoDigit for a
blank picture. The cost is bounded whatever the size: the digit is found on a copy at most WORK_SIDE
pixels a side, and read from a crop around it reduced to the same size.

Its last part is the model's side of serving, without a server (serve.py runs it on Gunicorn and uvicorn;
any other server can too): load_model, images_in (the images a request body carries: the file itself, a
form, JSON), answer (the JSON reply for them), and Refused, a request that cannot be served, with its
HTTP status.
"""
import base64
import binascii
import io
import json
import math
import os
import re

import torch
import torch.nn.functional as F
from PIL import Image, ImageOps, UnidentifiedImageError

import common

# The picture formats read; not the rest of Pillow's: EPS would run Ghostscript on a request's bytes where it is
# installed (able to write files), and each other parser is more code facing the internet
FORMATS = ('PNG', 'JPEG', 'GIF', 'BMP', 'WEBP', 'TIFF', 'PPM', 'AVIF')
MAX_PIXELS = 4096 * 4096  # decoded at full size; a JPEG of one scan may have 16 times as many: decoded at 1/2-1/8
JPEG_SIDE = 1024  # a large JPEG is decoded at reduced scale, any large picture averaged, to at least this a side
WORK_SIDE = 320  # larger pictures are read from a reduced copy and a reduced crop around the digit
Image.MAX_IMAGE_PIXELS = 16 * MAX_PIXELS  # Pillow's own decompression-bomb check, past our limits
MAX_SCANS = 100  # of a JPEG (a progressive one has about 10): each walks all its blocks, 40 bytes of it 1 ms
SCAN_END = re.compile(rb'\xff[^\x00\xd0-\xd7]')  # a marker: not a stuffed 0xFF nor a restart marker
MNIST_BOX, MNIST_STROKE = 20, 2.9  # MNIST fitted its digits into 20x20; its strokes' median width
MIN_CONTRAST = 0.1  # of the ink against the paper, in 0-1: below it, no digit


class NotAnImage(ValueError):
    """Bytes in none of the FORMATS."""


class Damaged(ValueError):
    """An image that cannot be decoded: truncated or corrupt."""


class TooLarge(ValueError):
    """An image with more pixels than MAX_PIXELS (16 times that: a JPEG of one sequential scan), or a JPEG of over
    MAX_SCANS scans."""


class NoDigit(ValueError):
    """A picture with no ink: blank, or all of one colour."""

    def __init__(self):
        super().__init__('the image has no digit: it is blank or all of one colour (send a dark digit on light '
                         'paper, or light on dark)')


def decode(data):
    """Image bytes -> a PIL image upright, in 'L', 'LA', 'RGB' or 'RGBA', decoded within bounded memory."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
        width, height = image.size
        jpeg = image.format in ('JPEG', 'MPO')  # MPO: a camera's JPEG with a second picture (a preview, a gain map)
        scans, streamed = jpeg_scans(bytes(data)) if jpeg else (0, False)
        limit = 16 * MAX_PIXELS if streamed else MAX_PIXELS  # a progressive JPEG, held whole: as any other image
        # a TIFF's tile width and length: libtiff allocates a whole tile at once, whatever the image's size
        tile = [image.tag_v2.get(tag, 0) for tag in (322, 323)] if image.format == 'TIFF' else [0, 0]
        if width * height <= limit and scans <= MAX_SCANS and math.prod(tile) <= MAX_PIXELS:
            if jpeg:  # decoded at 1/2, 1/4 or 1/8 scale, still at least JPEG_SIDE a side
                scale = max(1, max(width, height) // JPEG_SIDE)
                image.draft(image.mode, (width // scale, height // scale))
            image.load()
    except Image.DecompressionBombError as e:
        raise TooLarge(str(e)) from None
    except UnidentifiedImageError:
        raise NotAnImage('not an image in a format served (PNG, JPEG, GIF, BMP, WebP, TIFF, PPM or AVIF)') from None
    except (OSError, ValueError, SyntaxError, RuntimeError) as e:  # truncated or damaged (RuntimeError: AVIF)
        raise Damaged(f'the image cannot be decoded ({e})') from None
    if width * height > limit:
        kind = ' in a progressive JPEG (16 times as many in a baseline one, as cameras write)' if jpeg else ''
        raise TooLarge(f'the image has {width}x{height} pixels; at most {limit} are served{kind}')
    if math.prod(tile) > MAX_PIXELS:
        raise TooLarge(f'the TIFF has tiles of {tile[0]}x{tile[1]} pixels; at most {MAX_PIXELS} are read at once')
    if scans > MAX_SCANS:
        raise TooLarge(f'the JPEG has over {MAX_SCANS} scans; at most that many are read (a progressive one has '
                       f'about 10)')
    return upright(image)


def jpeg_scans(data):
    """(The scans of a JPEG's image up to MAX_SCANS + 1, whether libjpeg decodes it as it streams in), read from its
    segments as libjpeg walks them: a thumbnail in its EXIF and a second picture after its end are not counted. It
    streams with one sequential scan of all its components; otherwise libjpeg holds all the image's coefficients."""
    scans, k, frame, components, streamed = 0, 2, None, None, False
    while scans <= MAX_SCANS and (k := data.find(b'\xff', k)) >= 0 and k + 1 < len(data):  # other bytes: skipped
        marker = data[k + 1]
        if marker == 0xD9:  # the end of the image
            break
        if marker in (0x00, 0x01, 0xFF) or 0xD0 <= marker <= 0xD7:  # a fill byte or a marker without a length
            k += 1 if marker == 0xFF else 2
            continue
        if marker in (0xC0, 0xC1, 0xC2):  # a frame header: baseline, extended or progressive (others: not streamed)
            frame, components = marker, data[k + 9:k + 10]
        segment, k = k, k + 2 + int.from_bytes(data[k + 2:k + 4], 'big')
        if marker == 0xDA:  # a scan, whose data runs to the next marker
            scans += 1
            streamed = scans == 1 and frame in (0xC0, 0xC1) and data[segment + 4:segment + 5] == components
            end = SCAN_END.search(data, k)
            k = end.start() if end else len(data)
    return scans, streamed


def upright(image):
    """A phone photo's EXIF orientation applied, and the modes other than L, LA, RGB, RGBA converted."""
    if image.getexif().get(0x0112, 1) != 1:
        image = ImageOps.exif_transpose(image)
    if image.mode.startswith('I'):  # 16-bit grey (a scanner's PNG or TIFF): 0-65535 to 0-255, not clipped at 255
        image = image.convert('I').point(lambda level: level / 257).convert('L')
    if image.mode not in ('L', 'LA', 'RGB', 'RGBA'):  # palette, 1-bit, CMYK
        image = image.convert('RGBA' if 'transparency' in image.info or image.mode.endswith('A') else 'RGB')
    return image


def to_tensor(picture):
    """Image bytes or a PIL image -> the model's input, [1, 1, 28, 28]."""
    return mnist_tensor(to_mnist(picture))


def mnist_tensor(image):
    """A 28x28 'L' image -> [1, 1, 28, 28]: the document's transform, bit for bit (ToTensor divides by 255,
    Normalize subtracts 0.5 and divides by 0.5, in float32), without its per-call conversions."""
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(1, 1, 28, 28)
    return pixels.float().div(255).sub(0.5).div(0.5)


def to_mnist(picture):
    """Image bytes or a PIL image -> the digit as MNIST framed its digits: a 28x28 'L' image, light on dark."""
    image = decode(picture) if isinstance(picture, (bytes, bytearray, memoryview)) else upright(picture)
    if image.size == (28, 28) and image.mode in ('L', 'RGB'):
        image = image.convert('L')
        data = image.tobytes()
        border = data[:28] + data[-28:] + data[28:-28:28] + data[55:-28:28]  # rows 0 and 27, columns 0 and 27
        if sum(border) / len(border) > 127:  # a dark digit on light paper: MNIST's digits are light on dark
            image = ImageOps.invert(image)
        low, high = image.getextrema()
        if high - low < 32:
            raise NoDigit
        return image
    factor = max(image.size) // JPEG_SIDE  # a picture of 2048 or more pixels a side: averaged to 1024-2047 first
    if factor > 1 and image.mode in ('LA', 'RGBA'):  # grey and opacity apart: Pillow averages RGBA slowly
        image = Image.merge('LA', (image.convert('L').reduce(factor), image.getchannel('A').reduce(factor)))
    elif factor > 1:
        image = image.reduce(factor)
    grey = ink_layer(image)
    if max(grey.size) > WORK_SIDE:
        grey = around_the_digit(grey)
    return frame(*ink_of(pixels(grey)))


def ink_layer(image):
    """An 'L' image of the picture: strokes on a transparent canvas are read from their opacity, light or dark;
    other transparent pictures are put on white."""
    if image.mode in ('LA', 'RGBA'):
        alpha = image.getchannel('A')
        low, high = alpha.getextrema()
        if low == 255:  # opaque throughout: on white it is itself
            return image.convert('L')
        drawn = sum(alpha.histogram()[128:]) < alpha.width * alpha.height / 2
        image = alpha if high - low > 64 and drawn else \
            Image.alpha_composite(Image.new('RGBA', image.size, 'white'), image.convert('RGBA'))
    return image.convert('L')


def pixels(grey):
    """An 'L' image as a float tensor [1, 1, H, W] in 0-1."""
    x = torch.frombuffer(bytearray(grey.tobytes()), dtype=torch.uint8).reshape(grey.height, grey.width)
    return x.float().div(255)[None, None]


def around_the_digit(grey):
    """A large 'L' picture -> a crop around its digit, reduced to at most about WORK_SIDE pixels a side.

    Both reductions keep the ink's darkest (or lightest) pixel of each block, so a fine pen's strokes stay
    whole: the digit is found on a reduced copy of the whole picture, then read from a crop of the original."""
    x = torch.frombuffer(bytearray(grey.tobytes()), dtype=torch.uint8).reshape(grey.height, grey.width)
    dark = ink_is_dark(pixels(grey.reduce(max(1, max(grey.size) // WORK_SIDE))))
    factor = math.ceil(max(grey.size) / WORK_SIDE)
    survey = ink_of(keep_ink(x, factor, dark).float().div(255)[None, None], dark)[1]
    mask = survey > 0.35 * survey.max()
    if survey.max() < MIN_CONTRAST:
        raise NoDigit
    rows, cols = mask.any(1).nonzero()[:, 0], mask.any(0).nonzero()[:, 0]
    top, bottom, left, right = (rows[0].item() * factor, (rows[-1].item() + 1) * factor,
                                cols[0].item() * factor, (cols[-1].item() + 1) * factor)
    margin = max(bottom - top, right - left) // 4 + factor  # paper around the digit, for its level
    top, left = max(0, top - margin), max(0, left - margin)
    crop = x[top:bottom + margin, left:right + margin]
    crop = keep_ink(crop, math.ceil(max(crop.shape) / WORK_SIDE), dark)
    return Image.frombytes('L', (crop.shape[1], crop.shape[0]), crop.contiguous().numpy().tobytes())


def keep_ink(x, factor, dark):
    """A uint8 image [H, W] reduced by factor, each block to its darkest pixel (dark ink) or its lightest; a side
    shorter than a block is one block, and the last pixels of a side that blocks do not fill are left out."""
    if factor == 1:
        return x
    (rows, height), (cols, width) = [(max(1, n // factor), min(n, factor)) for n in x.shape]
    blocks = x[:rows * height, :cols * width].reshape(rows, height, cols, width)
    return blocks.amin(dim=(1, 3)) if dark else blocks.amax(dim=(1, 3))


def ink_is_dark(x):
    """Whether a picture's ink [1, 1, H, W] is darker than its paper (the paper: the median of its border)."""
    smooth = F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)
    ring = max(1, min(x.shape[2:]) // 16)
    paper = torch.cat([x[..., :ring, :].flatten(), x[..., -ring:, :].flatten(), x[..., :ring].flatten(),
                       x[..., -ring:].flatten()]).median()
    return bool(paper - smooth.min() > smooth.max() - paper)


def ink_of(x, dark=None):
    """The ink of a picture [1, 1, H, W], light on dark whichever it was, as float tensors [H, W]: 0 on the paper,
    up to 1 at the strokes' cores; and the same averaged over 3x3 pixels, to tell ink from noise."""
    smooth = F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)  # noise and JPEG speckle averaged
    if ink_is_dark(x) if dark is None else dark:  # make it light on dark
        x, smooth = 1 - x, 1 - smooth
    # Uneven paper or light: the paper's level is the lowest nearby, over blocks wider than a stroke.
    block = max(1, max(x.shape[2:]) // 8)
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
        raise NoDigit
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
        strokes = F.pad(strokes, [radius] * 4)  # a square pen: its rows, then its columns
        strokes = F.max_pool2d(strokes, (2 * radius + 1, 1), stride=1, padding=(radius, 0))
        strokes = F.max_pool2d(strokes, (1, 2 * radius + 1), stride=1, padding=(0, radius))
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


# === Serving: a request's images, the model, its answer (serve.py is the server around them) =============

MAX_IMAGES = 16  # in one request
BOUNDARY = re.compile(r';\s*boundary=(?:"([^"]*)"|([^\s;]*))', re.IGNORECASE)  # of a form's Content-Type
QUOTED = re.compile(rb'"(?:[^"\\\r\n]|\\.)*"')  # a quoted string in a header: its "; filename=" is no parameter
FILE_PART = re.compile(rb'^content-disposition:[^\r\n]*;\s*filename\*?=|^content-type:\s*image/',
                       re.IGNORECASE | re.MULTILINE)
FORMS = ('send the image file as the body (curl --data-binary @digit.png), as a form upload (curl -F '
         'file=@digit.png), or as JSON {"image": "<base64 or data: URL>"}')


def load_model(path):
    """The trained SimpleCNN in eval mode, or SetupError: weights only, no arbitrary objects unpickled."""
    advice = 'pass --model with a best_model.pth written by mnist_train.py or mnist_train_distributed.py'
    if os.path.isdir(path):  # the training's --output-dir, say
        inside = os.path.join(path, 'best_model.pth')
        raise common.SetupError(f'{path} is a folder: pass --model {inside}.' if os.path.isfile(inside) else
                                f'{path} is a folder, with no best_model.pth in it; {advice}.')
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
    """Digits and probabilities for a batch of preprocessed images (each digit the first most probable, as argmax)."""
    with torch.inference_mode():
        probabilities = torch.softmax(model(batch), dim=1).tolist()
    return [p.index(max(p)) for p in probabilities], probabilities


def images_in(body, content_type):
    """The image files a request body carries, in any of the accepted forms, and whether several were asked for."""
    declared = content_type.split(';')[0].strip().lower()
    if declared == 'multipart/form-data':
        files = form_files(body, content_type)
        if not files:
            raise Refused(400, f'the form holds no file; {FORMS}')
        return files, len(files) > 1
    # JSON as declared, or by its first character whatever its Content-Type (curl -d says form-urlencoded)
    if declared == 'application/json' or body.lstrip()[:1] in (b'{', b'['):
        try:
            fields = json.loads(body)
            images = fields['images'] if 'images' in fields else [fields['image']]
            if not isinstance(images, list) or not images or not all(isinstance(image, str) for image in images):
                raise TypeError
            return [base64.b64decode(image.partition('base64,')[2] if image.startswith('data:') else image)
                    for image in images], 'images' in fields
        except (ValueError, KeyError, TypeError, binascii.Error, RecursionError):  # RecursionError: nested too deep
            raise Refused(400, f'the JSON body is not {{"image": "<base64>"}} nor {{"images": [...]}}; {FORMS}') \
                from None
    return [body], False


def form_files(body, content_type):
    """The files of a multipart/form-data body (RFC 7578), as sent: its parts with a filename or an image type."""
    match = BOUNDARY.search(content_type)
    boundary, files = (match[1] or match[2] or '').encode('latin-1') if match else b'', []
    for part in (b'\r\n' + body).split(b'\r\n--' + boundary)[1:] if boundary else []:
        if part.startswith(b'--'):  # the closing delimiter
            break
        head, _, data = part.partition(b'\r\n\r\n')
        fields = QUOTED.sub(b'""', head.partition(b'\r\n')[2])  # the part's headers, their quoted strings emptied
        if data and FILE_PART.search(fields):
            files.append(data)  # an empty file field is no image
    return files


def pixel_count(data):
    """An image's pixels, from its header (nothing decoded), or 0 where it has none: then its error is as quick."""
    try:
        return math.prod(Image.open(io.BytesIO(data), formats=FORMATS).size)
    except Exception:
        return 0


def read_image(data):
    """One image as MNIST framed its digits (a 28x28 'L' image), or Refused with the status its problem gets."""
    try:
        return to_mnist(data)
    except NotAnImage as e:
        raise Refused(400, f'the body is {e}; {FORMS}') from None
    except TooLarge as e:
        raise Refused(413, str(e)) from None
    except NoDigit as e:
        raise Refused(422, str(e)) from None
    except ValueError as e:  # Damaged
        raise Refused(400, str(e)) from None


def answer(model, images, several, dropped, framed=False):
    """The JSON reply for a request's images; gives up once dropped (an Event) is set. framed: each prediction
    also carries the 28x28 image the model read, as a PNG data: URL."""
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
    digits, probabilities = predict(model, torch.cat([mnist_tensor(image) for image in batch]))
    replies = [{'digit': d, 'probabilities': [round(p, 6) for p in ps]} for d, ps in zip(digits, probabilities)]
    for reply, image in zip(replies, batch if framed else []):
        png = io.BytesIO()
        image.save(png, 'PNG')
        reply['framed'] = 'data:image/png;base64,' + base64.b64encode(png.getvalue()).decode()
    return {'predictions': replies} if several else replies[0]
