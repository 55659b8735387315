"""Unit tests of common.py: the model, the data tensors and loaders, and saving."""
import argparse
import os
import shutil

import pytest
import torch
from torchvision import datasets, transforms

import common
from conftest import make_mnist


def test_model_keys_and_shapes():
    model = common.SimpleCNN()
    assert list(model.state_dict()) == [f'{layer}.{p}' for layer in ('conv1', 'conv2', 'fc1', 'fc2')
                                        for p in ('weight', 'bias')]
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


DOC_TRANSFORM = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])


class FakeMNIST:
    """What TensorLoader reads of a torchvision MNIST: data [N, 28, 28] uint8, targets, transform."""

    def __init__(self, n, labels=None):
        assert n <= 256, 'image i is filled with the value i'
        self.data = torch.arange(n).to(torch.uint8).view(n, 1, 1).expand(n, 28, 28).contiguous()
        self.targets = torch.arange(n) % 10 if labels is None else labels
        self.transform, self.raw_folder = DOC_TRANSFORM, 'fake/MNIST/raw'

    def __len__(self):
        return len(self.data)


def sample_ids(batch):
    """Which samples a batch holds (FakeMNIST image i has every pixel equal to i); checks the labels."""
    data, target = batch
    ids = (data[:, 0, 0, 0] * 0.5 + 0.5).mul(255).round().long()
    assert torch.equal(target, ids % 10), 'each image comes with its own label'
    return ids.tolist()


def epoch_ids(loader):
    return sum((sample_ids(batch) for batch in loader), [])


@pytest.mark.parametrize('train', [True, False])
def test_tensors_equal_the_documents_transform(mnist_dir, train):
    doc_dataset = datasets.MNIST(root=mnist_dir, train=train, download=False, transform=DOC_TRANSFORM)
    loader = common.TensorLoader(doc_dataset, batch_size=64, device='cpu')
    images, labels = loader.images, loader.labels
    assert images.shape == (len(doc_dataset), 1, 28, 28) and images.dtype == torch.float32
    for i in range(len(doc_dataset)):
        image, label = doc_dataset[i]
        assert torch.equal(images[i], image), f'sample {i} differs'
        assert labels[i].item() == label


def test_an_epoch_visits_each_sample_once_in_a_new_order_each_epoch():
    loader = common.TensorLoader(FakeMNIST(100), batch_size=16, shuffle=True, seed=3)
    orders = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        assert len(list(loader)) == len(loader) == 7
        seen = epoch_ids(loader)
        assert sorted(seen) == list(range(100))
        orders.append(seen)
    assert orders[0] != orders[1] != orders[2]
    loader.set_epoch(1)  # the same epoch gives the same order again, as after a restart
    assert epoch_ids(loader) == orders[1]
    # The single script's order is DistributedSampler's for a world of one (as before the redesign).
    sampler = torch.utils.data.DistributedSampler(range(100), num_replicas=1, rank=0, seed=3)
    sampler.set_epoch(1)
    assert orders[1] == list(sampler)


def test_a_shuffled_loader_starts_at_epoch_0_of_seed_0():
    sampler = torch.utils.data.DistributedSampler(range(50), num_replicas=1, rank=0)  # seed 0, epoch 0
    assert epoch_ids(common.TensorLoader(FakeMNIST(50), batch_size=16, shuffle=True)) == list(sampler)


@pytest.mark.parametrize('n, world_size', [(100, 2), (101, 3)])
def test_distributed_training_shares_are_samplers_and_cover_the_set(n, world_size):
    dataset = FakeMNIST(n)
    shares = []
    for rank in range(world_size):
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
        loader = common.TensorLoader(dataset, 8, sampler=sampler)
        sampler.set_epoch(5)
        shares.append(epoch_ids(loader))
        assert len(loader) == -(-len(sampler) // 8)
        expected = torch.utils.data.DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=0)
        expected.set_epoch(5)
        assert shares[-1] == list(expected)
    everything = sum(shares, [])
    assert set(everything) == set(range(n))
    padding = -n % world_size  # DistributedSampler repeats a few samples so all shares are equal
    assert len(everything) == n + padding
    if padding == 0:
        assert len(set(everything)) == n  # disjoint


@pytest.mark.parametrize('world_size', [1, 2, 3, 7])
def test_validation_shards_are_disjoint_and_exact(world_size):
    # The distributed script's validation sampler for each rank, as it writes it.
    dataset = FakeMNIST(250)
    parts = [epoch_ids(common.TensorLoader(dataset, 64, sampler=range(rank, 250, world_size)))
             for rank in range(world_size)]
    everything = sum(parts, [])
    assert sorted(everything) == list(range(250)) and len(everything) == 250


def test_validation_loader_keeps_order_and_last_partial_batch():
    loader = common.TensorLoader(FakeMNIST(10), batch_size=4)
    assert [sample_ids(batch) for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(loader) == 3 and len(loader.dataset) == 10


def test_labels_outside_0_to_9_are_refused():
    with pytest.raises(common.SetupError, match='labels outside 0..9'):
        common.TensorLoader(FakeMNIST(10, labels=torch.tensor([0] * 9 + [10])), batch_size=4)


def test_truncated_file_is_named(tmp_path):
    root = make_mnist(tmp_path, 20, 10)
    path = root / 'MNIST' / 'raw' / 'train-images-idx3-ubyte'
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(common.SetupError, match='train-images-idx3-ubyte is not a complete MNIST file'):
        common.prepare_mnist(root, download=False)


def test_mismatched_image_and_label_counts(tmp_path):
    root = make_mnist(tmp_path, 20, 10)
    other = make_mnist(tmp_path / 'other', 30, 10)
    raw = 'MNIST/raw/train-labels-idx1-ubyte'
    shutil.copy(other / raw, root / raw)
    with pytest.raises(common.SetupError, match='different numbers of items'):
        common.prepare_mnist(root, download=False)


def test_missing_data_without_download_says_which_files_go_where(tmp_path):
    with pytest.raises(common.SetupError) as error:
        common.prepare_mnist(tmp_path, download=False)
    message = str(error.value)
    assert str(tmp_path / 'MNIST' / 'raw') in message
    assert all(name in message for name in common.MNIST_FILES)


def test_save_atomic_replaces_whole(tmp_path):
    path = str(tmp_path / 'model.pth')
    common.save_atomic({'a': torch.ones(2)}, path)
    common.save_atomic({'a': torch.zeros(3)}, path)
    assert torch.equal(torch.load(path, weights_only=True)['a'], torch.zeros(3))
    assert os.listdir(tmp_path) == ['model.pth']


def test_a_crash_between_temp_write_and_replace_leaves_the_old_file(tmp_path, monkeypatch):
    path = str(tmp_path / 'checkpoint.pth')
    common.save_atomic({'epochs_done': 1}, path)

    def crash(src, dst):
        raise KeyboardInterrupt('killed between the write and the rename')
    monkeypatch.setattr(common.os, 'replace', crash)
    with pytest.raises(KeyboardInterrupt):
        common.save_atomic({'epochs_done': 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {'epochs_done': 1}
    # The next save goes through, over the leftover temporary file.
    common.save_atomic({'epochs_done': 3}, path)
    assert torch.load(path, weights_only=True) == {'epochs_done': 3}


def test_positive_rejects_zero_negative_and_text():
    parse = common.positive(int)
    assert parse('3') == 3
    for text in ('0', '-1', 'x', '1.5'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_positive_takes_values_up_to_its_most_and_names_a_larger_one():
    assert common.positive(float, most=common.MAX_SECONDS)('1e9') == 1e9
    assert common.positive(int, most=5)('5') == 5
    for text in ('inf', '1e99', '1000000000.5', 'nan'):
        with pytest.raises(argparse.ArgumentTypeError, match=rf"positive float of at most 1,000,000,000, got '{text}'"):
            common.positive(float, most=common.MAX_SECONDS)(text)
    assert common.positive(float)('inf') == float('inf')  # --lr: no bound; a loss gone nan says what to do


def test_seed_takes_what_torch_seeds_with_and_names_the_range_past_it():
    for value in (0, -2 ** 63, 2 ** 63 - 1):
        assert common.seed(str(value)) == value
    torch.Generator().manual_seed(2 ** 63 - 1 + 1000)  # seed + epoch: torch takes it
    for text in ('-9223372036854775809', '9223372036854775808'):
        with pytest.raises(argparse.ArgumentTypeError, match=rf"must be from -2\*\*63 to 2\*\*63 - 1, got '{text}'"):
            common.seed(text)
    with pytest.raises(ValueError):
        common.seed('1.5')


def test_positive_takes_the_smallest_values_and_names_the_bad_one():
    assert common.positive(int)('1') == 1 and common.positive(float)('0.001') == 0.001
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be a positive int, got '0'"):
        common.positive(int)('0')


@pytest.mark.parametrize('name, damage, problem', [
    ('train-images-idx3-ubyte', lambda data: b'\x00\x00\x08\x01' + data[4:],
     'its header is not that of an MNIST image file'),
    ('train-labels-idx1-ubyte', lambda data: b'\x00\x00\x08\x03' + data[4:],
     'its header is not that of an MNIST label file'),
    ('t10k-images-idx3-ubyte', lambda data: data[:8] + (29).to_bytes(4, 'big') + data[12:], 'its header is not'),
    ('t10k-labels-idx1-ubyte', lambda data: data + b'\x00', r'\d+ bytes where its header calls for \d+'),
    ('train-labels-idx1-ubyte', lambda data: data[:4] + data[4:8][::-1] + data[8:],
     r'\d+ bytes where its header calls for 335544328'),
])
def test_each_kind_of_damaged_file_is_told(name, damage, problem, tmp_path):
    root = make_mnist(tmp_path, 20, 10)
    path = root / 'MNIST' / 'raw' / name
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(common.SetupError, match=rf'{name} is not a complete MNIST file: it is truncated or corrupt '
                                                rf'\({problem}'):
        common.check_idx_file(str(path))


def test_check_idx_file_counts_the_items(tmp_path):
    root = make_mnist(tmp_path, 20, 10)
    assert common.check_idx_file(str(root / 'MNIST' / 'raw' / 'train-images-idx3-ubyte')) == 20
    assert common.check_idx_file(str(root / 'MNIST' / 'raw' / 't10k-labels-idx1-ubyte')) == 10


def test_save_atomic_registers_its_temporary_file_only_while_writing(tmp_path, monkeypatch):
    path, seen = str(tmp_path / 'best_model.pth'), []
    real_replace = os.replace
    monkeypatch.setattr(common.os, 'replace',
                        lambda src, dst: (seen.append(set(common._writing)), real_replace(src, dst)))
    common.save_atomic({'a': torch.ones(1)}, path)
    assert seen == [{path + '.tmp'}] and common._writing == set()


def test_a_failed_save_names_the_file_and_the_reason_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    import errno
    path = str(tmp_path / 'checkpoint.pth')
    common.save_atomic({'epochs_done': 1}, path)
    monkeypatch.setattr(common.os, 'fsync', lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, 'No space left')))
    with pytest.raises(common.SetupError, match=rf'could not write {path} \(No space left\)\. The previous '
                                                r'checkpoint.pth, if any, is left as it was'):
        common.save_atomic({'epochs_done': 2}, path)
    assert os.listdir(tmp_path) == ['checkpoint.pth'] and common._writing == set()
    assert torch.load(path, weights_only=True) == {'epochs_done': 1}


def test_a_file_too_short_for_a_header_is_told(tmp_path):
    for size in (0, 5):  # not even the magic number and the count
        path = tmp_path / 'train-labels-idx1-ubyte'
        path.write_bytes(b'\x00\x00\x08\x01\x00'[:size])
        with pytest.raises(common.SetupError, match='its header is not that of an MNIST label file'):
            common.check_idx_file(str(path))


def test_a_save_into_a_missing_folder_is_told_as_one_error(tmp_path):
    path = str(tmp_path / 'gone' / 'best_model.pth')  # open() fails: there is no temporary file to remove
    with pytest.raises(common.SetupError, match=rf'could not write {path} \(No such file or directory\)'):
        common.save_atomic({'a': torch.ones(1)}, path)
