"""HSDP (issue 43) at 4 ranks (2 x 2): replicas that accumulate uneven numbers of micro-batches train as torch's HSDP.

Replica 0 runs 2 micro-batches per step and replica 1 runs 3, each with `set_requires_all_reduce(False)` before all
but its last: each replica reduce-scatters within its shard group every micro-batch, and all-reduces across the
replicas once, on the last. Torch's `fully_shard` trains so, replicas equal; ours refused it (the all-reduce paired
replicas by their counts of reduce-scatters, and the drift check by their backward passes). Now, with the drift check
on and off, ours ends equal to torch's run in the same processes, its replicas bitwise equal, and the drift check
runs at the same steps on every replica (a step: a backward that all-reduced across the replicas).
A spawned 4-rank run: in the soak (the README suite's drift test holds the check's new count of steps).
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from manualdp.spmd import launch
from manualdp.spmd.ladder.drift import due
from manualdp.spmd.sharding import fsdp_drift
from manualdp.spmd.sharding.fsdp import fully_shard
from tests.helpers import error_of

pytestmark = pytest.mark.soak
STEPS = 4


def _micro(rank: int) -> int:
    """Replica 0 (ranks 0, 1) accumulates 2 micro-batches per step, replica 1 (ranks 2, 3) three."""
    return 2 if rank < 2 else 3


def _train(shard, mesh, **kwargs):
    """STEPS optimizer steps of uneven accumulation; returns (the full parameters, this rank's shards)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    shard(model[0], mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches, the same for both runs
    for _ in range(STEPS):
        micro = _micro(rank)
        for i in range(micro):
            model.set_requires_all_reduce(i == micro - 1)
            model(torch.randn(4, 6, generator=data)).sum().backward()
        opt.step()
        opt.zero_grad()
    return ([p.full_tensor().clone() for p in model.parameters()],
            [p.to_local().clone() for p in model.parameters()])


def _job():
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    calls = []
    compare = fsdp_drift._compare
    fsdp_drift._compare = lambda root, number: (calls.append(number), compare(root, number))[1]
    out = {"rank": dist.get_rank(), "torch": _train(torch_fully_shard, mesh)}
    out["on error"] = error_of(lambda: out.__setitem__("on", _train(fully_shard, mesh)))
    out["checked"] = list(calls)
    out["off error"] = error_of(lambda: out.__setitem__("off", _train(fully_shard, mesh, drift_check_every=0)))
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, out.get("on", (None, None))[1])
    out["replicas' shards"] = shards
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return launch(_job, 4, timeout=300.0)


def _assert_like_torch(out, key):
    assert out[f"{key} error"] is None, out[f"{key} error"]
    for ours, theirs in zip(out[key][0], out["torch"][0]):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_uneven_accumulation_across_replicas_trains_as_torch_hsdp_with_the_drift_check_on():
    for out in _results():
        _assert_like_torch(out, "on")
        # every replica ran the check at the same steps: those due among the STEPS all-reducing steps
        assert out["checked"] == [s for s in range(STEPS) if due(s, 100)], out["checked"]


def test_uneven_accumulation_across_replicas_trains_as_torch_hsdp_with_the_drift_check_off():
    for out in _results():
        _assert_like_torch(out, "off")


def test_uneven_accumulation_leaves_the_replicas_of_each_shard_bitwise_equal():
    for out in _results():
        shards = out["replicas' shards"]
        assert None not in shards, out["on error"]
        for s in range(2):  # rank s of replica 0 and rank 2 + s of replica 1 hold the same shard
            for a, b in zip(shards[s], shards[2 + s]):
                assert torch.equal(a, b)
