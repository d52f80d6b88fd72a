"""A plain root with tensors of its own and a plain child before a sharded child: a refused load names what torch's
loader had already loaded (was: "nothing was loaded", with the root's own parameter and the plain child loaded);
with the root sharded too, as the message advises, a refused load changes nothing.
"""
import torch
import torch.distributed as dist
from torch import nn

from manualdp.spmd import launch
from manualdp.spmd.sharding.fsdp import fully_shard
from tests.helpers import error_of


class Root(nn.Module):
    """A parameter of its own, a plain child, then a child to shard."""

    def __init__(self) -> None:
        super().__init__()
        self.scale, self.a, self.b = nn.Parameter(torch.ones(4)), nn.Linear(4, 4), nn.Linear(4, 4)


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in model.state_dict().items()}


def _refused(shard_root: bool) -> dict:
    torch.manual_seed(0)
    model = Root()
    fully_shard(model.b, timeout=20)
    if shard_root:
        fully_shard(model, timeout=20)
    before = _locals(model)
    missing = {k: v + 1 for k, v in model.state_dict().items() if k != "b.bias"}  # strict=True: a missing key
    error = error_of(lambda: model.load_state_dict(missing))
    changed = sorted(k for k, v in _locals(model).items() if not torch.equal(v, before[k]))
    return {"error": error, "changed": changed}


def _job() -> dict:
    torch.set_num_threads(1)
    return {"plain": _refused(False), "sharded": _refused(True), "rank": dist.get_rank()}


def test_a_refusal_under_a_plain_root_names_what_torch_had_loaded_and_a_sharded_root_changes_nothing():
    for out in launch(_job, 2, timeout=240):
        plain, sharded = out["plain"], out["sharded"]
        error = plain["error"]
        assert error is not None and "\n" not in error and "missing key(s) b.bias" in error, (out["rank"], error)
        assert "nothing was loaded" not in error, error
        # the line's claim is the truth: exactly those were loaded
        assert plain["changed"] == ["a.bias", "a.weight", "scale"], plain
        assert "had loaded scale, a.weight, a.bias before it reached b" in error and "fully_shard(model)" in error
        assert "missing key(s) b.bias" in sharded["error"] and "nothing was loaded" in sharded["error"], sharded
        assert sharded["changed"] == [], sharded
