"""Ranks that load only their shard: the same global batches as one loader, cut as split_batch cuts them."""
import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from torch.utils.data import DataLoader, Dataset, SubsetRandomSampler, TensorDataset

from manualdp.spmd import ShardedBatchSampler, launch, shard_loader


def _loader(n, batch_size, drop_last, seed=3, dataset=None):
    dataset = dataset if dataset is not None else TensorDataset(torch.arange(n).float().view(n, 1), torch.arange(n))
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=drop_last,
                      generator=torch.Generator().manual_seed(seed))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60), batch_size=st.integers(1, 17), world_size=st.integers(1, 4), drop_last=st.booleans())
def test_shards_of_every_rank_put_together_are_the_global_batches(n, batch_size, world_size, drop_last):
    whole = [y.tolist() for _, y in _loader(n, batch_size, drop_last)]
    whole = [b for b in whole if len(b) >= world_size]  # too small to give every rank an example: dropped alike
    per_rank = [[y.tolist() for _, y in shard_loader(_loader(n, batch_size, drop_last), r, world_size)]
                for r in range(world_size)]
    assert all(len(batches) == len(whole) for batches in per_rank)
    for i, batch in enumerate(whole):
        shards = [per_rank[r][i] for r in range(world_size)]
        assert sum(shards, []) == batch
        sizes = [len(s) for s in shards]
        assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1  # split_batch's rule
        sampler = shard_loader(_loader(n, batch_size, drop_last), 0, world_size).batch_sampler
        assert sampler.global_size(i) == len(batch)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60), batch_size=st.integers(1, 17), world_size=st.integers(1, 4), drop_last=st.booleans())
@example(n=10, batch_size=4, world_size=2, drop_last=True)   # a short last batch, dropped
@example(n=10, batch_size=4, world_size=2, drop_last=False)  # a short last batch, kept
@example(n=9, batch_size=4, world_size=2, drop_last=False)   # a last batch of 1: fewer than the ranks, dropped
def test_len_is_the_number_of_batches_each_rank_yields(n, batch_size, world_size, drop_last):
    for rank in range(world_size):
        loader = shard_loader(_loader(n, batch_size, drop_last), rank, world_size)
        assert len(loader) == len(list(loader))


class Counting(Dataset):
    """Counts which examples were read."""

    def __init__(self, n):
        self.n, self.read = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.read.append(i)
        return torch.tensor([float(i)]), i


def test_a_rank_reads_only_its_shard():
    data = Counting(40)
    for _ in shard_loader(_loader(40, 8, True, dataset=data), 1, 4):
        pass
    assert len(data.read) == 40 // 4


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="rank must index the ranks"):
        ShardedBatchSampler(range(4), 2, False, 2, 2)
    with pytest.raises(TypeError, match="loader must be a torch DataLoader"):
        shard_loader([1, 2], 0, 2)


def test_a_loader_shuffled_by_the_global_generator_is_refused():
    # Ranks' global generators differ, so without its own generator each rank would shuffle its own way.
    data = TensorDataset(torch.arange(8.0))
    unseeded = [DataLoader(data, batch_size=4, shuffle=True),
                DataLoader(data, batch_size=4, sampler=SubsetRandomSampler(range(8)))]
    for loader in unseeded:
        with pytest.raises(ValueError, match="global random generator .* generator=torch.Generator"):
            shard_loader(loader, 0, 2)
    assert len(shard_loader(DataLoader(data, batch_size=4), 0, 2)) == 2  # in order: nothing random to agree on


def _train(sharded: bool):
    import manualdp
    from manualdp.runners.loop import train_spmd

    torch.manual_seed(0)
    net = manualdp.mlp(in_features=6, hidden=8, num_classes=3).double()
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(45, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (45,), generator=g)
    loader = DataLoader(TensorDataset(X, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(2))
    if sharded:
        loader = shard_loader(loader, torch.distributed.get_rank(), torch.distributed.get_world_size())
    train_spmd(net, loader, [(X, y)], 2, 0.3, momentum=0.9, bucket_cap_mb=None, progress=False, log=None)
    return [p.detach().clone() for p in net.parameters()]


def test_sharded_loading_trains_bitwise_like_loading_the_whole_batch():
    # 45 examples in batches of 16: the last global batch has 13, uneven across 2 ranks.
    whole = launch(_train, 2, (False,), timeout=120)
    sharded = launch(_train, 2, (True,), timeout=120)
    for a, b in zip(whole[0], sharded[0]):
        assert torch.equal(a, b)
    for a, b in zip(sharded[0], sharded[1]):
        assert torch.equal(a, b)


def test_data_bench_times_both_kinds_on_the_same_batches(tmp_path, capsys):
    import json

    from bench.data import main

    out = tmp_path / "data.json"
    assert main(["--world-sizes", "2", "3", "--batch-size", "32", "--num-train", "320", "--rounds", "1",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["world_size"] for r in result["rows"]] == [2, 3]
    for r in result["rows"]:
        assert len(r["times"]["whole"]) == len(r["times"]["shard"]) == 1
        assert r["speedup"] == r["whole_s"] / r["shard_s"]
    assert "saved ms/step" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--world-sizes", "0"])
