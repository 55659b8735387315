"""Screenshots of TensorBoard's tabs for a training run, in a real browser (headless Chromium).

    python tests/tensorboard_screenshots.py --logdir OUTPUT_DIR/runs [--out docs/]

Starts TensorBoard (the package the training scripts use) on --logdir, opens each tab the scripts
fill beside the document's curves (IMAGES, PR CURVES, GRAPHS, HPARAMS) and saves it as
docs/tensorboard-<tab>.png.
Made again after a change of what the scripts write; needs selenium, Chromium and chromedriver (as the
page's tests). Point --logdir at a folder holding several runs to compare them in HPARAMS.
"""
import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from page_screenshot import ROOT, headless_chromium  # noqa: E402  (beside this file)
TABS = ['images', 'pr_curves', 'graphs', 'hparams']  # the tabs the document's three curves left empty


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--logdir', required=True, help='a runs/ folder of the training scripts, or a folder of them')
    parser.add_argument('--out', default=os.path.join(ROOT, 'docs'), help='where the PNGs go (default: docs/)')
    parser.add_argument('--wait', type=float, default=8, help='seconds to let each tab draw (default: 8)')
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    board = subprocess.Popen([sys.executable, '-m', 'tensorboard.main', '--logdir', args.logdir, '--host', '127.0.0.1',
                              '--port', str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    browser = headless_chromium(1500, 900)
    try:
        for _ in range(300):  # TensorBoard serving, the runs loaded
            try:
                urllib.request.urlopen(f'http://127.0.0.1:{port}/data/plugins_listing', timeout=5)
                break
            except OSError:
                time.sleep(0.2)
        time.sleep(3)
        for tab in TABS:
            browser.get(f'http://127.0.0.1:{port}/#{tab}')
            time.sleep(args.wait)
            path = os.path.join(args.out, f'tensorboard-{tab.replace("_", "-")}.png')
            if not browser.save_screenshot(path):  # selenium only warns
                sys.exit(f'error: could not write {path}')
            print(path)
    finally:
        browser.quit()
        board.terminate()
        board.wait()


if __name__ == '__main__':
    main()
