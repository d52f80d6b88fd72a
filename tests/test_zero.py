"""ZeRO-1/2 on the single controller: the same parameters as plain data parallelism and one device, 1/N of the state."""
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from manualdp import cpu_devices, replicate, train_batch
from manualdp.collectives import shard
from manualdp.schedule import chunk_sizes, owned_chunk
from manualdp.zero import ZeroRedundancyOptimizer, state_bytes

OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "adam": functools.partial(torch.optim.Adam, lr=1e-2),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
}


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def _batches(batch, steps=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]


def _flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _one_device(make, batches):
    """The reference: one model, the unsplit global batch, summed loss over the batch size."""
    net = _net()
    opt = make(net.parameters())
    out = []
    for X, y in batches:
        opt.zero_grad()
        (nn.functional.cross_entropy(net(X), y, reduction="sum") / len(X)).backward()
        opt.step()
        out.append(_flat(net))
    return out


def _data_parallel(make, batches, n, stage=None, algorithm="ring"):
    devices = cpu_devices(n)
    replicas = replicate(_net(), devices)
    if stage is None:
        opts = [make(r.parameters()) for r in replicas]
    else:
        zero = ZeroRedundancyOptimizer(replicas, make, stage=stage, algorithm=algorithm)
        opts = zero.per_device()
    out = []
    for X, y in batches:
        train_batch(X, y, replicas, opts, devices, algorithm="ring")
        flats = [_flat(r) for r in replicas]
        assert all(torch.equal(f, flats[0]) for f in flats), "replicas differ after the all-gather"
        out.append(flats[0])
    return out, (opts if stage is None else zero)


@settings(deadline=None, max_examples=12)
@given(name=st.sampled_from(sorted(OPTIMIZERS)), n=st.integers(1, 5), batch=st.integers(9, 23),
       stage=st.sampled_from([1, 2]))
def test_zero_equals_data_parallelism_and_one_device_after_every_step(name, n, batch, stage):
    batches = _batches(batch)
    make = OPTIMIZERS[name]
    one = _one_device(make, batches)
    plain, _ = _data_parallel(make, batches, n)
    zero, _ = _data_parallel(make, batches, n, stage=stage)
    for step, (a, b, c) in enumerate(zip(one, plain, zero)):
        torch.testing.assert_close(c, b, rtol=0, atol=1e-10, msg=f"step {step}: ZeRO-{stage} vs data parallel")
        torch.testing.assert_close(c, a, rtol=0, atol=1e-10, msg=f"step {step}: ZeRO-{stage} vs one device")
    assert not torch.equal(zero[0], _flat(_net())), "training did not move the parameters"


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_adam_state_per_device_is_its_shard(n, stage):
    batches = _batches(13, steps=1)
    make = OPTIMIZERS["adam"]
    _, plain = _data_parallel(make, batches, n)
    _, zero = _data_parallel(make, batches, n, stage=stage)
    total = sum(p.numel() for p in _net().parameters())
    step = torch.zeros(()).element_size()  # Adam keeps its step count as a 0-d float tensor per parameter
    params = len(list(_net().parameters()))
    assert state_bytes(plain[0]) == 2 * 8 * total + params * step
    sizes = chunk_sizes(total, n)
    assert zero.state_bytes() == [2 * 8 * sizes[owned_chunk(i, n)] + step for i in range(n)]
    assert max(zero.state_bytes()) <= state_bytes(plain[0]) / n + 2 * 8 + step


def test_stage_2_does_not_allreduce():
    # With the allreduce skipped, a stage-2 optimizer that did not reduce-scatter would step on
    # one device's gradient only: the replicas would then differ from data parallelism.
    batches = _batches(13, steps=2)
    plain, _ = _data_parallel(OPTIMIZERS["sgd"], batches, 3)
    zero, opt = _data_parallel(OPTIMIZERS["sgd"], batches, 3, stage=2)
    assert opt.reduces_gradients
    torch.testing.assert_close(zero[-1], plain[-1], rtol=0, atol=1e-10)


def test_each_device_owns_its_chunk_of_the_parameters():
    replicas = replicate(_net(), cpu_devices(3))
    zero = ZeroRedundancyOptimizer(replicas, OPTIMIZERS["adam"])
    for i, s in enumerate(zero.shards):
        assert torch.equal(s.detach(), shard(_flat(replicas[i]), i, 3))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(replicas=nn.Linear(2, 2), optimizer_class=torch.optim.SGD), TypeError, "replicas"),
    (dict(replicas=[nn.Linear(2, 2)], optimizer_class="adam"), TypeError, "optimizer_class"),
    (dict(replicas=[nn.Linear(2, 2)], optimizer_class=torch.optim.SGD, stage=3, lr=0.1), ValueError, "stage"),
])
def test_bad_input_names_the_argument(kwargs, error, match):
    replicas = kwargs.pop("replicas")
    with pytest.raises(error, match=match):
        ZeroRedundancyOptimizer(replicas, **kwargs)


def _loaders(dtype=torch.float64):
    from torch.utils.data import DataLoader, TensorDataset
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(60, 6, generator=g, dtype=dtype), torch.randint(0, 4, (60,), generator=g)
    return DataLoader(TensorDataset(X, y), batch_size=13), DataLoader(TensorDataset(X, y), batch_size=30)


@pytest.mark.parametrize("zero", [1, 2])
def test_train_with_zero_equals_train_without(zero):
    from manualdp import train
    train_iter, test_iter = _loaders()
    nets = {}
    for key in (None, zero):
        nets[key] = _net()
        train(nets[key], train_iter, test_iter, cpu_devices(3), 2, 1e-2, optimizer=torch.optim.AdamW,
              weight_decay=0.1, zero=key, progress=False, log=None)
    torch.testing.assert_close(_flat(nets[zero]), _flat(nets[None]), rtol=0, atol=1e-10)
    assert not torch.equal(_flat(nets[zero]), _flat(_net()))


@pytest.mark.parametrize("kwargs, match", [(dict(zero=3), "zero"), (dict(optimizer="adam"), "optimizer")])
def test_train_rejects_bad_optimizer_arguments(kwargs, match):
    from manualdp import train
    train_iter, test_iter = _loaders()
    with pytest.raises((ValueError, TypeError), match=match):
        train(_net(), train_iter, test_iter, cpu_devices(2), 1, 0.1, progress=False, log=None, **kwargs)


def test_cli_trains_with_zero_and_adam_and_refuses_a_bad_stage():
    import subprocess
    import sys
    run = lambda *a: subprocess.run([sys.executable, "-m", "manualdp", "train", "--dataset", "synthetic", "--model",
                                     "mlp", "--num-train", "256", "--num-test", "64", "--epochs", "1", "--devices", "2",
                                     "--no-progress", "--lr", "1e-3", *a], capture_output=True, text=True, timeout=300)
    good = run("--zero", "2", "--optimizer", "adam")
    assert good.returncode == 0, good.stderr
    assert "sec/epoch on 2 simulated CPU devices" in good.stdout
    bad = run("--zero", "3")
    assert bad.returncode == 2 and "--zero" in bad.stderr
