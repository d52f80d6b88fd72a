"""The bytes ZeRO's simulated devices hold, by kind, counted from their tensors and held to chapter 6's formulas."""
import pytest
import torch

from manualdp import cpu_devices, replicate, train_batch
from manualdp.schedule import chunk_sizes, owned_chunk
from manualdp.zero import ShardedOptimizer, state_bytes
from manualdp.zero3 import Zero3
from tests.helpers import seeded_mlp


def _batch(n=12):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,), generator=g)


def _model_bytes(net):
    return sum(p.numel() * p.element_size() for p in net.parameters())


def _zero(stage, n, optimizer=torch.optim.Adam):
    devices = cpu_devices(n)
    replicas = replicate(seeded_mlp(), devices)
    zero = ShardedOptimizer(replicas, optimizer, stage=stage, lr=1e-3)
    train_batch(*_batch(), replicas, zero.per_device(), devices)
    return zero, replicas


@pytest.mark.parametrize("n", [2, 3, 4])
def test_zero_2_holds_one_chunk_of_the_gradient_where_zero_1_holds_it_whole(n):
    model = _model_bytes(seeded_mlp())
    one, _ = _zero(1, n)
    two, replicas = _zero(2, n)
    assert one.gradient_bytes() == [model] * n  # the whole summed gradient, on every device
    chunks = [8 * chunk_sizes(model // 8, n)[owned_chunk(i, n)] for i in range(n)]
    assert two.gradient_bytes() == chunks  # its own chunk of the sum, nothing else
    assert sum(two.gradient_bytes()) == model and max(two.gradient_bytes()) <= model / n + 8
    assert all(p.grad is None for r in replicas for p in r.parameters())  # the whole gradients were let go of
    assert one.param_bytes() == two.param_bytes() == [model] * n


def test_zero_2s_chunk_of_the_gradient_is_the_chunk_of_the_sum():
    zero, replicas = _zero(2, 3, torch.optim.SGD)
    plain = replicate(seeded_mlp(), cpu_devices(3))
    train_batch(*_batch(), plain, [torch.optim.SGD(r.parameters(), lr=1e-3) for r in plain], cpu_devices(3))
    whole = torch.cat([p.grad.reshape(-1) for p in plain[0].parameters()])
    for i, (shard,) in enumerate(zero.grad_shards):
        torch.testing.assert_close(shard, whole[slice(*zero.plan.bounds(0, i))], rtol=0, atol=1e-12)
    zero.zero_grad()
    assert zero.gradient_bytes() == [0, 0, 0]


@pytest.mark.parametrize("stage", [1, 2])
def test_the_peak_of_a_step_is_what_each_kind_held_at_most(stage):
    n, model = 4, _model_bytes(seeded_mlp())
    zero, _ = _zero(stage, n)
    peak = zero.peak_bytes()
    assert [p["parameters"] for p in peak] == [model] * n
    assert [p["gradients"] for p in peak] == ([model] * n if stage == 1 else zero.gradient_bytes())
    assert [p["optimizer_state"] for p in peak] == [state_bytes(o) for o in zero.optimizers]
    assert max(p["optimizer_state"] for p in peak) <= 2 * model / n + 8 * len(zero.pieces[0])  # Adam: 2 x its chunk


def test_peak_bytes_before_any_step_says_so():
    zero = ShardedOptimizer(replicate(seeded_mlp(), cpu_devices(2)), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="after a step"):
        zero.peak_bytes()
    with pytest.raises(RuntimeError, match="after a step"):
        Zero3(replicate(seeded_mlp(), cpu_devices(2)), torch.optim.SGD, lr=0.1).peak_bytes()


def test_zero_3_with_one_unit_holds_the_whole_model_during_its_step_and_with_a_unit_per_layer_less():
    n, net = 4, seeded_mlp()
    model, largest = _model_bytes(net), max(_model_bytes(layer) for layer in net)
    peaks = {}
    for units in (None, []):
        z3 = Zero3(replicate(seeded_mlp(), cpu_devices(n)), torch.optim.Adam, units=units, lr=1e-3)
        z3.train_batch(*_batch())
        between = z3.param_bytes()
        peaks[units is None] = z3.peak_bytes()
        assert [p["optimizer_state"] for p in peaks[units is None]] == z3.state_bytes()
        # reduce-scattered after backward: the whole gradient, then its chunk of the sum beside it
        shards = [sum(t.numel() * t.element_size() for unit in device for t in unit) for device in z3.shards]
        assert [p["gradients"] for p in peaks[units is None]] == [model + s for s in shards]
        assert all(p["parameters"] >= b for p, b in zip(peaks[units is None], between))
    one_unit, per_layer = peaks[False], peaks[True]
    assert all(model <= p["parameters"] <= model + model / n + 16 for p in one_unit)  # the whole model gathered
    assert all(p["parameters"] <= model / n + 2 * largest + 16 * 3 for p in per_layer)  # its shards and two units
    assert max(p["parameters"] for p in per_layer) < min(p["parameters"] for p in one_unit)


def test_storage_bytes_counts_a_storage_once_and_names_what_is_not_a_tensor():
    from manualdp.zero import storage_bytes
    flat = torch.zeros(10, dtype=torch.float64)
    assert storage_bytes([flat[:4], flat[4:], torch.zeros(3)]) == 8 * 10 + 4 * 3
    with pytest.raises(TypeError, match="tensors must hold tensors only, got list"):
        storage_bytes([flat, [1, 2]])
