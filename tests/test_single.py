"""mnist_train.py end to end, run as a user runs it: logs, TensorBoard, checkpoints, resume; and both scripts' CPU
threads in a container with a CPU quota."""
import re
import signal
import sys

import pytest
import torch
from torchvision import datasets, transforms

import common
from conftest import ROOT, read_review, read_scalars, run, run_main, run_script, script_env, start, train_cmd

FAST = ('--lr', '0.1', '--batch-size', '16', '--log-interval', '10')  # learns the tiny set in 3 epochs


def test_trains_logs_and_saves_like_the_document(mnist_dir, tmp_path):
    out = tmp_path / 'out'
    _, stdout, _ = run(train_cmd('--data-dir', mnist_dir, '--output-dir', out, '--epochs', '3', *FAST))

    train_lines = re.findall(r'^Train Epoch: (\d+) \[(\d+)/640 \((\d+)%\)\]\tLoss: (\d+\.\d{6})$', stdout, re.M)
    assert [(e, n, p) for e, n, p, _ in train_lines] == [
        (str(e), str(n), str(p)) for e in range(3) for n, p in ((0, 0), (160, 25), (320, 50), (480, 75))]
    val_lines = re.findall(r'^Validation Loss: (\d+\.\d{4}), Accuracy: (\d+)/200 \((\d+)%\)$', stdout, re.M)
    assert len(val_lines) == 3
    accuracies = [int(correct) / 2 for _, correct, _ in val_lines]
    assert accuracies[-1] > 60, 'clearly above chance (10%) on the learnable tiny set'
    saved = re.findall(r'^Model saved with accuracy: (\d+\.\d\d)%$', stdout, re.M)
    assert float(saved[-1]) == max(accuracies)
    assert len(re.findall(r'^Epoch \d done in \d+\.\d\ds \(\d+ samples/s\)$', stdout, re.M)) == 3
    assert re.search(rf'^Best accuracy {max(accuracies):.2f}% at epoch \d, saved in {out}/best_model.pth; '
                     r'3 epochs in \d+\.\ds$', stdout, re.M)
    assert stdout.endswith('Training complete. writer.close()\n')

    # TensorBoard, read back with its own reader: the document's tags and steps.
    scalars = read_scalars(out / 'runs' / 'mnist_experiment')
    assert [step for step, _ in scalars['Loss/train']] == [e * 40 + b for e in range(3) for b in (0, 10, 20, 30)]
    assert [round(v, 6) for _, v in scalars['Loss/train']] == [float(l) for *_, l in train_lines]
    assert [step for step, _ in scalars['Accuracy/validation']] == [0, 1, 2]
    assert [v for _, v in scalars['Accuracy/validation']] == accuracies
    assert [round(v, 4) for _, v in scalars['Loss/validation']] == [float(l) for l, _, _ in val_lines]
    check_review(out, best_correct=max(int(correct) for _, correct, _ in val_lines), total=200, step=3)

    # best_model.pth: a plain state_dict that loads safely into the model and gives the best accuracy.
    state = torch.load(out / 'best_model.pth', weights_only=True)
    model = common.SimpleCNN()
    model.load_state_dict(state)
    val_dataset = datasets.MNIST(root=mnist_dir, train=False, transform=transforms.Compose([
        transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))]))
    with torch.no_grad():
        correct = sum((model(image[None]).argmax(dim=1) == label).item() for image, label in val_dataset)
    assert correct / 2 == max(accuracies)


def test_a_finished_run_says_so_and_changes_nothing(mnist_dir, tmp_path):
    out = tmp_path / 'out'  # in this process: the runs' outputs are the point, not their processes
    run_main('mnist_train', '--data-dir', mnist_dir, '--output-dir', out, '--epochs', '2', *FAST)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    stdout = run_main('mnist_train', '--data-dir', mnist_dir, '--output-dir', out, '--epochs', '2', *FAST)
    assert stdout.startswith('Training already complete')
    assert 'Train Epoch' not in stdout
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


@pytest.mark.slow
def test_resume_after_a_kill_mid_epoch_matches_an_uninterrupted_run(mnist_big_dir, tmp_path):
    args = ('--data-dir', mnist_big_dir, '--epochs', '3', '--log-interval', '20')
    run_main('mnist_train', *args, '--output-dir', tmp_path / 'straight')  # the reference, in this process

    out = tmp_path / 'interrupted'
    proc, reader = start(train_cmd(*args, '--output-dir', out))
    reader.wait_for(lambda line: line.startswith('Train Epoch: 1 [1280/'))
    proc.send_signal(signal.SIGKILL)
    assert 'Epoch 1 done' not in reader.rest(timeout=30), 'the kill came after epoch 1 ended'

    _, stdout, _ = run_script(train_cmd(*args, '--output-dir', out))
    assert stdout.startswith('Resuming from epoch 1 ')
    assert re.findall(r'^Epoch (\d) done', stdout, re.M) == ['1', '2']

    # The same model and the same logs as if never interrupted (CPU arithmetic is deterministic).
    for name in ('best_model.pth', 'checkpoint.pth'):
        straight = torch.load(tmp_path / 'straight' / name, weights_only=True)
        resumed = torch.load(out / name, weights_only=True)
        if name == 'checkpoint.pth':
            assert resumed['epochs_done'] == straight['epochs_done'] == 3
            straight, resumed = straight['model'], resumed['model']
        assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    straight_logs = read_scalars(tmp_path / 'straight' / 'runs' / 'mnist_experiment')
    resumed_logs = read_scalars(out / 'runs' / 'mnist_experiment')
    assert resumed_logs == straight_logs  # no step twice, none missing


def test_no_resume_starts_over_and_keeps_the_earlier_best_model(mnist_dir, tmp_path):
    out = tmp_path / 'out'  # in this process: the runs' outputs are the point, not their processes
    run_main('mnist_train', '--data-dir', mnist_dir, '--output-dir', out, '--epochs', '1', *FAST)
    earlier = (out / 'best_model.pth').read_bytes()
    stdout = run_main('mnist_train', '--data-dir', mnist_dir, '--output-dir', out, '--epochs', '1', '--no-resume',
                      *FAST)
    assert 'Resuming' not in stdout and 'Epoch 0 done' in stdout
    assert f'the earlier run is kept as best_model.pth.previous and checkpoint.pth.previous in {out}' in stdout
    assert (out / 'best_model.pth.previous').read_bytes() == earlier
    assert (out / 'best_model.pth').exists()


def check_review(out, best_correct, total, step):
    """TensorBoard's other tabs for the best model: every validation image counted once, as printed."""
    review = read_review(out / 'runs' / 'mnist_experiment')
    assert sorted(review['images']) == ['Best model/mistakes (true > read as), the surest first']
    assert all(steps == [step] for steps in review['images'].values()), review['images']
    assert review['pr_curves'] == [f'Best model/digit {d}' for d in range(10)]
    assert review['graph'] and review['hparams']
    matrix = review['matrix']
    assert sum(map(sum, matrix)) == total and sum(matrix[d][d] for d in range(10)) == best_correct, review['text']
    assert review['mistakes'] == total - best_correct
    return review


def test_training_on_adds_a_review_at_the_new_step_and_a_finished_run_none(mnist_dir, tmp_path):
    out = tmp_path / 'out'  # processes: in one process the runs' event files' names may sort out of their order
    run(train_cmd('--data-dir', mnist_dir, '--output-dir', out, '--epochs', '1', *FAST))
    run(train_cmd('--data-dir', mnist_dir, '--output-dir', out, '--epochs', '1', *FAST))  # already complete
    _, stdout, _ = run(train_cmd('--data-dir', mnist_dir, '--output-dir', out, '--epochs', '2', *FAST))
    review = read_review(out / 'runs' / 'mnist_experiment')
    assert all(steps == [1, 2] for steps in review['images'].values()), review['images']  # nothing twice


def test_a_real_tensorboard_shows_the_new_tabs(mnist_dir, tmp_path):
    import json
    import sys
    import time
    import urllib.request
    from conftest import free_port
    out = tmp_path / 'out'
    run_script(train_cmd('--data-dir', mnist_dir, '--output-dir', out, '--epochs', '1', *FAST))
    port = free_port()
    proc, reader = start([sys.executable, '-m', 'tensorboard.main', '--logdir', out / 'runs', '--host', '127.0.0.1',
                          '--port', str(port)])
    get = lambda path: json.loads(urllib.request.urlopen(f'http://127.0.0.1:{port}{path}', timeout=30).read())
    try:
        for _ in range(300):  # serving, and the run loaded
            try:
                if get('/data/plugins_listing')['images']['enabled']:
                    break
            except (OSError, KeyError):
                pass
            time.sleep(0.2)
        listing = get('/data/plugins_listing')
        assert all(listing[name]['enabled'] for name in ('scalars', 'images', 'pr_curves', 'graphs', 'hparams',
                                                          'text')), listing
        assert sorted(get('/data/plugin/images/tags')['mnist_experiment']) == [
            'Best model/mistakes (true > read as), the surest first']
        assert sorted(get('/data/plugin/pr_curves/tags')['mnist_experiment']) == \
            [f'Best model/digit {d}' for d in range(10)]
        assert sorted(get('/data/plugin/scalars/tags')['mnist_experiment'])[:3] == [
            'Accuracy/validation', 'Loss/train', 'Loss/validation']
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# A script run in a container CPU quota of the test's own (a cgroup v2 cpu.max of 1 CPU), which torch does not see.
QUOTA_RUN = ('import atexit, common, runpy, sys, torch; print("torch threads at start:", torch.get_num_threads()); '
             'common.CGROUP = sys.argv.pop(1); sys.argv.pop(0); '
             'atexit.register(lambda: print("torch threads at exit:", torch.get_num_threads())); '
             'runpy.run_path(sys.argv[0], run_name="__main__")')


@pytest.mark.one_leg('newest')  # the scripts' call; the thread logic's unit tests run in both legs
@pytest.mark.parametrize('script', ['mnist_train.py', 'mnist_train_distributed.py'])
def test_in_a_container_with_a_cpu_quota_torch_runs_as_many_threads_as_it_has_cpus(script, mnist_dir, tmp_path):
    (tmp_path / 'cgroup').mkdir()
    (tmp_path / 'cgroup' / 'cpu.max').write_text('100000 100000\n')  # docker --cpus 1
    env = script_env(PYTHONPATH=str(ROOT))
    del env['OMP_NUM_THREADS']
    _, stdout, _ = run([sys.executable, '-c', QUOTA_RUN, tmp_path / 'cgroup', ROOT / script, '--data-dir', mnist_dir,
                        '--output-dir', tmp_path / 'out', '--epochs', '1', *FAST], env=env)
    threads = int(re.search(r'^torch threads at start: (\d+)$', stdout, re.M)[1])
    if threads == 1:
        pytest.skip('torch starts one thread on this machine: no more than the quota')
    assert f'\nCPU threads: 1, the CPUs this process may use (torch would start {threads}).\n' in stdout
    assert stdout.endswith('Training complete. writer.close()\ntorch threads at exit: 1\n')
