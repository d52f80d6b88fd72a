"""`fully_shard(shard_placement_fn=...)`: parameters cut along another dim train as torch's FSDP2 and as one process.

One spawned run at 2 ranks. Each case trains the same model, data and ranks with our `fully_shard`, with torch's
(where torch's takes the case: it refuses uneven shards past dim 0), and as one process on the whole batch:
- Shard(1) for the first layer's weight, the largest dim for the others (torch's
  `test_train_parity_shard_placement_fn_shard_largest_dim`), Adam and `clip_grad_norm_`: parameters equal torch's
  and the one-process model's; the state dict's placements and the shards' local shapes are torch's; shards and
  their gradients are contiguous (torch's `test_shard_placement_fn_contiguous_params_grads`);
- the same in bfloat16 (float32 reduce) over 2 micro-batches, gradient sync on the last: torch's parameters;
- uneven cuts past dim 0 (a weight of one column at 2 ranks: one rank's shard is empty; a Conv1d weight cut along
  its kernel dim, Shard(-1)), with gradient clipping in the infinity norm: equal to the one-process model, shards
  cut as torch.chunk cuts; the same at 3 ranks;
- its state dict loads into a fresh model, its full state dict (torch's `get_model_state_dict`) is torch's and
  sets a fresh model (`set_model_state_dict`) as torch's; a meta-device model made by `init_full` starts where one
  process does (torch's `test_dp_state_dict_save_load_shard_placement_fn`);
- HSDP on a (2, 2) mesh (soak: 4 ranks): torch's parameters and placements `(Replicate(), Shard(dim))`;
- bad return values (an int, Replicate(), a dim past the end, a raising callable, one dim per rank) and a callable
  that is not one: refused in one line naming the value, on every rank.
"""
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from manualdp.spmd import launch
from manualdp.spmd.sharding.fsdp import fully_shard
from manualdp.spmd.sharding.fsdp_meta import init_full

from .test_fsdp_like_torch import _case, _full, _refusal
from .test_fsdp_pytorch_behaviours_a import _same

SHARD_FNS = {"ours": fully_shard, "torch": torch_fully_shard}


def _even():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 2))


def _largest_dim(p):
    """As torch's test: Shard(1) for the first weight (6 columns), else the parameter's largest dim."""
    if p.shape == (8, 6):
        return Shard(1)
    return Shard(max(range(p.ndim), key=lambda d: p.shape[d]))


class Uneven(nn.Module):
    """A weight of one column (Shard(1) at 2 ranks: rank 1's shard is empty) and a Conv1d cut along its kernel."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(1, 5)
        self.conv = nn.Conv1d(5, 3, kernel_size=3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))                       # (B, 5)
        h = self.conv(h.unsqueeze(-1).expand(-1, 5, 3))  # (B, 3, 1)
        return self.head(torch.tanh(h.squeeze(-1)))


def _uneven_fn(p):
    return {(5, 1): Shard(1), (3, 5, 3): Shard(-1)}.get(tuple(p.shape))


def _batches(width, rank, n, steps=3, rows=4):
    """Per step, (this rank's rows, the whole batch) of a batch of `rows` per rank."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        x = torch.randn(rows * n, width, generator=g)
        out.append((x[rank * rows:(rank + 1) * rows], x))
    return out


def _train(model, batches, shard_fn=None, placement=None, whole=False, norm_type=2.0):
    """Adam with gradient clipping; `shard_fn`: each child unit, then the root; `whole`: one process, whole batch."""
    if shard_fn is not None:
        for child in model.children():
            if any(True for _ in child.parameters()):
                shard_fn(child, shard_placement_fn=placement)
        shard_fn(model, shard_placement_fn=placement)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for local, full in batches:
        model(full if whole else local).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5, norm_type=norm_type)
        opt.step()
        opt.zero_grad()
    return model


def _layout(model):
    """Per parameter: placements, local shape, whether the shard and its last gradient are contiguous."""
    model(torch.randn(2, 6)).sum().backward()
    return {name: (tuple(p.placements), tuple(p.to_local().shape), p.to_local().is_contiguous(),
                   p.grad.to_local().is_contiguous(), tuple(p.grad.placements))
            for name, p in model.named_parameters()}


def _params(model):
    return {name: _full(p) for name, p in model.named_parameters()}


def _even_case(shard_fn, rank, n):
    model = _train(_even(), _batches(6, rank, n), shard_fn, _largest_dim)
    sd = {k: tuple(v.placements) for k, v in model.state_dict().items() if isinstance(v, DTensor)}
    return {"params": _params(model), "state_dict": sd, "layout": _layout(model)}


def _accumulated(shard_fn, rank, n):
    """bfloat16 compute, float32 reduce, 2 micro-batches per step with gradient sync on the last only."""
    model = _even()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in (model[0], model[2], model[4], model):
        shard_fn(m, shard_placement_fn=_largest_dim, mp_policy=policy)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for local, _ in _batches(6, rank, n):
        for k, half in enumerate(local.split(2)):
            model.set_requires_gradient_sync(k == 1)
            model(half).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


def _uneven_case(rank, n):
    model = _train(Uneven(), _batches(1, rank, n), fully_shard, _uneven_fn, norm_type=math.inf)
    return {"params": _params(model), "local": {k: tuple(p.to_local().shape) for k, p in model.named_parameters()},
            "placements": {k: tuple(p.placements) for k, p in model.named_parameters()}}


def _state_dicts(shard_fn, rank, n):
    """A Shard(1) model's state dict loaded into a fresh one; a full one set by torch's utility; meta init (ours)."""
    trained = _train(_even(), _batches(6, rank, n), shard_fn, _largest_dim)
    fresh = _even()
    for m in (fresh[0], fresh[2], fresh[4], fresh):
        shard_fn(m, shard_placement_fn=_largest_dim)
    fresh.load_state_dict(trained.state_dict())
    full = get_model_state_dict(trained, options=StateDictOptions(full_state_dict=True))
    other = _even()
    for m in (other[0], other[2], other[4], other):
        shard_fn(m, shard_placement_fn=_largest_dim)
    set_model_state_dict(other, full, options=StateDictOptions(full_state_dict=True))
    out = {"loaded": _params(fresh), "full": {k: _full(v) for k, v in full.items()}, "set": _params(other)}
    if shard_fn is fully_shard:
        with torch.device("meta"):
            meta = _even()
        for m in (meta[0], meta[2], meta[4], meta):
            shard_fn(m, shard_placement_fn=_largest_dim)
        meta.to_empty(device="cpu")
        torch.manual_seed(0)
        init_full(meta, lambda m: [c.reset_parameters() for c in m.modules() if isinstance(c, nn.Linear)])
        out["meta"] = _params(meta)
    return out


def _three_job():
    """At 3 ranks (a rank's block of the flat buffer holds two ranks' rows): ours and one process, uneven cuts."""
    rank, n = dist.get_rank(), dist.get_world_size()
    return {"ours": _uneven_case(rank, n)["params"],
            "one process": _params(_train(Uneven(), _batches(1, rank, n), whole=True, norm_type=math.inf))}


def _bad_values():
    bad = {"int": lambda p: 3, "Replicate": lambda p: Replicate(), "past the end": lambda p: Shard(2),
           "raises": lambda p: 1 / 0, "per rank": lambda p: Shard(dist.get_rank() % p.ndim)}
    out = {name: _refusal(lambda fn=fn: fully_shard(_even(), shard_placement_fn=fn)) for name, fn in bad.items()}
    out["not callable"] = _refusal(lambda: fully_shard(_even(), shard_placement_fn=Shard(1)))
    return out


def _job():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {name: _case(_even_case, fn, rank, n) for name, fn in SHARD_FNS.items()}
    out["accumulated"] = {name: _case(_accumulated, fn, rank, n) for name, fn in SHARD_FNS.items()}
    out["even, one process"] = _params(_train(_even(), _batches(6, rank, n), whole=True))
    out["uneven"] = _case(_uneven_case, rank, n)
    out["uneven, one process"] = _params(_train(Uneven(), _batches(1, rank, n), whole=True, norm_type=math.inf))
    out["bad"] = _case(_bad_values)
    out["state dicts"] = {name: _case(_state_dicts, fn, rank, n) for name, fn in SHARD_FNS.items()}
    return out


@pytest.fixture(scope="module")
def results():
    return launch(_job, 2, timeout=240.0)


def test_parameters_cut_along_their_largest_dim_train_as_torch_and_as_one_process(results):
    start = _params(_even())
    for r, got in enumerate(results):
        assert "raised" not in got["ours"] and "raised" not in got["torch"], (got["ours"], got["torch"])
        _same(got["ours"]["params"], got["torch"]["params"], f"rank {r}: ours against torch's")
        _same(got["ours"]["params"], got["even, one process"], f"rank {r}: ours against one process", atol=1e-5)
        assert any(not torch.equal(got["ours"]["params"][k], start[k]) for k in start)  # it trained


def test_micro_batches_in_bfloat16_without_gradient_sync_train_as_torch_does(results):
    for r, got in enumerate(results):
        _same(got["accumulated"]["ours"], got["accumulated"]["torch"], f"rank {r}: accumulated", atol=1e-5)
        assert not torch.equal(got["accumulated"]["ours"]["0.weight"], _even()[0].weight)  # it trained


def test_the_state_dict_and_the_shards_are_placed_and_cut_as_torch_does(results):
    for got in results:
        ours, theirs = got["ours"], got["torch"]
        assert ours["state_dict"] == theirs["state_dict"]
        assert ours["state_dict"]["0.weight"] == (Shard(1),) and ours["state_dict"]["0.bias"] == (Shard(0),)
        assert ours["layout"] == theirs["layout"]
        assert all(contiguous and grad_contiguous for _, _, contiguous, grad_contiguous, _ in ours["layout"].values())


def test_uneven_cuts_past_dim_0_train_as_one_process_and_cut_as_torch_chunk_does(results):
    shapes = {k: tuple(p.shape) for k, p in Uneven().named_parameters()}
    dims = {"a.weight": 1, "conv.weight": 2}
    for r, got in enumerate(results):
        assert "raised" not in got["uneven"], got["uneven"]
        _same(got["uneven"]["params"], got["uneven, one process"], f"rank {r}: uneven against one process", atol=1e-5)
        for k, shape in shapes.items():
            dim = dims.get(k, 0)
            chunk = math.ceil(shape[dim] / 2)
            rows = max(0, min(chunk, shape[dim] - r * chunk))
            assert got["uneven"]["local"][k] == shape[:dim] + (rows,) + shape[dim + 1:], (r, k)
            assert got["uneven"]["placements"][k] == (Shard(dim),)
    assert results[1]["uneven"]["local"]["a.weight"] == (5, 0)  # an empty shard, and its infinity norm (0) still worked


def test_uneven_cuts_past_dim_0_at_3_ranks_train_as_one_process():
    for r, got in enumerate(launch(_three_job, 3, timeout=240.0)):
        _same(got["ours"], got["one process"], f"rank {r} of 3", atol=1e-5)


def test_a_bad_shard_placement_fn_is_refused_in_one_line_naming_the_value_on_every_rank(results):
    for got in results:
        bad = got["bad"]
        assert all(v is not None and "\n" not in v for v in bad.values()), bad
        assert bad["int"].startswith("ValueError") and "returned 3 for" in bad["int"]
        assert "Replicate()" in bad["Replicate"] and "expected Shard(dim)" in bad["Replicate"]
        assert "Shard(2)" in bad["past the end"] and "2 dims" in bad["past the end"]
        assert "ZeroDivisionError" in bad["raises"]
        assert "Shard(1)" in bad["per rank"] and "rank" in bad["per rank"]
        assert bad["not callable"].startswith("TypeError") and "shard_placement_fn" in bad["not callable"]


def test_a_shard_placement_fn_models_state_dicts_load_and_set_as_torch_does_and_meta_init_is_one_process_init(results):
    for r, got in enumerate(results):
        ours, theirs = got["state dicts"]["ours"], got["state dicts"]["torch"]
        assert "raised" not in ours and "raised" not in theirs, (ours, theirs)
        _same(ours["loaded"], got["ours"]["params"], f"rank {r}: loaded")
        _same(ours["full"], theirs["full"], f"rank {r}: full state dict against torch's")
        _same(ours["full"], ours["loaded"], f"rank {r}: full state dict")
        _same(ours["set"], theirs["set"], f"rank {r}: set from a full state dict, against torch's")
        _same(ours["set"], ours["loaded"], f"rank {r}: set from a full state dict")
        _same(ours["meta"], _params(_even()), f"rank {r}: meta init against one process", atol=0)


def _hsdp_job():
    """HSDP on a (2, 2) mesh, every parameter cut along its last dim: ours and torch's, 3 Adam steps."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    for name, shard_fn in SHARD_FNS.items():
        model = _even()
        for m in (model[0], model[2], model[4], model):
            shard_fn(m, mesh=mesh, shard_placement_fn=lambda p: Shard(p.ndim - 1))
        out[name] = _train(model, _batches(6, dist.get_rank(), 4))
        out[name] = {k: (_full(p), tuple(p.placements)) for k, p in model.named_parameters()}
    return out


@pytest.mark.soak
def test_hsdp_with_a_shard_placement_fn_trains_and_is_placed_as_torch_does():
    for r, got in enumerate(launch(_hsdp_job, 4, timeout=240.0)):
        assert list(got["ours"]) == list(got["torch"])
        for k, (ours, placements) in got["ours"].items():
            theirs, their_placements = got["torch"][k]
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6, msg=f"rank {r}: {k}")
            assert placements == their_placements == (Replicate(), Shard(ours.dim() - 1)), (r, k, placements)
