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


# ---------------------------------------------------------------- off the happy path (issue 35)

class Stack(nn.Module):
    """A transformer's shape: layers in a container, called in a loop (`kind` "list" or "dict"), and a head."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        layers = [nn.Linear(6, 6) for _ in range(3)]
        named = {f"l{k}": layer for k, layer in enumerate(layers)}
        self.layers = nn.ModuleList(layers) if kind == "list" else nn.ModuleDict(named)
        self.head = nn.Linear(6, 5)

    def forward(self, x):
        for layer in (self.layers if isinstance(self.layers, nn.ModuleList) else self.layers.values()):
            x = torch.tanh(layer(x))
        return self.head(x)


@pytest.mark.parametrize("kind, names", [("list", ["layers.0", "layers.1", "layers.2", "head"]),
                                         ("dict", ["layers.l0", "layers.l1", "layers.l2", "head"])])
@pytest.mark.parametrize("n", [2, 3])
def test_layers_in_a_container_called_in_a_loop_are_units_of_their_own_and_train_as_on_one_device(kind, names, n):
    """The container never runs a forward: as its own unit it would never be gathered (NaN everywhere)."""
    batches = _batches(7, steps=3, classes=5)
    one = _one_device(Stack(kind).double(), OPTIMIZERS["adam"], batches)
    zero = Zero3(replicate(Stack(kind).double(), cpu_devices(n)), OPTIMIZERS["adam"])
    assert zero.units.names == names  # FSDP2 refuses a container and is applied to its children: the same units
    for step, (X, y) in enumerate(batches):
        result = zero.train_batch(X, y)
        assert result.loss == result.loss, f"step {step}: the loss is NaN"
        for k, (got, want) in enumerate(zip(zero.full_parameters(), one[step])):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=f"step {step}, parameter {k}")


def test_a_container_named_as_a_unit_stops_the_first_step_by_name_and_its_children_are_units():
    replicas = replicate(Stack("list").double(), cpu_devices(2))
    zero = Zero3(replicas, OPTIMIZERS["sgd"], units=["layers"])
    before = [p.clone() for p in zero.full_parameters()]
    X, y = _batches(4, steps=1, classes=5)[0]
    with pytest.raises(RuntimeError, match=r"unit 'layers' has gradients, but its forward never ran.*not a container"):
        zero.train_batch(X, y, nonfinite=None)  # without the check, the NaN placeholders would train the model
    assert all(torch.equal(a, b) for a, b in zip(zero.full_parameters(), before))
    zero = Zero3(replicate(Stack("list").double(), cpu_devices(2)), OPTIMIZERS["sgd"], units=["layers.0", "layers.2"])
    assert zero.units.names == ["layers.0", "layers.2", ""]  # layers.1 and head: in the root unit
    zero.train_batch(X, y)
    pl = nn.Module()
    pl.w = nn.ParameterList([nn.Parameter(torch.ones(2))])
    assert choose_units(pl) == [("", list(pl.parameters()))]  # a ParameterList has no forward: its root's unit


class _Bypassed(nn.Module):
    """A unit whose forward never runs: the root calls the block's layers itself."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Module()
        self.block.a = nn.Linear(6, 4)

    def forward(self, x):
        return self.block.a(x)


@pytest.mark.parametrize("nonfinite", ["raise", None])
def test_a_unit_whose_forward_never_runs_is_named_before_any_shard_moves(nonfinite):
    zero = Zero3(replicate(_Bypassed().double(), cpu_devices(2)), OPTIMIZERS["sgd"])
    before = [p.clone() for p in zero.full_parameters()]
    X, y = _batches(4, steps=1, classes=4)[0]
    with pytest.raises(RuntimeError, match=r"unit 'block' has gradients, but its forward never ran"):
        zero.train_batch(X, y, nonfinite=nonfinite)
    assert all(torch.equal(a, b) for a, b in zip(zero.full_parameters(), before))


def test_a_nan_example_stops_the_step_by_default_skips_it_or_goes_through_as_asked():
    """As the book's `train_batch`: "raise" (default) leaves the shards and the optimizer state as they were,
    "skip" BatchNorm's statistics too; None lets the NaN through."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 4)).double()
    zero = Zero3(replicate(net, cpu_devices(3)), OPTIMIZERS["adam"])
    (X, y), (X2, y2) = _batches(9, steps=2, classes=4)
    zero.train_batch(X, y)
    before = [p.clone() for p in zero.full_parameters()]
    state = zero.state_dict()
    X2[4, 2] = float("nan")  # one example, on device 1
    from manualdp.guard import NonFiniteGradientError
    with pytest.raises(NonFiniteGradientError, match=r"non-finite gradient in parameter '0.weight' at step 7"):
        zero.train_batch(X2, y2, step=7)
    assert all(torch.equal(a, b) for a, b in zip(zero.full_parameters(), before))
    assert all(torch.equal(a, b) for a, b in zip(zero.state_dict()["optimizers"][1]["state"][0].values(),
                                                 state["optimizers"][1]["state"][0].values()))
    stats = [b.clone() for b in zero.replicas[0].buffers()]  # the stopped step's forward moved them, as train_batch's
    skipped = zero.train_batch(X2, y2, nonfinite="skip")
    assert skipped.skipped and all(torch.equal(a, b) for a, b in zip(zero.full_parameters(), before))
    assert all(torch.equal(a, b) for r in zero.replicas for a, b in zip(r.buffers(), stats))
    assert not zero.train_batch(X, y).skipped  # and the next good step goes on
    through = zero.train_batch(X2, y2, nonfinite=None)
    assert not through.skipped and torch.isnan(zero.full_parameters()[0]).any()
    with pytest.raises(ValueError, match="nonfinite"):
        zero.train_batch(X, y, nonfinite="warn")


def test_replicas_that_differ_or_are_one_module_are_refused_by_name():
    same = seeded_mlp()
    with pytest.raises(ValueError, match=r"replicas\[1\] is replicas\[0\]: every device needs its own copy"):
        Zero3([same, same], OPTIMIZERS["sgd"])
    replicas = replicate(seeded_mlp(), cpu_devices(3))
    with torch.no_grad():
        replicas[2][2].bias[1] += 1e-9
    before = [p.clone() for p in replicas[2].parameters()]
    with pytest.raises(ValueError, match=r"replicas\[2\]'s parameter '2.bias' differs from replicas\[0\]'s"):
        Zero3(replicas, OPTIMIZERS["sgd"])
    assert all(torch.equal(a, b) for a, b in zip(replicas[2].parameters(), before))
    shared = replicate(seeded_mlp(), cpu_devices(2))
    shared[1][0].weight = shared[0][0].weight
    with pytest.raises(ValueError, match=r"replicas\[1\] shares a parameter with replicas\[0\]"):
        Zero3(shared, OPTIMIZERS["sgd"])
    nan = replicate(seeded_mlp(), cpu_devices(2))
    with torch.no_grad():
        for r in nan:
            r[0].bias[0] = float("nan")
    Zero3(nan, OPTIMIZERS["sgd"])  # equal, NaN and all: not refused as different


@pytest.mark.parametrize("make", [torch.optim.LBFGS, functools.partial(torch.optim.LBFGS, history_size=3)])
def test_an_optimizer_that_needs_a_closure_is_refused_in_one_line_and_the_replicas_still_run(make):
    replicas = replicate(seeded_mlp(), cpu_devices(2))
    with pytest.raises(ValueError, match=r"^optimizer_class: LBFGS's step needs a closure"):
        Zero3(replicas, make, lr=0.1)
    out = replicas[1](torch.randn(3, 6, dtype=torch.float64))  # no unit hook was left on them
    assert torch.isfinite(out).all()


class _OneBadElement(nn.Module):
    """A root parameter whose last element gets an Inf gradient (d sqrt(x)/dx at 0): only the last device's chunk
    of the root unit holds it; every other gradient is finite."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 4)
        self.extra = nn.Parameter(torch.zeros(6, dtype=torch.float64))

    def forward(self, x):
        return self.lin(x) + torch.sqrt(self.extra[5:]) + self.extra[:5].sum()


@pytest.mark.parametrize("n", [2, 3])
def test_a_non_finite_gradient_in_one_devices_chunk_only_stops_the_step(n):
    zero = Zero3(replicate(_OneBadElement().double(), cpu_devices(n)), OPTIMIZERS["sgd"])
    before = [p.clone() for p in zero.full_parameters()]
    X, y = _batches(6, steps=1, classes=4)[0]
    from manualdp.guard import NonFiniteGradientError
    with pytest.raises(NonFiniteGradientError, match="parameter 'extra'"):
        zero.train_batch(X, y)
    assert all(torch.equal(a, b) for a, b in zip(zero.full_parameters(), before))


class _Gated(nn.Module):
    """A layer whose `extra` only flagged examples (first feature above 50) reach: only the device holding them
    uses it, while every device runs the layer (so that its all-gathers meet)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gated = nn.Linear(6, 8)
        self.extra = nn.Parameter(torch.randn(8))
        self.out = nn.Linear(8, 5)

    def forward(self, x):
        h = self.gated(x)
        flagged = x[:, 0] > 50
        if flagged.any():  # no flagged example: `extra` is not in this device's graph, and gets no gradient
            h = h + flagged[:, None].to(h.dtype) * self.extra
        return self.out(torch.tanh(h))


@pytest.mark.parametrize("n", [2, 3])
def test_a_parameter_only_the_last_devices_data_reaches_is_stepped_as_on_one_device(n):
    batches = _batches(11, steps=2, classes=5)
    for X, _ in batches:
        X[-1, 0] = 100.0  # the last example, on the last device only
    one = _one_device(_Gated().double(), OPTIMIZERS["sgd"], batches)
    zero = Zero3(replicate(_Gated().double(), cpu_devices(n)), OPTIMIZERS["sgd"])
    for step, (X, y) in enumerate(batches):
        zero.train_batch(X, y)
        for k, (got, want) in enumerate(zip(zero.full_parameters(), one[step])):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=f"step {step}, parameter {k}")
    names = [name for name, _ in _Gated().named_parameters()]
    assert not torch.equal(zero.full_parameters()[names.index("extra")], _Gated().double().extra), "extra never moved"
