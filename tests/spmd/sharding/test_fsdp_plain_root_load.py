"""`fully_shard` on the children only, then `load_state_dict` on the plain (unsharded) root: a refused load changes no
parameter (issue 43; was: torch's loader walks the children in order, so those before the refused one were loaded,
a half-loaded model). Refused: a full tensor where the last child holds a shard; a missing key under strict=True.
A good load still loads every shard.
"""
import torch
import torch.distributed as dist
from torch import nn

from manualdp.spmd import launch
from manualdp.spmd.sharding.fsdp import fully_shard
from tests.helpers import error_of


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    for i in (0, 2, 4):
        fully_shard(model[i], timeout=20)  # the root stays a plain Sequential
    return model


def _locals(model):
    return {k: v.to_local().clone() for k, v in model.state_dict().items()}


def _job():
    torch.set_num_threads(1)
    model = _model()
    before = _locals(model)
    shifted = {k: v + 1 for k, v in model.state_dict().items()}  # DTensor shards, each one larger
    full_last = dict(shifted, **{"4.weight": torch.zeros(2, 6)})  # a full tensor where child 4 holds a shard
    missing = {k: v for k, v in shifted.items() if k != "4.bias"}
    out = {"full": error_of(lambda: model.load_state_dict(full_last))}
    out["full unchanged"] = all(torch.equal(v, before[k]) for k, v in _locals(model).items())
    out["missing"] = error_of(lambda: model.load_state_dict(missing))
    out["missing unchanged"] = all(torch.equal(v, before[k]) for k, v in _locals(model).items())
    out["good"] = error_of(lambda: model.load_state_dict(shifted))
    out["good loaded"] = all(torch.equal(v, before[k] + 1) for k, v in _locals(model).items())
    out["rank"] = dist.get_rank()
    return out


def test_a_refused_load_into_a_plain_root_over_sharded_children_leaves_every_parameter_unchanged():
    for out in launch(_job, 2, timeout=240):
        full, missing = out["full"], out["missing"]
        assert full is not None and full.startswith("ValueError: load_state_dict: 4.weight is a full tensor of "
                                                    "shape (2, 6)") and "\n" not in full, (out["rank"], full)
        assert out["full unchanged"], out["rank"]
        assert missing is not None and "missing key(s) 4.bias" in missing and "\n" not in missing, missing
        assert out["missing unchanged"], out["rank"]
        assert out["good"] is None and out["good loaded"], out
