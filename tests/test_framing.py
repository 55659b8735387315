"""framing.py, the reading of pictures, without a server: bytes or PIL images in, MNIST's 28x28 out."""
import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageOps, features
from torchvision import datasets

import framing
import mnist_train  # its transform: what the model was trained on
from conftest import png_header


def encode(image, fmt='PNG', **options):
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def seven(size=(300, 240), box=(100, 60, 180, 190), paper=235, ink=30, width=10):
    """A dark 7 drawn on light paper: an 'L' image."""
    image = Image.new('L', size, paper)
    left, top, right, bottom = box
    ImageDraw.Draw(image).line((left, top, right, top, (left + right) // 2, bottom), ink, width, joint='curve')
    return image


def framed(image, fmt='PNG', **options):
    return framing.to_tensor(encode(image, fmt, **options))[0, 0]


def geometry(tensor):
    """(largest side of the ink's box, centre of mass (row, column)) of a framed 28x28 tensor."""
    ink = (tensor + 1) / 2  # back to 0-1, the document's Normalize undone
    rows, cols = (ink > 0.05).any(1).nonzero()[:, 0], (ink > 0.05).any(0).nonzero()[:, 0]
    mass = ink.sum()
    centre = ((ink.sum(1) * torch.arange(28)).sum() / mass, (ink.sum(0) * torch.arange(28)).sum() / mass)
    return max(rows[-1] - rows[0] + 1, cols[-1] - cols[0] + 1).item(), [round(c.item(), 1) for c in centre]


def like(tensor, reference, at_least):
    overlap = torch.nn.functional.cosine_similarity((tensor + 1).flatten(), (reference + 1).flatten(), dim=0)
    return overlap > at_least, overlap.item()


def test_an_mnist_png_gives_bit_for_bit_the_validation_tensor(mnist_dir):
    dataset = datasets.MNIST(root=mnist_dir, train=False, transform=mnist_train.transform)
    for i in range(20):
        png = encode(Image.fromarray(dataset.data[i].numpy()))
        assert torch.equal(framing.to_tensor(png)[0], dataset[i][0]), f'image {i}'
        assert torch.equal(framing.to_tensor(Image.fromarray(dataset.data[i].numpy()))[0], dataset[i][0])
        assert framing.to_mnist(png).tobytes() == dataset.data[i].numpy().tobytes()
        rgb = encode(Image.fromarray(dataset.data[i].numpy()).convert('RGB'))  # as some tools save it
        assert torch.equal(framing.to_tensor(rgb)[0], dataset[i][0]), f'image {i} in RGB'


def test_any_picture_is_framed_as_mnist_framed_its_digits():
    reference = framed(seven())
    side, (row, col) = geometry(reference)
    assert 19 <= side <= 21 and abs(row - 14) <= 0.5 and abs(col - 14) <= 0.5, geometry(reference)
    assert reference.mean() < 0, 'light on dark, as MNIST'
    # Small, off-centre in a large frame, on grey and unevenly lit paper, noisy, as a JPEG.
    photo = seven((1200, 900), (900, 100, 960, 190), paper=150, ink=40, width=7)
    gradient = Image.linear_gradient('L').resize(photo.size).point(lambda v: v // 4)
    photo = Image.fromarray(np.clip(np.asarray(photo, np.int16) + np.asarray(gradient, np.int16) +
                                    np.random.default_rng(0).normal(0, 6, photo.size[::-1]), 0, 255).astype(np.uint8))
    variants = {
        'photo': framed(photo, 'JPEG', quality=70),
        'light on dark': framed(ImageOps.invert(seven())),
        'colour': framed(Image.merge('RGB', [seven(paper=250, ink=200), seven(paper=240, ink=20),
                                               seven(paper=220, ink=20)])),
        'a PIL image': framing.to_tensor(seven())[0, 0],
    }
    for name, tensor in variants.items():
        side, (row, col) = geometry(tensor)
        assert 19 <= side <= 21 and abs(row - 14) <= 0.5 and abs(col - 14) <= 0.5, (name, geometry(tensor))
        assert like(tensor, reference, 0.8)[0], (name, like(tensor, reference, 0.8))


def test_exif_orientation_and_transparency_are_honoured():
    reference = framed(seven())
    exif = Image.Exif()
    exif[0x0112] = 6  # stored on its side: turn 90 degrees clockwise to view
    assert torch.equal(framed(seven().rotate(90, expand=True), exif=exif), reference)
    exif[0x0112] = 2  # stored mirrored (a front camera's): flip to view
    assert torch.equal(framed(ImageOps.mirror(seven()), exif=exif), reference)
    strokes = ImageOps.invert(seven(paper=235, ink=20))  # the drawing's opacity: 0 around the strokes
    for colour in ('white', 'black'):  # light or dark strokes on a transparent canvas
        canvas = Image.new('RGBA', strokes.size, colour)
        canvas.putalpha(strokes)
        assert torch.allclose(framed(canvas), reference, atol=0.1), colour
    palette = seven(paper=0, ink=255).convert('P')  # a white 7 on black, black made transparent
    palette.info['transparency'] = 0
    assert like(framed(palette, transparency=0), reference, 0.95)[0]
    black = seven(paper=0, ink=1).convert('P')  # a GIF's black 7 (index 1) on transparent black (index 0)
    black.putpalette([0, 0, 0] * 2)
    assert like(framed(black, 'GIF', transparency=0), reference, 0.95)[0], 'read from its opacity, as an RGBA one'


@pytest.mark.parametrize('side, width, chalk', [(1024, 3, False), (2000, 3, False), (2000, 3, True),
                                                (4096, 8, False), (4096, 160, False)])
def test_a_large_picture_is_read_from_a_crop_of_bounded_size(side, width, chalk, monkeypatch):
    """Fine and broad pens on large canvases, dark ink or chalk (light on dark): the digit is framed as on a
    small one, and the work on the ink is done on at most about WORK_SIDE pixels a side, whatever the size."""
    sizes, frame = [], framing.frame
    monkeypatch.setattr(framing, 'frame', lambda ink, smooth: (sizes.append(ink.shape), frame(ink, smooth))[1])
    scale = side / 300
    paper, ink = (20, 235) if chalk else (235, 30)
    big = seven((side, side * 4 // 5), tuple(round(v * scale) for v in (100, 60, 180, 190)), paper, ink, width)
    tensor = framed(big)
    assert max(sizes[0]) <= framing.WORK_SIDE * 1.6, sizes
    side_, (row, col) = geometry(tensor)
    assert 19 <= side_ <= 21 and abs(row - 14) <= 0.5 and abs(col - 14) <= 0.5, geometry(tensor)
    assert like(tensor, framed(seven()), 0.8)[0], like(tensor, framed(seven()), 0.8)


def test_large_images_are_decoded_within_bounds():
    for size, mode, fmt in ((4096, 'RGBA', 'PNG'), (8000, 'RGB', 'JPEG'), (3000, 'P', 'GIF')):
        image = Image.new(mode, (size, size // 2), 'white')
        ImageDraw.Draw(image).ellipse((size // 3, size // 8, size * 2 // 3, size * 3 // 8), outline='black',
                                      width=size // 30)
        decoded = framing.decode(encode(image, fmt))
        assert decoded.mode in ('L', 'LA', 'RGB', 'RGBA')
        if fmt == 'JPEG':  # decoded at reduced scale, still at least JPEG_SIDE a side
            assert framing.JPEG_SIDE <= max(decoded.size) < 2 * framing.JPEG_SIDE, decoded.size
        side, _ = geometry(framing.to_tensor(encode(image, fmt))[0, 0])
        assert 19 <= side <= 21, (fmt, side)
    canvas = Image.new('RGBA', (3000, 3000), (0, 0, 0, 0))  # strokes on a large transparent canvas
    ImageDraw.Draw(canvas).ellipse((1000, 750, 2000, 2250), outline=(0, 0, 0, 255), width=100)
    side, _ = geometry(framing.to_tensor(encode(canvas))[0, 0])
    assert 19 <= side <= 21, side
    with pytest.raises(framing.TooLarge, match='at most 16777216 are served'):
        framing.decode(encode(Image.new('L', (40_000_000, 1))))  # 40 megapixels in a few KB
    with pytest.raises(framing.TooLarge, match='10000000000 pixels'):
        framing.decode(png_header(100_000, 100_000))  # refused as Pillow opens it, by its own check


EPS = (b'%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 100 100\n/Helvetica findfont 90 scalefont setfont\n'
       b'20 10 moveto (7) show\nshowpage\n')  # a 7 in PostScript: Pillow would run Ghostscript to draw it


@pytest.mark.parametrize('fmt', framing.FORMATS)
def test_each_format_served_is_read(fmt):
    if fmt == 'AVIF' and not features.check('avif'):
        pytest.skip('this Pillow was built without AVIF')
    assert like(framed(seven().convert('RGB'), fmt), framed(seven()), 0.95)[0]


def test_a_damaged_avif_is_named_damaged():
    if not features.check('avif'):
        pytest.skip('this Pillow was built without AVIF')
    data = bytearray(encode(seven(), 'AVIF'))
    data[-20:] = bytes(20)  # its pixels zeroed: Pillow's AVIF plugin raises RuntimeError, not OSError
    with pytest.raises(framing.Damaged, match='the image cannot be decoded'):
        framing.to_mnist(bytes(data))


@pytest.mark.parametrize('fmt', ['ICO', 'TGA', 'PCX', 'SGI', 'JPEG2000', 'EPS'])
def test_the_formats_pillow_reads_beside_those_are_not_read(fmt):
    if fmt == 'JPEG2000' and not features.check('jpg_2000'):
        pytest.skip('this Pillow was built without OpenJPEG')
    data = EPS if fmt == 'EPS' else encode(seven(), fmt)  # EPS: read, Ghostscript would run where installed
    assert Image.open(io.BytesIO(data)).format == fmt, 'a format Pillow reads'
    with pytest.raises(framing.NotAnImage, match='not an image in a format served'):
        framing.to_mnist(data)
    assert framing.pixel_count(data) == 0


@pytest.mark.parametrize('fmt', ['PNG', 'TIFF'])
def test_a_16_bit_grey_picture_is_read_as_its_8_bit_levels(fmt):
    levels = np.asarray(seven(), dtype=np.uint16) * 257  # 0-255 to 0-65535
    data = encode(Image.fromarray(levels), fmt)
    assert Image.open(io.BytesIO(data)).mode.startswith('I'), 'opened as 16-bit'
    assert torch.equal(framing.to_tensor(data), framing.to_tensor(seven()))


def test_a_cameras_jpeg_with_a_second_picture_is_read_as_a_jpeg():
    """Cameras and phones add a second picture to their JPEGs (a preview, an HDR gain map): Pillow opens them as
    MPO. Decoded at reduced scale and up to 16 times MAX_PIXELS, as any JPEG of one scan."""
    photo = seven((6000, 5000), (2000, 1000, 4000, 4000), width=200).convert('RGB')  # 30 megapixels
    buffer = io.BytesIO()
    photo.save(buffer, 'MPO', save_all=True, append_images=[photo.reduce(8)])
    assert Image.open(io.BytesIO(buffer.getvalue())).format == 'MPO'
    decoded = framing.decode(buffer.getvalue())
    assert framing.JPEG_SIDE <= max(decoded.size) < 2 * framing.JPEG_SIDE, decoded.size
    assert like(framing.to_tensor(decoded)[0, 0], framed(seven()), 0.9)[0]


def test_a_jpeg_of_more_scans_than_served_is_refused_before_it_is_decoded():
    """Each scan of a progressive JPEG walks all its blocks: a 4096x4096 one repeating a 40-byte scan costs 1 ms a
    copy, a 1 MB body 25 s of a prediction thread. Counted before decoding, as libjpeg walks the segments."""
    image = seven((1024, 1024), (300, 200, 700, 900), width=40)
    progressive = encode(image, 'JPEG', progressive=True)
    last_scan = progressive[progressive.rindex(b'\xff\xda'):-2]  # up to the end-of-image marker
    scans = progressive.count(b'\xff\xda')
    assert 5 <= scans <= 10 and framing.jpeg_scans(progressive) == (scans, False), 'as libjpeg writes one in grey'
    at_most = progressive[:-2] + last_scan * (framing.MAX_SCANS - scans) + progressive[-2:]
    assert framing.decode(at_most).size == image.size, f'{framing.MAX_SCANS} scans are read'
    over = progressive[:-2] + last_scan * (framing.MAX_SCANS - scans + 1)
    with pytest.raises(framing.TooLarge, match=f'^the JPEG has over {framing.MAX_SCANS} scans; at most that many'):
        framing.decode(over[:-10])  # truncated: decoded, it would be Damaged
    for between in (b'\x55', b'\xff\xd0', b'\xff\x00'):  # between segments libjpeg skips bytes, restart markers
        assert framing.jpeg_scans(over.replace(b'\xff\xda', between + b'\xff\xda'))[0] > framing.MAX_SCANS, between


def test_a_progressive_jpeg_is_served_up_to_max_pixels_and_a_cameras_up_to_16_times_that():
    """A JPEG of several scans is held whole as it is decoded (a 16384x16384 one grew a process by 784 MiB); one of
    one scan, as cameras write them, streams at reduced scale. A thumbnail in its EXIF is not counted as a scan."""
    thumbnail = encode(seven((160, 120), (50, 20, 110, 100), width=6), 'JPEG')
    exif = b'Exif\x00\x00' + thumbnail  # not a valid EXIF block, but where cameras keep their thumbnail
    camera = encode(seven((6000, 5000), (2000, 1000, 4000, 4000), width=200), 'JPEG')
    camera = camera[:2] + b'\xff\xe1' + (2 + len(exif)).to_bytes(2, 'big') + exif + camera[2:]
    assert camera.count(b'\xff\xda') == 2 and framing.jpeg_scans(camera) == (1, True)
    assert like(framing.to_tensor(camera)[0, 0], framed(seven()), 0.9)[0], '30 megapixels in one scan are read'
    side = 4096  # MAX_PIXELS
    progressive = encode(seven((side, side), (1500, 1000, 2500, 3000), width=100), 'JPEG', progressive=True)
    assert like(framing.to_tensor(progressive)[0, 0], framed(seven()), 0.9)[0], 'MAX_PIXELS in progressive JPEG'
    progressive = encode(Image.new('L', (side + 1, side), 255), 'JPEG', progressive=True)
    first_scan = progressive[:progressive.index(b'\xff\xda', progressive.index(b'\xff\xda') + 2)] + b'\xff\xd9'
    baseline = encode(Image.new('RGB', (side + 1, side), 'white'), 'JPEG')
    sos = baseline.index(b'\xff\xda')  # its one scan made a scan of its first component only:
    one_component = baseline[:sos] + b'\xff\xda\x00\x08\x01' + baseline[sos + 5:sos + 7] + baseline[sos + 11:]
    assert framing.jpeg_scans(first_scan)[0] == framing.jpeg_scans(one_component)[0] == 1
    for held_whole in (progressive, first_scan, one_component):  # libjpeg would hold all its coefficients
        with pytest.raises(framing.TooLarge, match='^the image has 4097x4096 pixels; at most 16777216 are served in '
                                                   'a progressive JPEG'):
            framing.decode(held_whole)


def tiled_tiff(width, height, tile_width, tile_length):
    """A white grey TIFF of one tile, deflated: 16 KB for a tile of 17 million pixels."""
    data = zlib.compress(b'\xff' * (tile_width * tile_length))
    tags = [(256, width), (257, height), (258, 8), (259, 8), (262, 1), (277, 1), (322, tile_width), (323, tile_length),
            (324, 8 + 2 + 10 * 12 + 4), (325, len(data))]  # 324: the tile's offset, after this directory
    directory = struct.pack('<H', len(tags)) + b''.join(struct.pack('<HHII', tag, 4, 1, value) for tag, value in tags)
    return b'II*\x00' + struct.pack('<I', 8) + directory + struct.pack('<I', 0) + data


def test_a_tiff_of_tiles_over_max_pixels_is_refused_before_it_is_decoded():
    """libtiff allocates a whole tile at once, whatever the image's size: a 218-byte 256x256 TIFF claiming tiles of
    32768x65520 grew a process by 1 GiB."""
    assert framing.decode(tiled_tiff(200, 200, 256, 256)).size == (200, 200)
    assert framing.decode(tiled_tiff(100, 100, 4096, 4096)).size == (100, 100), 'a tile of MAX_PIXELS is read'
    truncated = tiled_tiff(100, 100, 4096, 4112)[:-10]  # sides: multiples of 16; decoded, it would be Damaged
    with pytest.raises(framing.TooLarge, match='^the TIFF has tiles of 4096x4112 pixels; at most 16777216 are read'):
        framing.decode(truncated)
    assert len(tiled_tiff(100, 100, 4096, 4112)) < 20_000


def test_pixel_count_reads_the_header_only():
    """How serve.py tells the images of a small body it reads at once (few pixels) from those it hands to a thread;
    bytes that are no image, or one refused as it opens, count 0: their error is as quick."""
    assert framing.pixel_count(png_header(4096, 3000)) == 4096 * 3000
    assert framing.pixel_count(encode(Image.new('L', (28, 28)))) == 28 * 28
    assert framing.pixel_count(b'not an image') == framing.pixel_count(png_header(100_000, 100_000)) == 0


def test_noise_costs_no_more_than_a_digit():
    noise = Image.fromarray(np.random.default_rng(1).integers(0, 256, (1024, 1024), dtype=np.uint8))
    assert framing.to_mnist(encode(noise)).size == (28, 28)  # read as some digit, from a bounded crop


@pytest.mark.parametrize('data, error, message', [
    (b'this is not an image', framing.NotAnImage, 'not an image in a format served'),
    (encode(Image.fromarray(np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8)))[:300],
     framing.Damaged, 'the image cannot be decoded'),
    (encode(Image.new('L', (28, 28), 0)), framing.NoDigit, r'^the image has no digit: it is blank or all of one '
     r'colour \(send a dark digit on light paper, or light on dark\)$'),
    (encode(Image.new('L', (28, 28), 128)), framing.NoDigit, 'the image has no digit'),
    (encode(Image.new('RGB', (3000, 2000), (200, 190, 180))), framing.NoDigit, 'the image has no digit'),
    (encode(Image.new('RGBA', (64, 64), (0, 0, 0, 0))), framing.NoDigit, 'the image has no digit'),
], ids=['text', 'truncated', 'black', 'grey', 'one colour', 'transparent'])
def test_each_problem_has_its_exception(data, error, message):
    with pytest.raises(error, match=message):
        framing.to_mnist(data)
    assert issubclass(error, ValueError)


@pytest.mark.parametrize('content_type, parts, expected', [
    ('multipart/form-data; boundary=XyZ', ['Content-Disposition: form-data; name="file"; filename="d.png"'], [0]),
    ('Multipart/Form-Data;Boundary="a b:c"', ['content-disposition: form-data; name="f"; FILENAME=d.png'], [0]),
    ('multipart/form-data; charset=utf-8; boundary=XyZ',  # RFC 2231's filename*, and a type alone
     ['Content-Disposition: form-data; name="a"; filename*=utf-8\'\'%E6%95%B0.png',
      'Content-Disposition: form-data; name="b"\r\nContent-Type: IMAGE/jpeg'], [0, 1]),
    ('multipart/form-data; boundary=XyZ',  # no file: a text field, "; filename=" inside a quoted name, a text type
     ['Content-Disposition: form-data; name="note"',
      'Content-Disposition: form-data; name="a; filename=b.png"',
      'Content-Disposition: form-data; name="c"\r\nContent-Type: text/plain'], []),
    ('multipart/form-data; boundary=XyZ',  # a file of a type the browser does not know
     ['Content-Disposition: form-data; name="f"; filename="d.png"\r\nContent-Type: application/octet-stream'], [0]),
    ('multipart/form-data', ['Content-Disposition: form-data; name="f"; filename="d.png"'], []),  # no boundary
], ids=['plain', 'quoted-boundary', 'rfc2231-and-type', 'no-file', 'octet-stream', 'no-boundary'])
def test_form_files_are_the_parts_with_a_filename_or_an_image_type(content_type, parts, expected):
    boundary = (content_type.rpartition('oundary=')[2].strip('"') if 'oundary=' in content_type else 'XyZ').encode()
    datas = [b'\x89PNG file %d\r\n\r\n--not the boundary\r\n' % k for k in range(len(parts))]  # a blank line too
    body = b''.join(b'--' + boundary + b'\r\n' + head.encode() + b'\r\n\r\n' + data + b'\r\n'
                    for head, data in zip(parts, datas)) + b'--' + boundary + b'--\r\n'
    assert framing.form_files(body, content_type) == [datas[k] for k in expected]
    empty = b'--' + boundary + b'\r\nContent-Disposition: form-data; name="f"; filename=""\r\n\r\n\r\n--' + boundary
    assert framing.form_files(empty + b'--\r\n', content_type) == [], 'an empty file field is no image'
