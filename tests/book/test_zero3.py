"""ZeRO-3 on the single controller: one device's numbers, 1/N of the parameters, and the bytes of its schedules."""
import functools
import threading
from collections import Counter

import pytest
import torch
from torch import nn

from manualdp import cpu_devices, replicate
from manualdp.cost import traffic
from manualdp.lockstep import check_own_gpus
from manualdp.schedule import get_schedule
from manualdp.units import choose_units
from manualdp.zero3 import Zero3, traffic_of
from tests.helpers import seeded_mlp

OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "adam": functools.partial(torch.optim.Adam, lr=1e-2),
}


class Tangled(nn.Module):
    """Everything that makes sharding by units hard: a weight two units share, a layer called twice,
    a frozen layer and a frozen bias, and a parameter of the root's own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8)
        self.inp.bias.requires_grad_(False)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight  # tied: in two units, so the root unit's
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.twice = nn.Linear(8, 8)
        self.out = nn.Linear(8, 5)
        self.scale = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.b(torch.tanh(self.a(h))))
        h = torch.tanh(self.frozen(h))
        h = torch.tanh(self.twice(torch.tanh(self.twice(h))))
        return self.out(h) * self.scale


def _batches(batch, steps, classes):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 6, generator=g, dtype=torch.float64), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(steps)]


def _one_device(net, make, batches):
    opt = make(net.parameters())
    out = []
    for X, y in batches:
        opt.zero_grad()
        (nn.functional.cross_entropy(net(X), y, reduction="sum") / len(X)).backward()
        opt.step()
        out.append([p.detach().clone() for p in net.parameters()])
    return out


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_zero3_equals_one_device_with_a_tied_weight_a_frozen_layer_and_uneven_shards(name, n):
    batches = _batches(11, steps=4, classes=5)
    one = _one_device(Tangled().double(), OPTIMIZERS[name], batches)
    zero = Zero3(replicate(Tangled().double(), cpu_devices(n)), OPTIMIZERS[name])
    assert zero.units.names == ["inp", "a", "b", "frozen", "twice", "out", ""]
    for step, (X, y) in enumerate(batches):
        zero.train_batch(X, y)
        for k, (got, want) in enumerate(zip(zero.full_parameters(), one[step])):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=f"step {step}, parameter {k}")
    start = list(Tangled().double().parameters())
    moved = [not torch.equal(a, b) for a, b in zip(zero.full_parameters(), start)]
    frozen = [not p.requires_grad for p in start]
    assert moved == [not f for f in frozen], "a trainable parameter did not move, or a frozen one did"


def test_the_root_unit_holds_its_own_parameters_and_the_shared_ones():
    net = Tangled()
    units = dict(choose_units(net))
    same = lambda ps, qs: [id(p) for p in ps] == [id(q) for q in qs]  # noqa: E731
    assert same(units[""], [net.scale, net.a.weight])
    assert same(units["a"], [net.a.bias]) and same(units["b"], [net.b.bias])
    named = dict(choose_units(net, ["twice", "out"]))  # the rest goes to the root
    assert list(named) == ["twice", "out", ""] and len(named[""]) == len(list(net.parameters())) - 4


def _chunk(numel, n, device):
    """The elements device `device` owns of a buffer of `numel` (it owns chunk (device+1) % n; the first
    numel % n chunks have one more element)."""
    base, extra = divmod(numel, n)
    return base + ((device + 1) % n < extra)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_between_steps_a_device_holds_its_shards_only(n):
    zero = Zero3(replicate(Tangled().double(), cpu_devices(n)), OPTIMIZERS["adam"])
    sizes = [8 * 6 + 8, 8, 8, 64 + 8, 64 + 8, 8 * 5 + 5, 64 + 1]  # the units, by hand: the root has a.weight, scale
    for X, y in [(None, None)] + _batches(7, steps=2, classes=5):
        if X is not None:
            zero.train_batch(X, y)
        for i, r in enumerate(zero.replicas):
            tensors = list(r.parameters()) + [s for unit in zero.shards[i] for s in unit]
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
            # float64 shards, and the one-element NaN that the parameters point at between steps
            assert sum(storages.values()) == 8 * sum(_chunk(s, n, i) for s in sizes) + 8
            assert all(p.grad is None for p in r.parameters())
            assert all(torch.isnan(p).all() for p in r.parameters())


@pytest.mark.parametrize("n", [2, 3])
def test_a_device_holds_one_unit_at_a_time_during_a_step(n):
    zero = Zero3(replicate(seeded_mlp(torch.float32).double(), cpu_devices(n)), OPTIMIZERS["sgd"])
    shards = zero.param_bytes()
    X, y = _batches(9, steps=1, classes=4)[0]
    zero.train_batch(X, y)
    for c in zero.collectives:
        gathered = 8 * c.numel if c.kind == "all_gather" else 0  # the unit just gathered, nothing else
        assert list(c.held) == [s + gathered for s in shards], c
    # The first layer is not gathered for backward: its input needs no gradient, so backward reads none of its weights.
    planned = Counter(c[:5] for c in zero.planned())
    ran = Counter(c[:5] for c in zero.collectives)
    assert planned - ran == Counter({("all_gather", "backward", "0", 6 * 16 + 16, 8): 1}) and not ran - planned


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_a_step_sends_two_all_gathers_and_one_reduce_scatter_of_the_model(n):
    zero = Zero3(replicate(seeded_mlp(torch.float32), cpu_devices(n)), OPTIMIZERS["sgd"])
    sizes = [6 * 16 + 16, 16 * 8 + 8, 8 * 4 + 4]  # float32
    got = traffic_of(zero.planned(), n)
    # By hand, from the ring: over n-1 rounds device i sends every chunk but one. In the all-gather it
    # never sends chunk (i+2) % n (its right neighbour's own); in the reduce-scatter, chunk (i+1) % n (its own).
    def chunk(s, c):
        return divmod(s, n)[0] + (c < divmod(s, n)[1])
    for i in range(n):
        want = sum(4 * (2 * (s - chunk(s, (i + 2) % n)) + (s - chunk(s, (i + 1) % n))) for s in sizes)
        assert got["sent"][i] == want and got["received"][(i + 1) % n] == want
    # A model that every n divides: exactly 3(n-1)/n of it, against plain data parallelism's 2(n-1)/n.
    even = Zero3(replicate(nn.Sequential(nn.Linear(59, 1), nn.Linear(119, 1)), cpu_devices(n)), OPTIMIZERS["sgd"])
    model = 4 * (60 + 120)
    assert traffic_of(even.planned(), n)["sent"] == [3 * (n - 1) * model // n] * n
    assert traffic(get_schedule("ring", n), model, 4)["sent"] == [2 * (n - 1) * model // n] * n


def test_a_replica_refuses_a_forward_between_steps():
    zero = Zero3(replicate(seeded_mlp(torch.float32), cpu_devices(2)), OPTIMIZERS["sgd"])
    with pytest.raises(RuntimeError, match="holds only its shards between steps"):
        zero.replicas[1](torch.randn(3, 6))


class _Fickle(nn.Module):
    """A model whose forward depends on the batch: devices with different shard sizes disagree."""

    def __init__(self, fail: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.fail = nn.Linear(6, 6), nn.Linear(6, 4), fail

    def forward(self, x):
        if len(x) > 3:
            if self.fail:
                raise ArithmeticError("this device's forward failed")
            x = self.a(x)
        return self.b(self.a(x))


@pytest.mark.parametrize("fail, error, match", [(False, RuntimeError, "reached different collectives"),
                                                (True, ArithmeticError, "forward failed")])
def test_a_device_that_disagrees_or_fails_stops_the_step_and_changes_nothing(fail, error, match, deadline):
    zero = Zero3(replicate(_Fickle(fail).double(), cpu_devices(3)), OPTIMIZERS["adam"])
    before = [p.clone() for p in zero.full_parameters()]
    X, y = _batches(10, steps=1, classes=4)[0]  # shards of 4, 3 and 3 rows
    with deadline(60):
        with pytest.raises(error, match=match):
            zero.train_batch(X, y)
    assert [t.name for t in threading.enumerate() if t.name.startswith("device ")] == []
    assert all(torch.equal(a, b) for a, b in zip(zero.full_parameters(), before))
    assert zero.param_bytes() == [8 * sum(s.numel() for unit in shards for s in unit) + 8 for shards in zero.shards]
    assert all(p.grad is None for r in zero.replicas for p in r.parameters())


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(units=["nope"]), ValueError, "no submodule 'nope'"),
    (dict(units=["0", "0"]), ValueError, "named twice"),
    (dict(units="0"), TypeError, "units must be a list"),
    (dict(units=["1"]), ValueError, "'1' has no parameters"),
    (dict(algorithm="tree"), ValueError, "algorithm"),
])
def test_bad_input_names_the_argument_and_leaves_the_replicas_alone(kwargs, error, match):
    replicas = replicate(seeded_mlp(torch.float32), cpu_devices(2))
    before = [p.detach().clone() for p in replicas[0].parameters()]
    with pytest.raises(error, match=match):
        Zero3(replicas, OPTIMIZERS["sgd"], **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(replicas[0].parameters(), before))


def test_a_unit_inside_another_is_refused():
    net = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="inside another unit"):
        choose_units(net, ["0", "0.1"])
    with pytest.raises(ValueError, match="inside another unit"):
        choose_units(net, ["0.1", "0"])


def test_devices_side_by_side_need_a_gpu_each():
    # two replicas on one GPU would deadlock: autograd runs that GPU's backward on one thread
    with pytest.raises(ValueError, match="a GPU of its own"):
        check_own_gpus([torch.device("cuda", 0), torch.device("cpu"), torch.device("cuda", 0)])
    check_own_gpus([torch.device("cuda", 0), torch.device("cuda", 1)])
    check_own_gpus(cpu_devices(3))
