"""The GPU acceptance: every CUDA path of the project in one command, with its figures.

    ./run_local.sh gpu-check [--pai] [FLAGS]        (--pai: the PAI image's torch 2.3.1, in .venv-pai)
    python tests/gpu_check.py --data-dir DIR [--device cuda|cpu] [--epochs 2] [--min-accuracy 95.0]

Each check prints one line, `check NAME: ok|FAILED|skipped: figures or why`, and the last line says
`gpu-check: N passed, N failed, N skipped` (exit status 1 if any failed):
  single      mnist_train.py for --epochs on the device: best accuracy at least --min-accuracy (the CPU's
              after 2 epochs, 95.8%, less noise), seconds an epoch; and one epoch of the document's own
              pipeline beside ours (tests/benchmark.py --repeats 1): the ratio
  placement   each distributed process on its own GPU with NCCL (CUDA only)
  standalone  mnist_train_distributed.py under torchrun --standalone, one process per GPU (2 on the CPU):
              every test image validated once an epoch (c/10000), best_model.pth without 'module.'
  static      the same in DLC's static form (--nnodes=1 --node_rank=0 --master_addr --master_port)
  restart     the static form with --max-restarts=1, the last rank's process killed mid-epoch: resumed
  serve       serve.py --predict, and the server (one request), with the model saved on the device, on a view
              of the machine without CUDA (CUDA_VISIBLE_DEVICES=''): the digits the model gives on the device
  review      the TensorBoard review written from the device's tensors: its tags in the event file
On the CPU (--device cpu, as CI runs it on tiny data) the CUDA-only check skips, saying so. The runs write
under --output-dir (the first line names it), each in a folder of its own (single/, standalone/, static/,
restart/, serve/: the digits served), the torchrun jobs' own logs in their torchrun/ (a failed process's error.json).
"""
import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
results = []  # (name, outcome)


def report(name, outcome, figures):
    results.append((name, outcome))
    print(f'check {name}: {outcome}: {figures}', flush=True)


def run(args, env=None, timeout=600):
    """(returncode, stdout and stderr together) of a command run in the project root."""
    result = subprocess.run([str(a) for a in args], cwd=ROOT, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return result.returncode, result.stdout


def validations(output):
    """[(correct, total)] of each Validation line."""
    return [(int(c), int(t)) for c, t in re.findall(r'^Validation Loss: \S+, Accuracy: (\d+)/(\d+)', output, re.M)]


def check_single(args, out):
    """Two epochs of mnist_train.py on the device, and the document's pipeline beside ours."""
    code, output = run([sys.executable, 'mnist_train.py', '--device', args.device, '--epochs', args.epochs,
                        '--data-dir', args.data_dir, '--output-dir', out, '--no-resume'])
    best = re.search(r'^Best accuracy ([\d.]+)% at epoch \d+, saved in .*; \d+ epochs in ([\d.]+)s', output, re.M)
    if code != 0 or not best:
        return report('single', 'FAILED', f'exit {code}: {output.strip()[-400:]}')
    accuracy, seconds = float(best.group(1)), float(best.group(2)) / int(args.epochs)
    code, bench = run([sys.executable, 'tests/benchmark.py', '--data-dir', args.data_dir, '--device', args.device,
                       '--repeats', '1'])
    ratio = re.search(r'^ours / document +([\d.]+)', bench, re.M)
    figures = (f'best {accuracy:.2f}% (bar {args.min_accuracy}%), {seconds:.2f}s an epoch; one epoch, ours / '
               f'the document\'s pipeline: {ratio.group(1) if ratio else "?"}')
    report('single', 'ok' if accuracy >= args.min_accuracy and ratio else 'FAILED', figures)


def distributed(args, out, form, *extra, fresh=True):
    """torchrun of the distributed script, standalone or in DLC's static form; the process and its reader."""
    where = (['--standalone'] if form == 'standalone' else
             ['--nnodes=1', '--node_rank=0', '--master_addr=127.0.0.1', f'--master_port={free_port()}'])
    command = [sys.executable, '-m', 'torch.distributed.run', *where, f'--nproc_per_node={args.processes}', *extra,
               f'--log-dir={out / "torchrun"}',  # torchrun's own folders here, not left in the temporary folder
               'mnist_train_distributed.py', '--device', args.device, '--epochs', args.epochs, '--data-dir',
               args.data_dir, '--output-dir', out, *(['--no-resume'] if fresh else []), *args.script_flags]
    return subprocess.Popen([str(a) for a in command], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def check_distributed(args, out, form):
    """Exact validation and a plain checkpoint from a torchrun job; the output, for the placement check."""
    started = time.perf_counter()
    proc = distributed(args, out, form)
    output, _ = proc.communicate(timeout=600)
    totals = {total for _, total in validations(output)}
    state = torch.load(out / 'best_model.pth', weights_only=True) if (out / 'best_model.pth').exists() else {}
    plain = bool(state) and not any(key.startswith('module.') for key in state)
    ok = proc.returncode == 0 and len(validations(output)) == int(args.epochs) and totals == {args.test_size} \
        and plain
    best = max(validations(output) or [(0, 0)])
    report(form, 'ok' if ok else 'FAILED', f'{args.processes} processes, {len(validations(output))} validations of '
                                           f'{"/".join(map(str, sorted(totals)))} images, best {best[0]}/{best[1]}, '
                                           f'checkpoint keys plain: {plain}, {time.perf_counter() - started:.0f}s'
           + ('' if ok else f'; exit {proc.returncode}: {output.strip()[-400:]}'))
    return output


def check_restart(args, out):
    """A process killed mid-epoch under --max-restarts=1: the job resumes from its checkpoint and finishes."""
    saved = args.epochs
    args.epochs = str(int(args.epochs) + 1)  # one more epoch: the kill comes in the second
    proc = distributed(args, out, 'static', '--max-restarts=1', fresh=False)  # the restart resumes
    args.epochs = saved
    lines, victim, pid, killed = [], args.processes - 1, None, False
    for line in proc.stdout:
        lines.append(line)
        started = re.match(rf'^Rank {victim}/\d+ \(local rank {victim}, pid (\d+)\)', line)
        pid = int(started.group(1)) if started else pid
        if not killed and re.match(rf'^Rank: {victim}, Local_Rank: {victim} -- Train Epoch: 1 \[', line):
            os.kill(pid, signal.SIGKILL)
            killed = True
    proc.wait(timeout=600)
    output = ''.join(lines)
    resumed = re.search(r'^Resuming from epoch (\d+) ', output, re.M)  # 2 where epoch 1 ended before the kill
    ok = proc.returncode == 0 and killed and resumed and 'Training complete' in output
    report('restart', 'ok' if ok else 'FAILED', f'rank {victim} killed in epoch 1: '
           f'{"resumed from epoch " + resumed.group(1) if resumed else "no resume"}, exit {proc.returncode}'
           + ('' if ok else f': {output.strip()[-400:]}'))


def check_serve(args, model_path, out):
    """serve.py without CUDA reads the model saved on the device and gives the device's digits (out: the digits)."""
    import common
    import framing
    from torchvision import datasets
    model = common.SimpleCNN().to(args.device)
    model.load_state_dict(torch.load(model_path, map_location=args.device, weights_only=True))
    test_set = datasets.MNIST(root=args.data_dir, train=False)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(20):
        paths.append(out / f'{i}.png')
        test_set[i][0].save(paths[-1])
    with torch.no_grad():
        batch = torch.cat([framing.to_tensor(path.read_bytes()) for path in paths]).to(args.device)
        expected = model.eval()(batch).argmax(dim=1).tolist()
    no_cuda = {'CUDA_VISIBLE_DEVICES': ''}
    code, output = run([sys.executable, 'serve.py', '--model', model_path, '--predict', *paths], env=no_cuda)
    printed = [int(d) for d in re.findall(r'\.png: (\d) \(', output)]
    port = free_port()
    server = subprocess.Popen([sys.executable, 'serve.py', '--model', str(model_path), '--port', str(port),
                               '--workers', '1'], cwd=ROOT, env={**os.environ, **no_cuda},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        answer = ask(port, paths[0].read_bytes())
    finally:
        server.terminate()
        server.wait(timeout=60)
    ok = code == 0 and printed == expected and answer == expected[0]
    report('serve', 'ok' if ok else 'FAILED', f'20 test digits: {sum(map(int.__eq__, printed, expected))}/20 as on '
                                              f'{args.device}; the server answered {answer} for {expected[0]}')


def ask(port, body):
    for _ in range(600):
        try:
            request = urllib.request.Request(f'http://127.0.0.1:{port}/predict', data=body)
            with urllib.request.urlopen(request, timeout=30) as response:
                return int(re.search(rb'"digit": (\d)', response.read()).group(1))
        except OSError:
            time.sleep(0.1)
    return None


def check_review(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(str(out / 'runs' / 'mnist_experiment'), size_guidance={'images': 0, 'tensors': 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    wanted = ['Best model/mistakes', 'Best model/confusion matrix']  # an image, a text
    found = [tag for tag in wanted if any(name.startswith(tag) for name in tags['images'] + tags['tensors'])]
    curves = [tag for tag in tags['tensors'] if tag.startswith('Best model/digit ')]
    ok = found == wanted and len(curves) == 10 and tags['graph']
    report('review', 'ok' if ok else 'FAILED', f'tags {found}, {len(curves)} PR curves, graph {tags["graph"]}')


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--data-dir', default='./data', help='torchvision root of MNIST (default: %(default)s)')
    parser.add_argument('--device', choices=['cuda', 'cpu'], default='cuda',
                        help='cuda, or cpu to check the checks themselves, as CI does (default: %(default)s)')
    parser.add_argument('--epochs', type=int, default=2, help='epochs of each run (default: %(default)s)')
    parser.add_argument('--min-accuracy', type=float, default=95.0,
                        help='the single script\'s best accuracy must reach it (default: %(default)s)')
    parser.add_argument('--output-dir', help='where the runs write (default: a temporary folder)')
    args, args.script_flags = parser.parse_known_args()  # the rest: flags of the distributed script
    args.epochs = str(args.epochs)
    args.processes = torch.cuda.device_count() if args.device == 'cuda' else 2
    if args.device == 'cuda' and not args.processes:
        sys.exit('gpu-check: no CUDA GPU here (--device cpu checks the checks on the CPU)')
    import common
    common.prepare_mnist(args.data_dir)
    from torchvision import datasets
    args.test_size = len(datasets.MNIST(root=args.data_dir, train=False))
    out = Path(args.output_dir or tempfile.mkdtemp(prefix='gpu-check-'))
    print(f'gpu-check: torch {torch.__version__}, device {args.device}'
          + (f' ({torch.cuda.get_device_name(0)}, {args.processes} GPUs)' if args.device == 'cuda' else '')
          + f', {args.epochs} epochs, data {args.data_dir}, outputs in {out}', flush=True)
    check_single(args, out / 'single')
    output = check_distributed(args, out / 'standalone', 'standalone')
    if args.device == 'cuda':
        places = re.findall(r'^Rank \d+/\d+ \(local rank (\d+), pid \d+\) on cuda:(\d+) with (\w+)$', output, re.M)
        ok = len(places) == args.processes and all(a == b and nccl == 'nccl' for a, b, nccl in places)
        report('placement', 'ok' if ok else 'FAILED', f'{len(places)} processes: local rank = GPU, NCCL: {ok}')
    else:
        report('placement', 'skipped', 'CUDA only (each process on its own GPU with NCCL)')
    check_distributed(args, out / 'static', 'static')
    check_restart(args, out / 'restart')
    check_serve(args, out / 'single' / 'best_model.pth', out / 'serve')
    check_review(out / 'single')
    counts = {outcome: sum(o == outcome for _, o in results) for outcome in ('ok', 'FAILED', 'skipped')}
    print(f'gpu-check: {counts["ok"]} passed, {counts["FAILED"]} failed, {counts["skipped"]} skipped')
    return 1 if counts['FAILED'] else 0


if __name__ == '__main__':
    sys.exit(main())
