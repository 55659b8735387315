"""The page at GET /, in a real browser (headless Chromium driven by Selenium): draw a digit on the canvas,
or upload an image file, and read the digit and the bars the page shows.

The model is trained here, in a few seconds, on three shapes drawn with Pillow and framed by serve.py:
an ellipse (0), an upright stroke (1), a bar and a slant (7). The browser then draws those shapes by
pointer, so what is asserted is the whole path: strokes, canvas PNG, POST /predict, framing, model, page.
"""
import base64
import io
import os
import random
import shutil
import sys

import pytest
import torch
from PIL import Image, ImageDraw

import common
from conftest import ROOT, free_port, run, serving

pytestmark = pytest.mark.one_leg('newest')  # a browser and a model trained here: about 40 s, the same on either torch
webdriver = pytest.importorskip('selenium.webdriver', reason='selenium is not installed (requirements-test.txt)')
CHROMIUM = next((path for path in map(shutil.which, ('chromium', 'chromium-browser', 'google-chrome')) if path), None)
DRIVER = shutil.which('chromedriver')
if not (CHROMIUM and DRIVER):
    pytest.skip('no Chromium and chromedriver here (.ci/run installs them with apt-get where it can)',
                allow_module_level=True)

SHAPES = {  # digit: a function drawing it into a box (left, top, right, bottom) with a pen of some width
    0: lambda draw, box, width: draw.ellipse(box, outline=0, width=width),
    1: lambda draw, box, width: draw.line(((box[0] + box[2]) // 2, box[1], (box[0] + box[2]) // 2, box[3]), 0, width),
    7: lambda draw, box, width: draw.line((box[0], box[1], box[2], box[1], (box[0] + box[2]) // 2, box[3]), 0, width,
                                          joint='curve'),
}


def drawn(digit, rng):
    image = Image.new('L', (rng.randint(120, 300), rng.randint(120, 300)), 255)
    height = rng.randint(60, min(image.size) - 10)
    width = height * (rng.uniform(0.5, 0.8) if digit != 1 else 0.2)
    left, top = rng.randint(0, int(image.width - width)), rng.randint(0, image.height - height)
    SHAPES[digit](ImageDraw.Draw(image), (left, top, int(left + width), top + height), rng.randint(3, 20))
    buffer = io.BytesIO()
    image.save(buffer, 'PNG')
    return buffer.getvalue()


@pytest.fixture(scope='module')
def model_file(tmp_path_factory):
    import framing
    rng = random.Random(0)
    torch.manual_seed(0)
    labels = [digit for digit in SHAPES for _ in range(150)]
    images = torch.cat([framing.to_tensor(drawn(digit, rng)) for digit in labels])
    labels = torch.tensor(labels)
    model = common.SimpleCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(150):
        batch = torch.randint(0, len(labels), (64,))
        loss = torch.nn.functional.cross_entropy(model(images[batch]), labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    path = tmp_path_factory.mktemp('model') / 'best_model.pth'
    torch.save(model.state_dict(), path)
    return path


@pytest.fixture(scope='module')
def page(model_file):
    port = free_port()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ('--headless=new', '--no-sandbox', '--disable-dev-shm-usage', '--window-size=1000,800'):
        options.add_argument(flag)
    with serving([sys.executable, ROOT / 'serve.py', '--model', model_file, '--port', str(port)]):
        browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
        try:
            browser.get(f'http://127.0.0.1:{port}/')
            yield browser
        finally:
            browser.quit()


def shown(browser, expected):
    """The digit the page settles on (it may still be answering the strokes before the last)."""
    from selenium.webdriver.support.ui import WebDriverWait
    try:
        WebDriverWait(browser, 20).until(lambda b: b.find_element('id', 'digit').text == str(expected))
    except Exception:
        pass
    return browser.find_element('id', 'digit').text


def bars(browser):
    return [float(browser.find_element('css selector', f'#bar-{d} small').text.rstrip('%')) for d in range(10)]


def stroke(browser, points):
    """Draw one stroke through points given in the canvas's own 280x280 pixels."""
    from selenium.webdriver.common.action_chains import ActionChains
    pad = browser.find_element('id', 'pad')
    scale = pad.size['width'] / 280
    offset = lambda x, y: (int((x - 140) * scale), int((y - 140) * scale))  # from the element's centre
    actions = ActionChains(browser, duration=10).move_to_element_with_offset(pad, *offset(*points[0])).click_and_hold()
    previous = points[0]
    for point in points[1:]:
        actions.move_by_offset(*(a - b for a, b in zip(offset(*point), offset(*previous))))
        previous = point
    actions.release().perform()


@pytest.mark.parametrize('digit, strokes', [
    (1, [[(140, 50), (140, 120), (141, 180), (141, 235)]]),
    (0, [[(140 + 55 * __import__('math').sin(t / 10), 140 - 85 * __import__('math').cos(t / 10))
          for t in range(0, 64, 2)]]),
    (7, [[(80, 60), (200, 60), (170, 130), (140, 235)]]),
])
def test_drawing_a_digit_shows_it_and_its_probabilities(page, digit, strokes):
    page.find_element('id', 'clear').click()
    assert page.find_element('id', 'digit').text == ''
    for points in strokes:
        stroke(page, points)
    assert shown(page, digit) == str(digit), page.find_element('id', 'status').text
    probabilities = bars(page)
    assert sum(probabilities) == pytest.approx(100, abs=1) and max(probabilities) == probabilities[digit]
    assert page.find_element('id', 'status').text.startswith(f'It looks like a {digit}.')
    assert seen_image(page).size == (28, 28), 'the 28x28 image the model read is shown'


def seen_image(page):
    """The image the page shows as what the model read (None while hidden): a PIL image."""
    if not page.find_element('id', 'seen').is_displayed():
        return None
    src = page.find_element('id', 'framed').get_attribute('src')
    assert src.startswith('data:image/png;base64,'), src[:50]
    assert page.execute_script("return document.getElementById('framed').naturalWidth") == 28
    return Image.open(io.BytesIO(base64.b64decode(src.partition(',')[2])))


def test_uploading_a_file_shows_its_digit_and_a_blank_one_says_why(page, tmp_path):
    path = tmp_path / 'seven.png'
    path.write_bytes(drawn(7, random.Random(5)))
    page.find_element('id', 'clear').click()
    page.find_element('id', 'file').send_keys(str(path))
    assert shown(page, 7) == '7'
    import framing  # what the page shows is the framing of that very file
    assert seen_image(page).tobytes() == framing.to_mnist(path.read_bytes()).tobytes()
    Image.new('RGB', (100, 100), 'white').save(tmp_path / 'blank.png')
    page.find_element('id', 'file').send_keys(str(tmp_path / 'blank.png'))
    from selenium.webdriver.support.ui import WebDriverWait
    WebDriverWait(page, 20).until(lambda b: 'no digit' in b.find_element('id', 'status').text)
    assert page.find_element('id', 'digit').text == '' and seen_image(page) is None
    if os.environ.get('PAGE_SCREENSHOT'):  # to look at it: PAGE_SCREENSHOT=page.png
        page.save_screenshot(os.environ['PAGE_SCREENSHOT'])


def test_the_image_picker_is_reached_by_the_keyboard_and_shows_it(page):
    # Before: the file input was display: none, so Tab went from Clear to nothing and no key opened the picker
    from selenium.webdriver.common.keys import Keys
    page.find_element('id', 'clear').send_keys(Keys.TAB)
    assert page.execute_script('return document.activeElement.id') == 'file'
    assert page.execute_script("return getComputedStyle(document.querySelector('label.file')).outlineStyle") != 'none'


def phone_photo(digit, rng):
    """A 4000x3000 JPEG of a digit drawn large on grainy paper, as a phone takes it: several MB."""
    image = Image.new('L', (4000, 3000), 235)
    SHAPES[digit](ImageDraw.Draw(image), (1500, 700, 2300, 2300), 90)
    grain = Image.effect_noise((4000, 3000), 24)
    image = Image.blend(image, grain, 0.15)
    buffer = io.BytesIO()
    image.convert('RGB').save(buffer, 'JPEG', quality=95)
    return buffer.getvalue()


@pytest.mark.parametrize('digit', [7, 0])
def test_a_phone_photo_reaches_the_model_through_eas_s_1_mb_gateway(page, tmp_path, digit):
    from test_eas import GATEWAY_MAX_BODY, Gateway
    path = tmp_path / 'photo.jpg'
    path.write_bytes(phone_photo(digit, random.Random(digit)))
    assert path.stat().st_size > 2 * GATEWAY_MAX_BODY
    home = page.current_url  # the service itself, where the other tests find the page
    gateway = Gateway('mnist', int(home.split(':')[2].strip('/')), token=None)
    try:
        page.get(f'{gateway.url}/api/predict/mnist/')
        page.find_element('id', 'file').send_keys(str(path))
        assert shown(page, digit) == str(digit), page.find_element('id', 'status').text
        posts = [size for method, _, size in gateway.forwarded if method == 'POST']
        assert len(posts) == 1 and 0 < posts[0] <= GATEWAY_MAX_BODY, gateway.forwarded
    finally:
        page.get(home)
        gateway.close()


def test_the_page_needs_nothing_from_outside(page):
    html = (ROOT / 'page' / 'index.html').read_text()
    assert 'http://' not in html.replace('http://127', '') and 'https://' not in html and '//cdn' not in html
    assert page.execute_script(
        "return performance.getEntriesByType('resource').filter(r => !r.name.startsWith(location.origin)).length") == 0


def test_the_screenshot_tool_writes_its_png_into_a_folder_it_makes(model_file, tmp_path):
    """tests/page_screenshot.py, which makes docs/page.png: selenium only warns of a PNG it cannot write (a folder
    that is not there), and the tool named the PNG all the same."""
    out = tmp_path / 'new' / 'page.png'
    _, stdout, _ = run([sys.executable, ROOT / 'tests' / 'page_screenshot.py', '--model', model_file, '--out', out])
    assert out.read_bytes().startswith(b'\x89PNG') and stdout.startswith(f'{out}: the page answering "It looks like')
