"""`fully_shard`: a state dict saved with other placements on the same mesh loads, as torch's (issue 43, B02).

Before: a model sharded `Shard(1)` by `shard_placement_fn`, loading a state dict saved with `Shard(0)` (the same
mesh, the same 2 ranks), or the other way, was refused with a line naming the placements; torch's FSDP2
redistributes the values and loads them. Now ours does too: the same script with torch's `fully_shard` gives the
same shards bitwise, they hold the saved full weights, and a step after the load trains alike, on a 1-D mesh and
on HSDP's 2-D mesh. Each move is a collective, so the ranks agree on what moves first: ranks that would move other
values all raise naming them, and so do a rank that moves values and one that moves none and goes on to its
forward (was: a hang). A load that raises after a value moved leaves every shard as it was, bitwise; a
value of another shape on the model's mesh is named by its shape (was: "a shard cut for another world size").
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, Shard

from manualdp.spmd import launch
from manualdp.spmd.sharding.fsdp import fully_shard
from tests.helpers import error_of

SHARD_FNS = {"ours": fully_shard, "torch": torch_fully_shard}
CASES = {"Shard(0) -> Shard(1)": (0, 1), "Shard(1) -> Shard(0)": (1, 0)}  # saved with, loaded into


def _model(shard_fn, seed: int, dim: int, mesh=None) -> nn.Module:
    """Two units and the root, each parameter cut on `dim` (0 for a bias); even sizes at 2 ranks on both dims, as
    torch's refuses an uneven Shard(1)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))
    for module in (model[0], model[2], model):
        shard_fn(module, mesh=mesh, shard_placement_fn=lambda p: Shard(min(dim, p.dim() - 1)))
    return model


def _full(model: nn.Module) -> dict:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _locals(model: nn.Module) -> dict:
    return {k: v.to_local().clone() for k, v in model.state_dict().items()}


def _load_and_step(shard_fn, saved_dim: int, model_dim: int, mesh=None) -> dict:
    """A model cut on `model_dim` loads the state dict of one cut on `saved_dim`, then takes one SGD step."""
    saved = _model(shard_fn, 1, saved_dim, mesh)
    model = _model(shard_fn, 0, model_dim, mesh)
    model.load_state_dict(saved.state_dict())
    out = {"saved": _full(saved), "loaded": _full(model), "locals": _locals(model),
           "placements": {k: tuple(v.placements) for k, v in model.state_dict().items()}}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(10 + dist.get_rank())
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    out["stepped"] = _full(model)
    return out


def _refusing(module, *args):
    raise RuntimeError("the user's pre-hook refuses")


def _kept() -> dict:
    """A load that raises after a value moved (a user's pre-hook on the last layer), ranks that move other values,
    a value of another shape on the model's mesh: the shards as before, bitwise."""
    saved = _model(fully_shard, 1, 0)
    model = _model(fully_shard, 0, 1)
    before, out = _locals(model), {}
    handle = model[2].register_load_state_dict_pre_hook(_refusing)
    out["hook"] = error_of(lambda: model.load_state_dict(saved.state_dict()))
    handle.remove()
    out["hook kept"] = all(torch.equal(before[k], v) for k, v in _locals(model).items())
    moved = "0.weight" if dist.get_rank() == 0 else "2.weight"  # each rank would move one value, not the same
    mixed = {**model.state_dict(), moved: saved.state_dict()[moved]}
    out["disagree"] = error_of(lambda: model.load_state_dict(mixed))
    out["disagree kept"] = all(torch.equal(before[k], v) for k, v in _locals(model).items())
    alone = saved.state_dict() if dist.get_rank() == 0 else model.state_dict()  # rank 1 moves nothing, goes on
    out["alone"] = error_of(lambda: (model.load_state_dict(alone), model(torch.ones(3, 6)).sum().backward()))
    model.zero_grad()
    wider = nn.Linear(8, 4)
    fully_shard(wider, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    out["shape"] = error_of(lambda: model.load_state_dict({**model.state_dict(), "0.weight": wider.weight}))
    out["shape kept"] = all(torch.equal(before[k], v) for k, v in _locals(model).items())
    return out


def _job():
    torch.set_num_threads(1)
    out = {impl: {case: _load_and_step(fn, *dims) for case, dims in CASES.items()} for impl, fn in SHARD_FNS.items()}
    for impl, fn in SHARD_FNS.items():
        mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("replicate", "shard"))
        out[impl]["HSDP"] = _load_and_step(fn, 0, 1, mesh)
    out["kept"] = _kept()
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def results():
    return launch(_job, 2, timeout=240)


def test_a_state_dict_of_other_placements_on_the_same_mesh_loads_as_torchs_and_equals_the_saved_weights(results):
    for rank, got in enumerate(results):
        for case in (*CASES, "HSDP"):
            ours, theirs = got["ours"][case], got["torch"][case]
            assert _equal(ours["saved"], theirs["saved"]), (rank, case)
            assert _equal(ours["loaded"], ours["saved"]), (rank, case, "the saved full weights")
            assert _equal(ours["locals"], theirs["locals"]), (rank, case, "torch's shards")
            assert ours["placements"] == theirs["placements"], (rank, case, ours["placements"])
            assert _equal(ours["stepped"], theirs["stepped"]), (rank, case, "a step after the load")
            assert not _equal(ours["stepped"], ours["loaded"]), (rank, case, "the step moves the weights")
        model_dim = {"Shard(0) -> Shard(1)": 1, "Shard(1) -> Shard(0)": 0}
        for case, dim in model_dim.items():
            assert got["ours"][case]["placements"]["0.weight"] == (Shard(dim),), (rank, case)
        assert got["ours"]["HSDP"]["placements"]["0.weight"] == (Replicate(), Shard(1)), rank


def test_a_raising_load_ranks_moving_other_values_and_another_shape_change_no_shard(results):
    for rank, got in enumerate(r["kept"] for r in results):
        assert got["hook"] == "RuntimeError: the user's pre-hook refuses" and got["hook kept"], (rank, got)
        said = got["disagree"]
        assert said is not None and "redistribution differs across ranks" in said and "\n" not in said, (rank, said)
        assert "0.weight" in said and "2.weight" in said and "same placements" in said, (rank, said)
        assert got["disagree kept"], rank
        said = got["alone"]  # one rank in the load's agreement, the other in the forward's all-gather: both raise
        assert said is not None and "called differently across ranks" in said, (rank, said)
        said = got["shape"]  # on the model's mesh, of another shape: named by its shape, not as another world size
        assert said == "ValueError: load_state_dict: 0.weight has shape (4, 8), and the model's parameter (4, 6): " \
            "load a state dict saved from a model of the same shapes" and got["shape kept"], (rank, said)
