"""A screenshot of serve.py's page in a real browser (headless Chromium), a digit drawn on it by pointer.

    python tests/page_screenshot.py --model best_model.pth [--out docs/page.png]

Starts serve.py with the model, draws a 4 with a pen as the page's own (round, 18 pixels), waits for
the answer and saves the page as a PNG: the digit, the bars, and the 28x28 image the model read. Made
again after a change of the page; it needs selenium, Chromium and chromedriver (as the page's tests).
"""
import argparse
import os
import shutil
import sys
import time

from selenium import webdriver
from selenium.webdriver.support.ui import WebDriverWait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serve import ROOT, Server  # noqa: E402  (it puts the project on sys.path)
from test_page import stroke  # noqa: E402  (the tests' own pointer strokes)

FOUR = [[(95, 50), (75, 150), (190, 150)], [(165, 60), (160, 240)]]  # a 4 in the canvas's 280x280 pixels


def headless_chromium(width, height):
    """Debian's Chromium, headless, through its chromedriver, with a window of width x height pixels."""
    options = webdriver.ChromeOptions()
    options.binary_location = next(filter(None, map(shutil.which, ('chromium', 'chromium-browser', 'google-chrome'))))
    for flag in ('--headless=new', '--no-sandbox', '--disable-dev-shm-usage', f'--window-size={width},{height}',
                 '--disable-background-networking', '--disable-component-update'):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which('chromedriver')))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', required=True, help='best_model.pth written by the training scripts')
    parser.add_argument('--out', default=os.path.join(ROOT, 'docs', 'page.png'),
                        help='the PNG (default: docs/page.png)')
    args = parser.parse_args()
    server = Server(os.path.join(ROOT, 'serve.py'), args.model)
    browser = headless_chromium(780, 720)
    try:
        browser.get(f'http://127.0.0.1:{server.port}/')
        for points in FOUR:
            stroke(browser, points)
        WebDriverWait(browser, 20).until(lambda b: b.find_element('id', 'seen').is_displayed())
        time.sleep(0.5)  # the last stroke's answer
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        if not browser.save_screenshot(args.out):  # selenium only warns
            sys.exit(f'error: could not write {args.out}')
        print(f'{args.out}: the page answering "{browser.find_element("id", "status").text}"')
    finally:
        browser.quit()
        server.close()


if __name__ == '__main__':
    main()
