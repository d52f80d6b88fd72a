import pytest
import torch
from hypothesis import given

from manualdp import cpu_devices, split_batch
from manualdp.runners.grader.properties import STRATEGIES, split_property
from manualdp.split import shard_sizes


@given(**STRATEGIES["split_batch"])
def test_shards_concatenate_back_and_are_balanced(n, extra, features, dtype):
    # The property `manualdp check split_batch` grades a student's split with: shard i is the i-th
    # near-equal slice (the extra examples go to the first shards), on devices[i], in its own memory.
    split_property(split_batch, n, extra, features, dtype)
    X, y = torch.randn(n + extra, features, dtype=dtype), torch.arange(n + extra)
    X_shards, y_shards = split_batch(X, y, cpu_devices(n))
    assert torch.equal(torch.cat(X_shards), X) and torch.equal(torch.cat(y_shards), y)
    assert [len(s) for s in X_shards] == shard_sizes(n + extra, n)


@pytest.mark.parametrize("batch, n, expected", [
    (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
    (5, 2, [[0, 1, 2], [3, 4]]),
    (4, 4, [[0], [1], [2], [3]]),
    (6, 1, [[0, 1, 2, 3, 4, 5]]),
    (9, 4, [[0, 1, 2], [3, 4], [5, 6], [7, 8]]),
])
def test_shards_are_the_ones_written_out_by_hand(batch, n, expected):
    X, y = torch.arange(batch).float().view(batch, 1), torch.arange(batch)
    X_shards, y_shards = split_batch(X, y, cpu_devices(n))
    assert [s.tolist() for s in y_shards] == expected
    assert [s.view(-1).long().tolist() for s in X_shards] == expected


def test_shards_do_not_share_memory_with_the_batch():
    X, y = torch.zeros(6, 2), torch.zeros(6)
    X_shards, _ = split_batch(X, y, cpu_devices(3))
    X_shards[0].fill_(1.0)
    assert X.sum() == 0  # writing a shard must not touch the caller's batch


@pytest.mark.parametrize("n, batch", [(4, 3), (8, 1), (2, 0)])
def test_batch_smaller_than_device_count_is_an_error(n, batch):
    with pytest.raises(ValueError, match=f"batch of {batch} is smaller than the {n} devices"):
        split_batch(torch.zeros(batch, 2), torch.zeros(batch), cpu_devices(n))


def test_mismatched_lengths_are_an_error():
    with pytest.raises(ValueError, match=r"len\(X\)=5 and len\(y\)=4"):
        split_batch(torch.zeros(5, 2), torch.zeros(4), cpu_devices(2))


@pytest.mark.parametrize("devices, error", [([], ValueError), ("cpu", TypeError), (["nonsense"], TypeError)])
def test_bad_devices_are_an_error(devices, error):
    with pytest.raises(error, match="devices"):
        split_batch(torch.zeros(4, 2), torch.zeros(4), devices)


def test_non_tensor_input_is_an_error():
    with pytest.raises(TypeError, match="X must be a torch.Tensor, got list"):
        split_batch([1, 2], torch.zeros(2), cpu_devices(1))
