"""`fully_shard`: a load refused anywhere changes no shard, and a replicated whole value loads as torch's (issue 43).

Before: a float or a list for a sharded parameter passed `check_whole`, and a meta DTensor reached torch's loader,
which wrote the keys before it and raised (a half-loaded model); a Replicate DTensor holding the whole value for a
Shard(0) parameter was refused as "a shard cut for another world size", where torch's FSDP2 loads this rank's shard
of it. Now the three are refused in one line, a user's pre-hook that raises after the first layer loaded is undone
(`shards_kept`), every refusal leaves every shard and buffer bitwise as it was on every rank, and the replicated
value loads equal to torch's `fully_shard`.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh

from manualdp.spmd import launch
from manualdp.spmd.sharding.fsdp import fully_shard
from tests.helpers import error_of


def _sharded(shard=fully_shard):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))  # 3 rows of 1.bias: uneven at 2
    shard(model[0])
    shard(model[2])
    shard(model)
    return model


def _locals(model) -> dict:
    return {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _refusing(module, *args):
    raise RuntimeError("the user's pre-hook refuses")


def _job():
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _sharded()
    plus = {k: v + 1 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    before, out = _locals(model), {}
    meta = DTensor.from_local(torch.empty(model[2].bias.to_local().shape, device="meta"), mesh, [Shard(0)],
                              run_check=False, shape=model[2].bias.shape, stride=model[2].bias.stride())
    for row, value in (("B1 float", 3.0), ("B2 list", [1.0, 2.0, 3.0]), ("B12 meta", meta)):
        said = error_of(lambda: model.load_state_dict({**plus, "2.bias": value}))
        out[row] = (said, _same(before, _locals(model)))
    handle = model[2].register_load_state_dict_pre_hook(_refusing)  # raises after layer 0 loaded: put back
    out["hook"] = (error_of(lambda: model.load_state_dict(plus)), _same(before, _locals(model)))
    handle.remove()
    whole = torch.tensor([7.0, 8.0, 9.0])
    replicated = {**plus, "2.bias": DTensor.from_local(whole, mesh, [Replicate()])}
    out["B4"] = error_of(lambda: model.load_state_dict(replicated))
    out["B4 whole"] = torch.equal(model[2].bias.full_tensor(), whole)
    theirs = _sharded(torch_fully_shard)
    theirs.load_state_dict({**plus, "2.bias": DTensor.from_local(whole, theirs[2].bias.device_mesh, [Replicate()])})
    out["B4 as torch's"] = _same(_locals(theirs), _locals(model))
    plain_root = _sharded(lambda module: module if isinstance(module, nn.Sequential) else fully_shard(module))
    replicated = {**plain_root.state_dict(), "2.bias": DTensor.from_local(whole, mesh, [Replicate()])}
    out["B4 plain root"] = error_of(lambda: plain_root.load_state_dict(replicated))
    out["B4 plain root whole"] = torch.equal(plain_root[2].bias.full_tensor(), whole)
    return out


def test_a_refused_load_changes_no_shard_and_a_replicated_whole_value_loads_as_torchs():
    for rank, out in enumerate(launch(_job, 2, timeout=240)):
        for row in ("B1 float", "B2 list"):
            said, unchanged = out[row]
            assert said is not None and "2.bias is a" in said and "not a tensor" in said and "\n" not in said, \
                (rank, row, said)
            assert unchanged, (rank, row)
        said, unchanged = out["B12 meta"]
        assert said is not None and "2.bias is on the meta device" in said and "\n" not in said, (rank, said)
        assert unchanged, rank
        assert out["hook"] == ("RuntimeError: the user's pre-hook refuses", True), (rank, out["hook"])
        assert out["B4"] is None and out["B4 whole"] and out["B4 as torch's"], (rank, out)
        assert out["B4 plain root"] is None and out["B4 plain root whole"], (rank, out)

