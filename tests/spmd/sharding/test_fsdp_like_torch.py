"""`fully_shard` where a user steps off the plain training loop: torch's FSDP2's numbers, or one clear line.

One spawned run at 2 ranks holds every case, each run with our `fully_shard` and with torch's where torch's
is right: `requires_grad_` after sharding, unit outputs in dataclasses and NamedTuples, torch's `FSDPModule`
class checks, composable activation checkpointing, `register_fsdp_forward_method`, the gradient divide factor
of one module, `state_dict()` between a forward and its backward; and the refusals (a tensor-subclass or
channels_last parameter, an optimizer of gathered parameters, a full or foreign state dict).
The assertions run here, in the parent.
"""
import dataclasses
import functools
import math
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard

from manualdp.spmd import launch, shard
from manualdp.spmd.sharding.fsdp import FSDPModule, full_state_dict, fully_shard, init_full

SHARD_FNS = {"ours": fully_shard, "torch": torch_fully_shard}


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _data(rank, n, rows=6, dim=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return shard(torch.randn(rows, dim, generator=g), torch.randn(rows, 3, generator=g), rank, n)


class Stack(nn.Module):
    """Three linear layers (13 rows in the middle: uneven shards), each a unit, and a head of the root's own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(4, 13), nn.Linear(13, 5), nn.Linear(5, 5)])
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _stack(shard_fn, model=None, **kwargs):
    """`model` (a fresh `Stack` by default) with each layer a unit, then the root."""
    model = Stack() if model is None else model
    for layer in model.layers:
        shard_fn(layer, **kwargs)
    return shard_fn(model, **kwargs)


def _train(model, rank, n, steps=3, between=None):
    """Adam on the summed squared error; `between(model, step)` runs before each step. Full parameters, grads."""
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for k in range(steps):
        if between is not None:
            between(model, k)
        X, y = _data(rank, n, seed=k)
        (((model(X) - y) ** 2).sum() / 6 * n).backward()
        opt.step()
        had_grad = {name: p.grad is not None for name, p in model.named_parameters()}
        opt.zero_grad()
    return {"params": {k: _full(p) for k, p in model.named_parameters()}, "had grad": had_grad}


def _requires_grad_after_sharding(shard_fn, rank, n):
    """Freeze one layer and one weight after sharding; unfreeze one frozen before; switch one at step 1."""
    frozen = _stack(shard_fn)
    frozen.layers[1].requires_grad_(False)
    frozen.layers[0].weight.requires_grad_(False)
    early = Stack()
    early.layers[2].requires_grad_(False)
    for layer in early.layers:
        shard_fn(layer)
    shard_fn(early)
    early.layers[2].requires_grad_(True)

    def switch(model, k):
        if k == 1:
            model.head.requires_grad_(False)
            model.layers[1].bias.requires_grad_(False)

    bitfit = Blocks()  # pytorch's per-group test: checkpointed blocks, reshard to 2, biases alone train
    for block in bitfit.blocks:
        checkpoint(block)
        shard_fn(block, reshard_after_forward=2)
    shard_fn(bitfit, reshard_after_forward=2)
    for name, p in bitfit.named_parameters():
        p.requires_grad_("bias" in name)
    got = {"frozen": _train(frozen, rank, n), "unfrozen": _train(early, rank, n),
           "switched": _train(_stack(shard_fn), rank, n, between=switch), "bitfit": _train(bitfit, rank, n)}
    if shard_fn is fully_shard:  # torch's follows these until its next reshard only: one process is the reference
        for case, unfreeze in (("unfrozen gathered", True), ("frozen gathered", False)):
            got[case] = _train(_stack(shard_fn), rank, n, between=_while_gathered(rank, n, unfreeze))
    return got


def _while_gathered(rank, n, unfreeze):
    """Before step 0, a forward with no backward (the root keeps its full parameters, which `model.parameters()`
    yields then); `unfreeze`: the model frozen before it and unfrozen after; else the head frozen after it and,
    at step 2, unfrozen again through its shards."""
    def between(model, k):
        if k == 0:
            model.requires_grad_(not unfreeze)
            model(_data(rank, n)[0])
            (model if unfreeze else model.head).requires_grad_(unfreeze)
        if k == 2 and not unfreeze:
            model.head.requires_grad_(True)
    return between


@dataclasses.dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor


class Halves(NamedTuple):
    top: torch.Tensor
    bottom: torch.Tensor


class ToPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(4, 6)

    def forward(self, x):
        return Pair(torch.tanh(self.a(x)), torch.tanh(self.b(x)))


class ToHalves(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, pair):
        h = torch.tanh(self.lin(pair.first * pair.second))
        return Halves(h[:, :3].clone(), h[:, 3:].clone())


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.inp, self.pair, self.halves, self.head = nn.Linear(4, 4), ToPair(), ToHalves(), nn.Linear(3, 3)

    def forward(self, x):  # `inp` first: the units' backward needs their weights (the input's gradient)
        halves = self.halves(self.pair(self.inp(x)))
        return self.head(halves.top * halves.bottom)


def _structured_outputs(shard_fn, rank, n):
    model = Structured()
    shard_fn(model.pair, reshard_after_forward=True)
    shard_fn(model.halves, reshard_after_forward=True)
    shard_fn(model)
    return _train(model, rank, n)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(4, 9), nn.Linear(9, 4)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))

    def twice(self, x):
        return self.down(self.up(x)) * 2


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _checkpointed(shard_fn, rank, n):
    """torchtitan's order: composable activation checkpointing on each block, then fully_shard on it."""
    model = Blocks()
    for block in model.blocks:
        checkpoint(block)
        shard_fn(block, reshard_after_forward=True)
    shard_fn(model)
    return _train(model, rank, n)


def _forward_method(shard_fn, rank, n):
    model = Blocks()
    for block in model.blocks:
        shard_fn(block)
    shard_fn(model)
    register_fsdp_forward_method(model.blocks[1], "twice")
    X, _ = _data(rank, n)
    out = model.blocks[1].twice(X)
    out.sum().backward()
    return {"out": out.detach(), "grad": _full(model.blocks[1].up.weight.grad)}


def _divide_factor(shard_fn, rank, n):
    """The root's factor 1.0 (sums); the blocks keep theirs (average)."""
    model = Blocks()
    for block in model.blocks:
        shard_fn(block)
    shard_fn(model)
    model.set_force_sum_reduction_for_comms(True)  # torch's otherwise asks gloo for PREMUL_SUM
    model.set_gradient_divide_factor(1.0)
    X, y = _data(rank, n)
    ((model(X) - y) ** 2).sum().backward()
    return {k: _full(p.grad) for k, p in model.named_parameters()}


def _state_dict_mid_step(shard_fn, rank, n):
    """`state_dict()` between a forward and its backward, and after a backward that kept the full parameters."""
    model = _stack(shard_fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = _data(rank, n)
    out = model(X)
    mid = model.state_dict()
    (((out - y) ** 2).sum()).backward()
    opt.step()
    got = {"types": sorted({type(v).__name__ for v in mid.values()}),
           "stale": [k for k, v in mid.items() if not torch.equal(_full(v), _full(model.state_dict()[k]))]}
    model.set_reshard_after_backward(False)
    ((model(X) - y) ** 2).sum().backward()
    kept = model.state_dict()
    got["kept types"] = sorted({type(v).__name__ for v in kept.values()})
    got["after"] = {k: _full(v) for k, v in kept.items()}
    model.reshard()
    for layer in model.layers:
        layer.reshard()
    got["resharded"] = {k: _full(v) for k, v in model.state_dict().items()}
    loaded = _stack(shard_fn)  # load doubled weights between a forward and its backward: backward uses them
    opt = torch.optim.SGD(loaded.parameters(), lr=0.1)
    out = loaded(X)
    loaded.load_state_dict({k: v.detach() * 2 for k, v in loaded.state_dict().items()})
    ((out - y) ** 2).sum().backward()
    opt.step()
    got["loaded mid-step"] = {k: _full(v) for k, v in loaded.state_dict().items()}
    return got


def _refusal(fn):
    try:
        fn()
    except (TypeError, ValueError, NotImplementedError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _optimizer_of_gathered(rank, n):
    model = _stack(fully_shard)
    X, y = _data(rank, n)
    model(X)  # no backward: the root keeps its full parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return _refusal(opt.step)


def _foreign_state_dicts(rank, n, mesh):
    model = _stack(fully_shard)
    full = Stack().state_dict()
    other = {}  # as if saved at 3 ranks: each local piece ceil(rows / 3) rows
    for k, v in model.state_dict().items():
        rows = -(-v.shape[0] // 3)
        other[k] = DTensor.from_local(full[k][:rows].clone(), mesh, [Shard(0)], run_check=False, shape=v.shape,
                                      stride=v.stride())
    return {"full": _refusal(lambda: model.load_state_dict(full)),
            "other world size": _refusal(lambda: model.load_state_dict(other)),
            "same": _refusal(lambda: model.load_state_dict(model.state_dict()))}


class _TwoTensorNet(nn.Module):
    def __init__(self):
        super().__init__()
        from torch.testing._internal.two_tensor import TwoTensor
        self.w = nn.Parameter(TwoTensor(torch.randn(4, 4), torch.randn(4, 4)))


def _refusals(rank, n):
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    return {"two tensor": _refusal(lambda: fully_shard(_TwoTensorNet())),
            "channels_last": {name: _refusal(lambda fn=fn: fn(nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)))
                              for name, fn in SHARD_FNS.items()},
            "channels_last weight": conv.weight.is_contiguous()}


def _classes():
    model = _stack(fully_shard)
    seq = fully_shard(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    return {"torch's": [isinstance(m, TorchFSDPModule) for m in (model, model.layers[0], model.head)],
            "ours": [isinstance(m, FSDPModule) for m in (model, model.layers[0], model.head)],
            "slice": type(seq[0:1]).__name__}  # torch's __new__ makes a plain Sequential of the children


def _reset(model):
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


def _meta_init(use_init_full):
    """pytorch/examples' order: build on the meta device, shard, to_empty, seed, initialise."""
    with torch.device("meta"):
        model = Stack()
    _stack(fully_shard, model).to_empty(device="cpu")
    torch.manual_seed(11)
    if use_init_full:
        init_full(model, _reset)
    else:
        _reset(model)
    return full_state_dict(model)


def _one_process_meta_init():
    with torch.device("meta"):
        model = Stack()
    model.to_empty(device="cpu")
    torch.manual_seed(11)
    _reset(model)
    return model.state_dict()


def _frozen_on_one_rank(rank, n):
    """Rank 0 freezes a layer after sharding, rank 1 does not: the next forward's all-gather names it on both."""
    model = _stack(fully_shard)
    if rank == 0:
        model.layers[1].requires_grad_(False)
    X, y = _data(rank, n)
    return _refusal(lambda: ((model(X) - y) ** 2).sum().backward())


def _factor_apart(rank, n):
    """Rank 0 sums (factor 1.0), rank 1 halves (2.0): the reduce-scatter's tails name both on every rank."""
    model = _stack(fully_shard)
    for unit in (model, *model.layers):
        unit.set_gradient_divide_factor(1.0 if rank == 0 else 2.0)
    X, y = _data(rank, n)
    return _refusal(lambda: ((model(X) - y) ** 2).sum().backward())


def _init_seeded_apart(rank):
    """Each rank seeds `init_full` with its own rank: every rank raises naming a parameter, nothing changes."""
    model = _stack(fully_shard)
    before = {k: _full(v) for k, v in model.state_dict().items()}
    torch.manual_seed(rank)
    message = _refusal(lambda: init_full(model, _reset))
    return {"message": message, "unchanged": all(torch.equal(_full(v), before[k])
                                                 for k, v in model.state_dict().items())}


def _case(fn, *args):
    """`fn(*args)`, or what it raised: one case that crashes leaves the others their answers."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - reported to the parent, whose assertion names it
        return {"raised": f"{type(e).__name__}: {e}"}


def _job():
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (n,))
    out = {}
    for name, fn in SHARD_FNS.items():
        out[name] = {case: _case(job, fn, rank, n) for case, job in (
            ("requires_grad", _requires_grad_after_sharding), ("structured", _structured_outputs),
            ("checkpointed", _checkpointed), ("forward method", _forward_method), ("divide", _divide_factor),
            ("state dict", _state_dict_mid_step))}
    out["gathered optimizer"] = _optimizer_of_gathered(rank, n)
    out["foreign"] = _case(_foreign_state_dicts, rank, n, mesh)
    out["refusals"] = _case(_refusals, rank, n)
    out["classes"] = _case(_classes)
    out["meta"] = {"init_full": _case(_meta_init, True), "reset": _case(_meta_init, False)}
    out["init seeded apart"] = _init_seeded_apart(rank)
    out["factor apart"] = _factor_apart(rank, n)
    out["frozen on one rank"] = _frozen_on_one_rank(rank, n)  # last: it leaves the ranks' units out of step
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return launch(_job, 2, timeout=240.0)


@pytest.fixture(scope="module")
def results():
    return _results()


def _same(ours, theirs, what, atol=1e-6):
    assert list(ours) == list(theirs), what
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=0, atol=atol, msg=f"{what}: {k}")


def test_requires_grad_changed_after_sharding_is_followed_as_torch_does(results):
    for r, got in enumerate(results):
        for case in ("frozen", "unfrozen", "switched", "bitfit"):
            ours, theirs = got["ours"]["requires_grad"][case], got["torch"]["requires_grad"][case]
            assert ours["had grad"] == theirs["had grad"], (r, case)
            _same(ours["params"], theirs["params"], f"rank {r} {case}")
        start = Stack().state_dict()
        frozen = got["ours"]["requires_grad"]["frozen"]
        assert torch.equal(frozen["params"]["layers.1.weight"], start["layers.1.weight"]), "frozen after: unchanged"
        assert not frozen["had grad"]["layers.0.weight"] and frozen["had grad"]["layers.0.bias"]
        unfrozen = got["ours"]["requires_grad"]["unfrozen"]
        assert not torch.equal(unfrozen["params"]["layers.2.weight"], start["layers.2.weight"]), "unfrozen: trains"

def test_requires_grad_set_on_the_full_parameters_of_a_gathered_root_is_kept_as_one_process_keeps_it(results):
    """A forward with no backward leaves the root gathered: `model.parameters()` yields its full parameters, and
    what `requires_grad_` sets on them holds from then on (torch's FSDP2 forgets it at the next reshard)."""
    for case, unfreeze in (("unfrozen gathered", True), ("frozen gathered", False)):
        single = _train(Stack(), 0, 1, between=_while_gathered(0, 1, unfreeze))
        assert single["had grad"]["head.weight"], case
        for r, got in enumerate(results):
            ours = got["ours"]["requires_grad"][case]
            assert ours["had grad"] == single["had grad"], (r, case)
            _same(ours["params"], single["params"], f"rank {r} {case}", atol=1e-5)  # summed in another order


def test_unit_outputs_in_dataclasses_and_namedtuples_are_gathered_for_backward(results):
    for r, got in enumerate(results):
        _same(got["ours"]["structured"]["params"], got["torch"]["structured"]["params"], f"rank {r} structured")


def test_composable_checkpointing_and_a_registered_forward_method_work_as_torchs(results):
    for r, got in enumerate(results):
        _same(got["ours"]["checkpointed"]["params"], got["torch"]["checkpointed"]["params"], f"rank {r} checkpoint")
        _same(got["ours"]["forward method"], got["torch"]["forward method"], f"rank {r} forward method")


def test_a_gradient_divide_factor_reaches_the_modules_own_parameters_only(results):
    for r, got in enumerate(results):
        _same(got["ours"]["divide"], got["torch"]["divide"], f"rank {r} divide factor")


def test_state_dict_between_forward_and_backward_holds_the_shards(results):
    for r, got in enumerate(results):
        ours, theirs = got["ours"]["state dict"], got["torch"]["state dict"]
        assert ours["types"] == theirs["types"] == ["DTensor"] and ours["stale"] == theirs["stale"] == []
        assert ours["kept types"] == theirs["kept types"] == ["DTensor"]
        _same(ours["after"], theirs["after"], f"rank {r} state dict with full parameters kept")
        _same(ours["after"], ours["resharded"], f"rank {r} the same after reshard")
        _same(ours["loaded mid-step"], theirs["loaded mid-step"], f"rank {r} loaded between forward and backward")


def test_a_sharded_module_is_torchs_fsdp_module(results):
    for got in results:
        assert got["classes"] == {"torch's": [True, True, False], "ours": [True, True, False], "slice": "Sequential"}


def test_every_method_of_torchs_fsdp_module_is_ours():
    inherited = [k for k, v in vars(TorchFSDPModule).items()
                 if callable(v) and k != "__new__" and getattr(FSDPModule, k) is v]
    assert inherited == []


def test_refused_in_one_line(results):
    for got in results:
        assert "build it from model.parameters()" in got["gathered optimizer"]
        foreign = got["foreign"]
        assert "set_model_state_dict" in foreign["full"] and "full_state_dict=True" in foreign["full"]
        assert "another world size" in foreign["other world size"] and "dcp.load" in foreign["other world size"]
        assert foreign["same"] is None
        refusals = got["refusals"]
        assert refusals["two tensor"] is None  # sharded as torch's (its training: test_fsdp_extensions.py)
        assert not refusals["channels_last weight"]
        assert refusals["channels_last"]["torch"] is not None, "torch's refuses it too"
        assert "not contiguous" in refusals["channels_last"]["ours"]
        assert refusals["channels_last"]["ours"].startswith("NotImplementedError: ")  # torch's type: its tests read it
        assert refusals["channels_last"]["torch"].startswith("NotImplementedError: ")
        assert all("\n" not in m for m in (got["gathered optimizer"], foreign["full"]))



CLIPS = ((math.inf, None, 1.0), (math.inf, False, 0.01), (-math.inf, None, 1.0))  # 0.01: every |gradient| < 1


def _clip_job():
    """At 3 ranks a 2-row layer leaves rank 2 empty shards: the +-inf norms over all gradients, clipped and not."""
    out = []
    for norm_type, foreach, scale in CLIPS:
        model = _two_rows()
        fully_shard(model)
        (model(torch.randn(3, 4, generator=torch.Generator().manual_seed(5))).sum() * scale).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), scale, norm_type=norm_type, foreach=foreach)
        out.append((float(norm.full_tensor()), {k: _full(p.grad) for k, p in model.named_parameters()}))
    return {"norms": out, "empty": [p.to_local().numel() == 0 for p in model.parameters()],
            "meta": _meta_init(True)}


def _two_rows():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 5))


def test_clip_grad_norm_inf_with_an_empty_shard_equals_one_process():
    results = launch(_clip_job, 3, timeout=120.0)
    for i, (norm_type, _, scale) in enumerate(CLIPS):
        model = _two_rows()
        (model(torch.randn(3, 4, generator=torch.Generator().manual_seed(5))).sum() * scale).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), scale, norm_type=norm_type)
        for r, got in enumerate(results):
            got_norm, got_grads = got["norms"][i]
            assert got_norm == pytest.approx(float(norm), rel=1e-6), (r, norm_type)
            _same(got_grads, {k: p.grad for k, p in model.named_parameters()}, f"rank {r} clipped, {norm_type}")
    assert results[2]["empty"] == [True, True, False, False], "rank 2's shards of the 2-row layer are empty"
    for r, got in enumerate(results):
        _same(got["meta"], _one_process_meta_init(), f"rank {r}: init_full at 3 ranks")


def test_requires_grad_changed_on_one_rank_only_is_named_on_every_rank(results):
    for r, got in enumerate(results):
        assert got["frozen on one rank"].startswith(f"UnitMismatch: rank {r}: fully_shard's unit 3 (FSDPLinear "
                                                    "layers.1) trains other parameters on other ranks"), got


def test_a_divide_factor_that_differs_across_ranks_is_named_on_every_rank(results):
    for r, got in enumerate(results):
        assert got["factor apart"] == (f"UnitMismatch: rank {r}: fully_shard's reduce-scatter of unit 1 (FSDPStack) "
                                       "divides by another gradient divide factor on other ranks (rank 0: 1.0, rank "
                                       "1: 2.0): call set_gradient_divide_factor alike on every rank"), got


def test_init_full_starts_a_meta_model_where_one_process_starts(results):
    single = _one_process_meta_init()
    for r, got in enumerate(results):
        _same(got["meta"]["init_full"], single, f"rank {r}: init_full at 2 ranks")
        assert not torch.equal(got["meta"]["reset"]["layers.0.weight"], single["layers.0.weight"]), \
            "reset_parameters on the shards draws each rank's rows from the same seed"


def test_init_full_seeded_apart_is_named_on_every_rank_and_changes_nothing(results):
    for r, got in enumerate(results):
        message = got["init seeded apart"]["message"]
        assert message.startswith(f"ValueError: rank {r}: init_full differs across ranks") and "layers.0.weight" in \
            message and "seed every rank alike" in message, message
        assert got["init seeded apart"]["unchanged"]


def test_init_full_checks_its_arguments():
    with pytest.raises(ValueError, match=r"module \(Linear\) is not sharded by fully_shard"):
        init_full(nn.Linear(2, 2), _reset)
    with pytest.raises(TypeError, match="init must be callable, got 3"):
        init_full(nn.Linear(2, 2), 3)
