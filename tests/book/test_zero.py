"""ZeRO-1/2 on the single controller: the same parameters as plain data parallelism and one device, 1/N of the state."""
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from manualdp import cpu_devices, replicate, train_batch
from manualdp.collectives import chunk
from manualdp.schedule import chunk_sizes, owned_chunk
from manualdp.zero import ShardedOptimizer, state_bytes
from tests.helpers import Branchy, Crash, CrashingLoss, seeded_mlp, small_mlp, uneven_mlp

OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "adam": functools.partial(torch.optim.Adam, lr=1e-2),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
}


def _batches(batch, steps=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]


def _flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _one_device(make, batches):
    """The reference: one model, the unsplit global batch, summed loss over the batch size."""
    net = seeded_mlp()
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
    replicas = replicate(seeded_mlp(), devices)
    if stage is None:
        opts = [make(r.parameters()) for r in replicas]
    else:
        zero = ShardedOptimizer(replicas, make, stage=stage, algorithm=algorithm)
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
    assert not torch.equal(zero[0], _flat(seeded_mlp())), "training did not move the parameters"


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_adam_state_per_device_is_its_shard(n, stage):
    batches = _batches(13, steps=1)
    make = OPTIMIZERS["adam"]
    _, plain = _data_parallel(make, batches, n)
    _, zero = _data_parallel(make, batches, n, stage=stage)
    total = sum(p.numel() for p in seeded_mlp().parameters())
    step = torch.zeros(()).element_size()  # Adam keeps its step count as a 0-d float tensor per parameter
    params = len(list(seeded_mlp().parameters()))
    assert state_bytes(plain[0]) == 2 * 8 * total + params * step
    sizes = chunk_sizes(total, n)
    # one piece per parameter a device's chunk overlaps, each with its own step count
    assert zero.state_bytes() == [2 * 8 * sizes[owned_chunk(i, n)] + step * len(zero.pieces[i]) for i in range(n)]
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
    replicas = replicate(seeded_mlp(), cpu_devices(3))
    zero = ShardedOptimizer(replicas, OPTIMIZERS["adam"])
    for i, pieces in enumerate(zero.pieces):
        mine = torch.cat([piece.detach() for *_, piece in pieces])
        assert torch.equal(mine, chunk(_flat(replicas[i]), i, 3))
        # the pieces are views of the replica's own parameters, not copies
        first = dict(zip(range(len(zero.params[i])), zero.params[i]))[pieces[0][0]]
        assert pieces[0][3].untyped_storage().data_ptr() == first.untyped_storage().data_ptr()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(replicas=nn.Linear(2, 2), optimizer_class=torch.optim.SGD), TypeError, "replicas"),
    (dict(replicas=[nn.Linear(2, 2)], optimizer_class="adam"), TypeError, "optimizer_class"),
    (dict(replicas=[nn.Linear(2, 2)], optimizer_class=torch.optim.SGD, stage=3, lr=0.1), ValueError, "stage"),
])
def test_bad_input_names_the_argument(kwargs, error, match):
    replicas = kwargs.pop("replicas")
    with pytest.raises(error, match=match):
        ShardedOptimizer(replicas, **kwargs)


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
        nets[key] = seeded_mlp()
        train(nets[key], train_iter, test_iter, cpu_devices(3), 2, 1e-2, optimizer=torch.optim.AdamW,
              weight_decay=0.1, zero=key, progress=False, log=None)
    torch.testing.assert_close(_flat(nets[zero]), _flat(nets[None]), rtol=0, atol=1e-10)
    assert not torch.equal(_flat(nets[zero]), _flat(seeded_mlp()))


@pytest.mark.parametrize("kwargs, match", [(dict(zero=4), "zero"), (dict(optimizer="adam"), "optimizer")])
def test_train_rejects_bad_optimizer_arguments(kwargs, match):
    from manualdp import train
    train_iter, test_iter = _loaders()
    with pytest.raises((ValueError, TypeError), match=match):
        train(seeded_mlp(), train_iter, test_iter, cpu_devices(2), 1, 0.1, progress=False, log=None, **kwargs)


def test_cli_trains_with_zero_and_adam_and_refuses_a_bad_stage():
    import subprocess
    import sys
    run = lambda *a: subprocess.run([sys.executable, "-m", "manualdp", "train", "--dataset", "synthetic", "--model",
                                     "mlp", "--num-train", "256", "--num-test", "64", "--epochs", "1", "--devices", "2",
                                     "--no-progress", "--lr", "1e-3", *a], capture_output=True, text=True, timeout=300)
    good = run("--zero", "2", "--optimizer", "adam")
    assert good.returncode == 0, good.stderr
    assert "sec/epoch on 2 simulated CPU devices" in good.stdout
    bad = run("--zero", "4")
    assert bad.returncode == 2 and "--zero" in bad.stderr
    three = run("--zero", "3", "--optimizer", "adam")
    assert three.returncode == 0 and "on 2 simulated CPU devices" in three.stdout, three.stderr
    traced = run("--zero", "3", "--trace", "t.json")
    assert traced.returncode == 2 and "--zero 3" in traced.stderr and "--trace" in traced.stderr


# --- what a new user tries: resume, unused parameters, NaN, groups, schedulers, dtypes, uneven shards ---

def _uneven_net():
    """56 + 45 + 24 + 2 = 127 elements, 1 mod 3: ceil(127/3) = 43-element chunks would leave the last 41."""
    net = uneven_mlp()
    net.register_parameter("unused", nn.Parameter(torch.zeros(2, dtype=torch.float64)))  # never gets a gradient
    return net


def test_shards_are_balanced_when_the_size_is_1_mod_3():
    net = _uneven_net()
    total = sum(p.numel() for p in net.parameters())
    assert total % 3 == 1
    zero = ShardedOptimizer(replicate(net, cpu_devices(3)), OPTIMIZERS["sgd"])
    sizes = [sum(hi - lo for _, lo, hi, _ in pieces) for pieces in zero.pieces]
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1, sizes


def _resume_loaders():
    from torch.utils.data import DataLoader, TensorDataset
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(52, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (52,), generator=g)
    return (DataLoader(TensorDataset(X, y), batch_size=13, shuffle=True, generator=torch.Generator().manual_seed(4)),
            DataLoader(TensorDataset(X, y), batch_size=26))


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name, kw", [("sgd", dict(momentum=0.9, weight_decay=1e-2)), ("adam", {}),
                                      ("adamw", dict(weight_decay=0.1))])
def test_resume_equals_an_uninterrupted_run_on_uneven_shards(tmp_path, stage, name, kw):
    from manualdp import train
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    n, epochs = 3, 2  # 4 batches an epoch; the stop comes mid-epoch 2, after a checkpoint at step 6

    def run(**extra):
        net = _uneven_net()
        train(net, *_resume_loaders(), cpu_devices(n), epochs, 1e-2, optimizer=cls, zero=stage, progress=False,
              log=None, **kw, **extra)
        return _flat(net)

    ref = run()
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(Crash):
        run(checkpoint_dir=ckpt, checkpoint_every=3, loss_fn=CrashingLoss(7 * n + 1))
    resumed = run(checkpoint_dir=ckpt, checkpoint_every=3, resume=True)
    assert torch.equal(resumed, ref), "a resumed ZeRO run differs from an uninterrupted one"
    assert not torch.equal(ref, _flat(_uneven_net()))


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_parameter_with_no_gradient_is_skipped_as_torch_skips_it(stage, name):
    devices = cpu_devices(3)
    make = OPTIMIZERS[name]
    plain, sharded = replicate(Branchy(), devices), replicate(Branchy(), devices)
    opts = [make(r.parameters()) for r in plain]
    zero = ShardedOptimizer(sharded, make, stage=stage)
    for step, (X, y) in enumerate(_batches(12, steps=5)):
        for r in plain + sharded:
            r.use_side = step % 2 == 0
        train_batch(X, y, plain, opts, devices)
        train_batch(X, y, sharded, zero.per_device(), devices)
        assert all(p.grad is None for p in plain[0].side.parameters()) == (step % 2 == 1)
        for p, q in zip(plain[0].parameters(), sharded[0].parameters()):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-12, msg=f"step {step}")


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_zero_2_with_a_nan_on_one_device_raises_or_skips(mode):
    from manualdp.guard import NonFiniteGradientError
    devices = cpu_devices(3)
    replicas = replicate(seeded_mlp(), devices)
    zero = ShardedOptimizer(replicas, OPTIMIZERS["sgd"], stage=2)
    before = _flat(replicas[0])
    X, y = _batches(12, steps=1)[0]
    X[-1, 0] = float("nan")  # the last shard only: devices 0 and 1 hold finite gradients
    if mode == "raise":
        with pytest.raises(NonFiniteGradientError):
            train_batch(X, y, replicas, zero.per_device(), devices, nonfinite="raise")
    else:
        assert train_batch(X, y, replicas, zero.per_device(), devices, nonfinite="skip").skipped
    for r in replicas:
        assert torch.isfinite(_flat(r)).all() and torch.equal(_flat(r), before)


def test_param_groups_and_a_scheduler_work_as_on_plain_data_parallelism():
    devices = cpu_devices(3)
    plain, sharded = replicate(seeded_mlp(), devices), replicate(seeded_mlp(), devices)

    def groups(net):  # the last layer learns 10x slower, without weight decay
        return [{"params": list(net[0].parameters()) + list(net[2].parameters())},
                {"params": list(net[4].parameters()), "lr": 1e-3, "weight_decay": 0.0}]

    opts = [torch.optim.SGD(groups(r), lr=1e-2, momentum=0.9, weight_decay=1e-2) for r in plain]
    zero = ShardedOptimizer(sharded, torch.optim.SGD, param_groups=groups(sharded[0]), lr=1e-2, momentum=0.9,
                                   weight_decay=1e-2)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in opts]
    zsched = torch.optim.lr_scheduler.StepLR(zero, step_size=1, gamma=0.5)
    for X, y in _batches(12, steps=4):
        train_batch(X, y, plain, opts, devices)
        train_batch(X, y, sharded, zero.per_device(), devices)
        for s in scheds + [zsched]:
            s.step()
    assert [g["lr"] for g in zero.param_groups] == [g["lr"] for g in opts[0].param_groups] == [1e-2 / 16, 1e-3 / 16]
    torch.testing.assert_close(_flat(sharded[0]), _flat(plain[0]), rtol=0, atol=1e-12)


def test_mixed_float32_and_float64_keep_their_dtypes():
    def net():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 4).double())
        return m

    class Cast(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net()

        def forward(self, x):
            return self.net[1](self.net[0](x.float()).double())

    devices = cpu_devices(2)
    plain, sharded = replicate(Cast(), devices), replicate(Cast(), devices)
    opts = [OPTIMIZERS["adam"](r.parameters()) for r in plain]
    zero = ShardedOptimizer(sharded, OPTIMIZERS["adam"], stage=2)
    for X, y in _batches(10, steps=3):
        train_batch(X, y, plain, opts, devices)
        train_batch(X, y, sharded, zero.per_device(), devices)
    assert [p.dtype for p in sharded[0].parameters()] == [p.dtype for p in plain[0].parameters()] == \
        [torch.float32] * 2 + [torch.float64] * 2
    for p, q in zip(plain[0].parameters(), sharded[0].parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6 if p.dtype == torch.float32 else 1e-12)


def test_load_state_dict_refuses_another_devices_shard_and_changes_nothing():
    replicas = replicate(_uneven_net(), cpu_devices(3))
    zero = ShardedOptimizer(replicas, OPTIMIZERS["adam"])
    X, y = _batches(12, steps=1)[0]
    train_batch(X, y, replicas, zero.per_device(), cpu_devices(3))
    state = zero.state_dict()
    sizes = [sum(hi - lo for _, lo, hi, _ in p) for p in zero.pieces]
    i, j = next((i, j) for i in range(3) for j in range(3) if sizes[i] != sizes[j])
    swapped = dict(state, shards=list(state["shards"]))
    swapped["shards"][i], swapped["shards"][j] = state["shards"][j], state["shards"][i]
    before = [{k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
              for opt in zero.optimizers for s in opt.state.values()]
    with pytest.raises(ValueError, match="shard"):
        zero.load_state_dict(swapped)
    after = [{k: v for k, v in s.items() if isinstance(v, torch.Tensor)} for opt in zero.optimizers
             for s in opt.state.values()]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before, after) for k in a)
    with pytest.raises(ValueError, match="devices"):
        zero.load_state_dict(dict(state, num_devices=2))


# --- ZeRO-3 in the training loop (manualdp.zero3 under `train`) ---

def test_train_with_zero_3_equals_train_without_and_resumes_exactly(tmp_path):
    from manualdp import train
    kw = dict(optimizer=torch.optim.Adam, progress=False, log=None)
    nets = {}
    for zero in (None, 3):
        nets[zero] = _uneven_net()
        train(nets[zero], *_resume_loaders(), cpu_devices(3), 2, 1e-2, zero=zero,
              nonfinite=None if zero == 3 else "raise", **kw)
    torch.testing.assert_close(_flat(nets[3]), _flat(nets[None]), rtol=0, atol=1e-10)
    assert not torch.equal(_flat(nets[3]), _flat(_uneven_net()))
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(Crash):  # 4 steps an epoch: stop in step 7, after the checkpoint of step 6 (one loss per device)
        train(_uneven_net(), *_resume_loaders(), cpu_devices(3), 2, 1e-2, zero=3, nonfinite=None, checkpoint_dir=ckpt,
              checkpoint_every=3, loss_fn=CrashingLoss(7 * 3 + 1), **kw)
    from manualdp.support.checkpoint import load_latest
    assert load_latest(ckpt)["global_step"] == 6  # the resume below starts from a checkpoint, not from scratch
    resumed = _uneven_net()
    train(resumed, *_resume_loaders(), cpu_devices(3), 2, 1e-2, zero=3, nonfinite=None, checkpoint_dir=ckpt,
          checkpoint_every=3, resume=True, **kw)
    assert torch.equal(_flat(resumed), _flat(nets[3])), "a resumed ZeRO-3 run differs from an uninterrupted one"


@pytest.mark.parametrize("kwargs, match", [(dict(trace="t.json"), "trace"),
                                           (dict(algorithm="tree"), r"algorithm='tree' with zero=3.*'ring' only"),
                                           (dict(algorithm="naive"), r"algorithm='naive' with zero=3")])
def test_train_with_zero_3_refuses_what_it_lacks_by_name(tmp_path, kwargs, match):
    from manualdp import train
    net = seeded_mlp()
    with pytest.raises(ValueError, match=match):
        train(net, *_loaders(), cpu_devices(2), 1, 0.1, zero=3, progress=False, log=None, **kwargs)
    assert torch.equal(_flat(net), _flat(seeded_mlp()))


def test_train_with_zero_3_records_the_ring_it_runs_and_guards_as_without_zero():
    """`algorithm` left out is "ring" with zero=3 (it was recorded as "naive"); `nonfinite` (it was refused, and
    left out it let a NaN through) stops, or skips the same steps as without zero."""
    from torch.utils.data import DataLoader, TensorDataset
    from manualdp import train
    from manualdp.guard import NonFiniteGradientError
    history = train(seeded_mlp(), *_loaders(), cpu_devices(2), 1, 0.1, zero=3, progress=False, log=None)
    assert history.config["algorithm"] == "ring"
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(52, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (52,), generator=g)
    X[20, 3] = float("nan")  # in the second batch of 13
    data = DataLoader(TensorDataset(X, y), batch_size=13), DataLoader(TensorDataset(X[:13], y[:13]), batch_size=13)
    with pytest.raises(NonFiniteGradientError, match=r"parameter '0.weight' at step 1"):
        train(seeded_mlp(), *data, cpu_devices(3), 1, 0.1, zero=3, progress=False, log=None)
    nets, said = {}, {}
    for zero in (None, 3):
        nets[zero], said[zero] = seeded_mlp(), []
        train(nets[zero], *data, cpu_devices(3), 2, 0.1, zero=zero, nonfinite="skip", progress=False,
              log=said[zero].append)
    assert [m for m in said[3] if "skipped" in m] == [m for m in said[None] if "skipped" in m] != []
    torch.testing.assert_close(_flat(nets[3]), _flat(nets[None]), rtol=0, atol=1e-10)
    assert torch.isfinite(_flat(nets[3])).all() and not torch.equal(_flat(nets[3]), _flat(seeded_mlp()))


# ---------------------------------------------------------------- planted bugs slipped past these (issue 20)

def test_a_loaded_state_brings_back_the_schedulers_learning_rate():
    """A resumed run steps with the lr its scheduler had reached, not the one the optimizer was built with."""
    devices = cpu_devices(3)
    first, again = replicate(small_mlp(), devices), replicate(small_mlp(), devices)
    zero = ShardedOptimizer(first, torch.optim.SGD, lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(zero, step_size=1, gamma=0.1)
    (X, y), (X2, y2) = _batches(9, steps=2)
    train_batch(X, y, first, zero.per_device(), devices)
    scheduler.step()
    resumed = ShardedOptimizer(again, torch.optim.SGD, lr=0.1, momentum=0.9)
    for r in again:
        r.load_state_dict(first[0].state_dict())
    resumed.load_state_dict(zero.state_dict())
    assert [g["lr"] for g in resumed.param_groups] == [g["lr"] for g in zero.param_groups] == [0.1 * 0.1]
    train_batch(X2, y2, first, zero.per_device(), devices)
    train_batch(X2, y2, again, resumed.per_device(), devices)
    torch.testing.assert_close(_flat(again[0]), _flat(first[0]), rtol=0, atol=0)


def test_a_zero_3_run_stopped_after_a_checkpoint_resumes_from_it_exactly(tmp_path):
    """The loss is called once per device: 3 devices x 7 steps + 1 stops in step 8, after the checkpoint of step 6.

    (Stopping at call 7 stops in step 3, before any checkpoint: the 'resumed' run then starts
    afresh and equals the uninterrupted one whatever the checkpoint holds.)
    """
    from manualdp import train
    kw = dict(optimizer=torch.optim.Adam, progress=False, nonfinite=None, zero=3)
    whole = _uneven_net()
    train(whole, *_resume_loaders(), cpu_devices(3), 2, 1e-2, log=None, **kw)
    ckpt = str(tmp_path / "ckpt")
    try:
        train(_uneven_net(), *_resume_loaders(), cpu_devices(3), 2, 1e-2, checkpoint_dir=ckpt, checkpoint_every=3,
              loss_fn=CrashingLoss(7 * 3 + 1), log=None, **kw)
    except Crash:
        pass
    else:
        raise AssertionError("the run was not stopped")
    resumed, said = _uneven_net(), []
    train(resumed, *_resume_loaders(), cpu_devices(3), 2, 1e-2, checkpoint_dir=ckpt, checkpoint_every=3, resume=True,
          log=said.append, **kw)
    assert any("resumed from" in line and "step 6" in line for line in said), said
    assert torch.equal(_flat(resumed), _flat(whole)), "a resumed ZeRO-3 run differs from an uninterrupted one"
