import copy
import functools
import json

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from manualdp import History, cpu_devices, evaluate, replicate, train, train_batch
import torch.nn.functional as F
from manualdp.train import summed_loss


def _net(dtype, batchnorm=False):
    torch.manual_seed(0)
    layers = [nn.Linear(6, 16)] + ([nn.BatchNorm1d(16)] if batchnorm else []) + [nn.Tanh(), nn.Linear(16, 4)]
    return nn.Sequential(*layers).to(dtype)


def _steps(net, batches, n, **kw):
    devices = cpu_devices(n)
    replicas = replicate(net, devices)
    opts = [torch.optim.SGD(r.parameters(), lr=0.1, momentum=0.9) for r in replicas]
    for X, y in batches:
        train_batch(X, y, replicas, opts, devices, **kw)
    return replicas


def _reference(net, batches):
    """One device, plain PyTorch, the whole global batch: what N devices must reproduce.

    It goes through none of manualdp (no split_batch, no summed_loss), so a bug there
    cannot hide in the reference too.
    """
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for X, y in batches:
        opt.zero_grad()
        F.cross_entropy(net(X), y).backward()
        opt.step()
    return net


def _batches(dtype, batch, steps=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 6, generator=g, dtype=dtype), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]


@given(n=st.integers(2, 8), batch=st.integers(9, 23), algorithm=st.sampled_from(["naive", "ring", "tree"]),
       bucket=st.sampled_from([None, 0.0005, 25.0]))
def test_n_devices_equal_one_device_float64(n, batch, algorithm, bucket):
    batches = _batches(torch.float64, batch)
    one = _reference(_net(torch.float64), batches)
    many = _steps(_net(torch.float64), batches, n, algorithm=algorithm, bucket_cap_mb=bucket)
    for r in many:
        for p, q in zip(one.parameters(), r.parameters()):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-10)
    for r in many[1:]:  # replicas are bitwise identical to each other
        for p, q in zip(many[0].parameters(), r.parameters()):
            assert torch.equal(p, q)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_n_devices_equal_one_device_float32_uneven_batch(n):
    batches = _batches(torch.float32, 17, steps=4)  # 17 does not divide by 2, 3 or 5
    one = _reference(_net(torch.float32), batches)
    many = _steps(_net(torch.float32), batches, n)
    for p, q in zip(one.parameters(), many[-1].parameters()):
        torch.testing.assert_close(q, p)


def test_average_of_averages_would_differ():
    # The reason for summed_loss: with uneven shards the mean of shard means is not the batch mean.
    X, y = _batches(torch.float64, 7, steps=1)[0]
    net = _net(torch.float64)
    out = net(X)
    mean = nn.functional.cross_entropy(out, y)
    shard_means = [nn.functional.cross_entropy(o, t) for o, t in zip(out.split([4, 3]), y.split([4, 3]))]
    summed = sum(summed_loss(None)(o, t) for o, t in zip(out.split([4, 3]), y.split([4, 3]))) / 7
    torch.testing.assert_close(summed, mean, rtol=0, atol=1e-12)
    assert abs((sum(shard_means) / 2 - mean).item()) > 1e-6


def test_bucketed_and_unbucketed_training_agree():
    batches = _batches(torch.float64, 12)
    per_param = _steps(_net(torch.float64), batches, 3, algorithm="ring")
    bucketed = _steps(_net(torch.float64), batches, 3, algorithm="ring", bucket_cap_mb=25)
    for p, q in zip(per_param[0].parameters(), bucketed[0].parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-12)


def test_buffers_are_broadcast_from_replica_zero():
    batches = _batches(torch.float64, 12, steps=2)
    replicas = _steps(_net(torch.float64, batchnorm=True), batches, 3)
    bn = [r[1] for r in replicas]
    for other in bn[1:]:
        assert torch.equal(other.running_mean, bn[0].running_mean)
        assert torch.equal(other.running_var, bn[0].running_var)
    # replica 0 saw only its own shard, so its statistics differ from a one-device run
    one = _steps(_net(torch.float64, batchnorm=True), batches, 1)[0][1]
    assert not torch.allclose(one.running_mean, bn[0].running_mean)


def test_mean_reduction_loss_is_turned_into_a_sum():
    batches = _batches(torch.float64, 10)
    default = _steps(_net(torch.float64), batches, 2)
    mean = _steps(_net(torch.float64), batches, 2, loss_fn=nn.CrossEntropyLoss())  # reduction="mean"
    for p, q in zip(default[0].parameters(), mean[0].parameters()):
        assert torch.equal(p, q)


def _blobs(n, seed):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 6, generator=torch.Generator().manual_seed(99)) * 3
    y = torch.randint(0, 4, (n,), generator=g)
    return TensorDataset(centers[y] + torch.randn(n, 6, generator=g), y)


def test_train_learns_and_net_holds_the_result(tmp_path):
    train_iter = DataLoader(_blobs(512, 0), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    test_iter = DataLoader(_blobs(256, 1), batch_size=128)
    net = _net(torch.float32)
    before = copy.deepcopy(net)
    history = train(net, train_iter, test_iter, cpu_devices(3), num_epochs=3, lr=0.2, progress=False, log=None)
    assert history.test_acc[-1] > 0.8  # chance is 0.25
    assert evaluate(net, test_iter) == pytest.approx(history.test_acc[-1])
    assert evaluate(before, test_iter) < 0.6
    assert len(history.train_loss) == len(history.epoch_seconds) == 3
    assert history.train_loss[-1] < history.train_loss[0]
    path = tmp_path / "h.json"
    history.to_json(str(path))
    assert History.from_json(str(path)) == history
    assert json.loads(path.read_text())["config"]["devices"] == ["cpu"] * 3


@pytest.mark.parametrize("kwargs, error, match", [
    ({"num_epochs": 0}, ValueError, "num_epochs must be a positive int, got 0"),
    ({"lr": -1.0}, ValueError, "lr must be a positive number, got -1.0"),
    ({"algorithm": "butterfly"}, ValueError, "algorithm must be one of .* got 'butterfly'"),
    ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be a positive number or None, got 0"),
    ({"devices": []}, ValueError, "devices must not be empty"),
    ({"net": "lenet"}, TypeError, "net must be an nn.Module, got str"),
])
def test_train_rejects_bad_arguments_before_touching_the_net(kwargs, error, match):
    net = _net(torch.float32)
    before = copy.deepcopy(net.state_dict())
    args = dict(net=net, train_iter=[], test_iter=[], devices=cpu_devices(2), num_epochs=1, lr=0.1)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        train(**args, progress=False, log=None)
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k])


def test_train_batch_needs_one_replica_per_device():
    replicas = replicate(_net(torch.float32), cpu_devices(2))
    opts = [torch.optim.SGD(r.parameters(), lr=0.1) for r in replicas]
    with pytest.raises(ValueError, match="3 devices, 2 replicas, 2 optimizers"):
        train_batch(torch.zeros(6, 6), torch.zeros(6, dtype=torch.long), replicas, opts, cpu_devices(3))



# ---------------------------------------------------------------- edge cases found in review

def _small_net(bn=False):
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8)] + ([nn.BatchNorm1d(8)] if bn else []) + [nn.ReLU(), nn.Linear(8, 3)]
    return nn.Sequential(*layers).double()

def _small_data(n=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)

def _small_step(n, loss_fn=None, net=None, **kw):
    devices = cpu_devices(n)
    replicas = replicate(net or _small_net(), devices)
    opts = [torch.optim.SGD(r.parameters(), lr=0.5) for r in replicas]
    X, y = _small_data()
    result = train_batch(X, y, replicas, opts, devices, loss_fn, **kw)
    return replicas, result


class Poison(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * float("nan") if self.calls == 2 else x


def test_plain_loss_function_returning_a_mean_is_refused():
    with pytest.raises(ValueError, match=r"loss_fn must return one loss per example \(shape \(\d+,\)\), got \(\)"):
        _small_step(3, F.cross_entropy)


def test_plain_loss_function_with_per_example_losses_equals_the_module():
    per_example = functools.partial(F.cross_entropy, reduction="none")
    a, _ = _small_step(3, per_example)
    b, _ = _small_step(3, nn.CrossEntropyLoss())
    one, _ = _small_step(1)
    for p, q, r in zip(a[0].parameters(), b[0].parameters(), one[0].parameters()):
        assert torch.equal(p, q)
        torch.testing.assert_close(p, r, rtol=0, atol=1e-12)


def test_skipped_step_restores_batchnorm_statistics():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), Poison(), nn.Linear(8, 3)).double()
    devices = cpu_devices(2)
    replicas = replicate(net, devices)
    opts = [torch.optim.SGD(r.parameters(), lr=0.5) for r in replicas]
    X, y = _small_data()
    train_batch(X, y, replicas, opts, devices)  # replica 1 calls Poison once here
    before = [b.clone() for b in replicas[0].buffers()]
    result = train_batch(X, y, replicas, opts, devices, nonfinite="skip")  # replica 1's 2nd call is NaN
    assert result.skipped
    for r in replicas:
        for b, saved in zip(r.buffers(), before):
            assert torch.equal(b, saved)
    assert all(torch.isfinite(b.float()).all() for r in replicas for b in r.buffers())


def test_buffers_including_integer_ones_are_identical_after_a_step():
    replicas, _ = _small_step(3, net=_small_net(bn=True))
    bn = [r[1] for r in replicas]
    for other in bn[1:]:
        assert torch.equal(other.num_batches_tracked, bn[0].num_batches_tracked)
        assert torch.equal(other.running_mean, bn[0].running_mean)


def test_short_last_batch_is_skipped_with_a_message():
    X, y = _small_data(33)
    loader = DataLoader(TensorDataset(X, y), batch_size=8)  # last batch: 1 example, 4 devices
    messages = []
    net = _small_net()
    before = [p.clone() for p in net.parameters()]
    history = train(net, loader, loader, cpu_devices(4), 1, 0.1, progress=False, log=messages.append)
    assert any("skipped a batch of 1, fewer examples than the 4 devices" in m for m in messages)
    assert history.config and len(history.train_loss) == 1
    assert any(not torch.equal(p, b) for p, b in zip(net.parameters(), before))


def test_empty_training_loader_is_an_error():
    with pytest.raises(ValueError, match="train_iter gave no usable batch in epoch 1"):
        train(_small_net(), [], [], cpu_devices(2), 1, 0.1, progress=False, log=None)


def test_unused_parameter_keeps_no_gradient_and_does_not_move():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    net = Two().double()
    devices = cpu_devices(2)
    replicas = replicate(net, devices)
    opts = [torch.optim.SGD(r.parameters(), lr=0.5, weight_decay=0.1) for r in replicas]
    X, y = _small_data()
    train_batch(X, y, replicas, opts, devices)
    for r in replicas:
        assert r.unused.weight.grad is None
        assert torch.equal(r.unused.weight, net.unused.weight)  # weight decay must not touch it
