"""The results the scripts print and save are the right ones, checked against computations made here
the document's way: validation counts, the preprocessing, which epochs write best_model.pth, and that
only rank 0 writes. The scripts run as users run them; what they did is recomputed independently."""
import importlib
import io
import re

import pytest
import torch
from PIL import Image
from torchvision import datasets, transforms

import common
from conftest import ROOT, dist_cmd, free_port, run, run_script, script_env, start, torchrun, train_cmd

# The document's preprocessing, written out here as the document writes it: the scripts' own must equal it.
DOCUMENT_TRANSFORM = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])
FAST = ('--lr', '0.1', '--batch-size', '16', '--log-interval', '10')


def documents_validation(state, data_dir):
    """(correct, loss per sample) of weights on the test set, the document's way: one image at a time through
    its transform, the model in eval mode, CrossEntropyLoss."""
    model = common.SimpleCNN()
    model.load_state_dict(state)
    model.eval()
    dataset = datasets.MNIST(root=data_dir, train=False, transform=DOCUMENT_TRANSFORM)
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    with torch.no_grad():
        output = model(images)
    loss = torch.nn.CrossEntropyLoss(reduction='sum')(output, dataset.targets).item() / len(dataset)
    return output.argmax(1).eq(dataset.targets).sum().item(), loss


def printed_validations(stdout):
    return [(int(correct), float(loss)) for loss, correct in
            re.findall(r'^Validation Loss: (\d+\.\d{4}), Accuracy: (\d+)/200 ', stdout, re.M)]


@pytest.mark.parametrize('launch', ['single', 'torchrun-2', 'torchrun-3'])
@pytest.mark.slow
def test_printed_validation_equals_the_documents_validation_of_the_saved_weights(launch, mnist_dir, tmp_path):
    out = tmp_path / 'out'
    args = ('--data-dir', mnist_dir, '--output-dir', out, '--epochs', '1', *FAST)
    if launch == 'single':
        _, stdout, _ = run_script(train_cmd(*args))
    else:  # 200 test images over 2 or 3 ranks: shares of 100, or 67, 67 and 66
        _, stdout, _ = run(torchrun('--standalone', f'--nproc_per_node={launch[-1]}',
                                    ROOT / 'mnist_train_distributed.py', *args))
    [(correct, loss)] = printed_validations(stdout)
    state = torch.load(out / 'checkpoint.pth', weights_only=True)['model']  # the weights that were validated
    expected_correct, expected_loss = documents_validation(state, mnist_dir)
    assert correct == expected_correct, 'each test image counted once, preprocessed as the document does'
    assert abs(loss - expected_loss) < 2e-4, (loss, expected_loss)


@pytest.mark.parametrize('module_name', ['mnist_train', 'mnist_train_distributed'])
def test_each_training_scripts_data_equal_the_documents_tensors(module_name, mnist_dir):
    script = importlib.import_module(module_name)
    for train in (True, False):
        dataset = datasets.MNIST(root=mnist_dir, train=train, transform=script.transform)
        loader = common.TensorLoader(dataset, batch_size=len(dataset))
        document = datasets.MNIST(root=mnist_dir, train=train, transform=DOCUMENT_TRANSFORM)
        expected = torch.stack([document[i][0] for i in range(len(document))])
        images, labels = next(iter(loader))
        assert torch.equal(images, expected) and torch.equal(labels, document.targets)


def test_serve_gives_an_mnist_png_the_documents_tensor(mnist_dir):
    import framing
    document = datasets.MNIST(root=mnist_dir, train=False, transform=DOCUMENT_TRANSFORM)
    for i in range(50):
        buffer = io.BytesIO()
        Image.fromarray(document.data[i].numpy()).save(buffer, 'PNG')
        assert torch.equal(framing.to_tensor(buffer.getvalue())[0], document[i][0]), i


def accuracies(stdout):
    return [correct for correct, _ in printed_validations(stdout)]


def improving(accuracies, best=0):
    """The epochs whose accuracy beats every earlier one (and best): those that must write best_model.pth."""
    epochs = []
    for epoch, accuracy in enumerate(accuracies):
        if accuracy > best:
            epochs.append(epoch)
            best = accuracy
    return epochs


def saved_epochs(stdout):
    """The epochs after whose validation 'Model saved' was printed."""
    epochs, saved = [], []
    for line in stdout.splitlines():
        if line.startswith('Validation Loss'):
            epochs.append(len(epochs))
        elif line.startswith('Model saved'):
            saved.append(epochs[-1])
    return saved


@pytest.mark.parametrize('script', ['mnist_train', 'mnist_train_distributed'], ids=['single', 'distributed'])
def test_best_model_pth_is_written_only_by_epochs_that_beat_every_earlier_one(script, tmp_path):
    from conftest import make_mnist, run_main
    data = make_mnist(tmp_path / 'data', 640, 200, seed=3)
    args = ('--data-dir', data, '--lr', '0.01', '--batch-size', '64', '--log-interval', '100')
    # In this process: which epochs write best_model.pth is the run's arithmetic, not its process's.
    # A reference run of 3 epochs: its accuracies rise (a slow learning rate on hard data).
    stdout = run_main(script, *args, '--output-dir', tmp_path / 'reference', '--epochs', '3')
    first, second, third = accuracies(stdout)
    assert saved_epochs(stdout) == improving([first, second, third])
    assert first < second < third, 'the data must make the accuracy climb for the rest of this test'
    # The same run, stopped after epoch 0, then resumed with epoch 1's accuracy recorded as the best: epoch 1
    # ties with it and must not write best_model.pth (the document's `>`); epoch 2 beats it and must.
    out = tmp_path / 'out'
    run_main(script, *args, '--output-dir', out, '--epochs', '1')
    checkpoint = torch.load(out / 'checkpoint.pth', weights_only=True)
    recorded = second / 2  # percent: 200 images
    checkpoint['best_val_accuracy'] = recorded
    torch.save(checkpoint, out / 'checkpoint.pth')
    before = (out / 'best_model.pth').read_bytes()
    stdout = run_main(script, *args, '--output-dir', out, '--epochs', '2')  # epoch 1: a tie
    assert accuracies(stdout) == [second] and saved_epochs(stdout) == []
    assert (out / 'best_model.pth').read_bytes() == before, 'a worse epoch leaves best_model.pth alone'
    stdout = run_main(script, *args, '--output-dir', out, '--epochs', '3')  # epoch 2: better
    assert accuracies(stdout) == [third] and saved_epochs(stdout) == [0]
    assert f'Best accuracy {third / 2:.2f}% at epoch 2' in stdout
    best = torch.load(out / 'best_model.pth', weights_only=True)
    final = torch.load(out / 'checkpoint.pth', weights_only=True)
    assert all(torch.equal(best[k], final['model'][k]) for k in best), 'best_model.pth holds epoch 2'
    assert final['best_epoch'] == 2 and final['best_val_accuracy'] == third / 2


def test_ranks_other_than_0_write_nothing(mnist_dir, tmp_path):
    port, outs = free_port(), [tmp_path / f'out{rank}' for rank in range(2)]
    procs = [start(dist_cmd('--data-dir', mnist_dir, '--output-dir', outs[rank], '--epochs', '2', *FAST),
                   env=script_env(RANK=str(rank), WORLD_SIZE='2', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port)))
             for rank in range(2)]
    outputs = [reader.rest(timeout=180) for _, reader in procs]
    assert [proc.returncode for proc, _ in procs] == [0, 0], outputs
    assert sorted(p.name for p in outs[0].iterdir()) == ['best_model.pth', 'checkpoint.pth', 'runs']
    assert not outs[1].exists() or list(outs[1].rglob('*')) == [], list(outs[1].rglob('*'))
