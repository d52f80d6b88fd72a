"""Chapter 6's exercise 4: `reshard_after_forward=False` on the first layer spares its all-gather in backward."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from manualdp.spmd import full_state_dict, fully_shard, launch, shard
from manualdp.support.trace import COMM, Trace


def _step(keep_first: bool) -> dict:
    """The scene `zero_stages`' ZeRO-3 step in float64; `keep_first` keeps layer 0 whole from forward to backward."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 10)).double()
    X = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).double()
    reference, model, trace = copy.deepcopy(net), copy.deepcopy(net), Trace(pid=rank)
    for k in (0, 2, 4):
        fully_shard(model[k], recorder=trace, reshard_after_forward=not (keep_first and k == 0))
    fully_shard(model, recorder=trace)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    (reference(X).pow(2).sum() / len(X)).backward()
    opt.step()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (model(shard(X, X, rank, n)[0]).pow(2).sum() * n / len(X)).backward()
    opt.step()
    full = full_state_dict(model)
    return {"names": [e["name"] for e in sorted(trace.events, key=lambda e: e["ts"]) if e["cat"] == COMM],
            "differs": max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())}


def _job():
    return {keep: _step(keep) for keep in (False, True)}


@pytest.mark.soak
def test_keeping_the_first_layer_whole_spares_its_gather_in_backward_and_changes_no_number():
    for rank, result in enumerate(launch(_job, 2, timeout=120.0)):
        for keep, step in result.items():
            gathers = [name for name in step["names"] if name.startswith("all_gather 0")]
            assert gathers == (["all_gather 0 (forward)"] if keep else
                               ["all_gather 0 (forward)", "all_gather 0 (prefetch)"]), f"rank {rank}: {step['names']}"
            assert step["differs"] < 1e-10, f"rank {rank}, keep_first={keep}"
