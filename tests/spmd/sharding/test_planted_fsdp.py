"""`fully_shard`: corners that planted bugs slipped past (issue 20); each test fails with one of them.

test_fsdp.py trains with Adam, which hardly sees a gradient scaled by the world size, and
one backward pass a step. Here: plain SGD, two backward passes a step (the gradients
accumulate in the shards), a unit whose frozen weight backward reads after its trainable
one has its gradient, and where a trace puts the collectives.
"""
import functools

import torch
import torch.distributed as dist
from torch import nn

from manualdp.spmd import full_state_dict, fully_shard, launch, shard
from manualdp.support.trace import Trace

STEPS = 3


def _net():
    """A unit of its own, then a unit whose first layer is frozen: its weight is read after the last layer's grad."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))).double()
    net[2][0].requires_grad_(False)
    return net


def _batches():
    g = torch.Generator().manual_seed(2)
    return [[(torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g))
             for _ in range(2)] for _ in range(STEPS)]


def _step(model, opt, halves, rank, n):
    """Two backward passes, one per half of the global batch; the mean loss over both, times n (averaged)."""
    opt.zero_grad()
    for X, y in halves:
        Xs, ys = shard(X, y, rank, n) if n else (X, y)
        loss = nn.functional.cross_entropy(model(Xs), ys, reduction="sum") / (2 * len(X))
        (loss * (n or 1)).backward()
    opt.step()


def _job():
    rank, n = dist.get_rank(), dist.get_world_size()
    trace = Trace(pid=rank)
    model = _net()
    fully_shard(model[0], recorder=trace)
    fully_shard(model[2], recorder=trace)
    fully_shard(model, recorder=trace)
    single = _net()
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, single)]
    steps = []
    for halves in _batches():
        _step(model, opts[0], halves, rank, n)
        _step(single, opts[1], halves, 0, 0)
        steps.append((full_state_dict(model), {k: v.clone() for k, v in single.state_dict().items()}))
    names = {tid: track for track, tid in trace.tracks.items()}
    tracks = {e["name"]: names[e["tid"]] for e in trace.events if e["ph"] == "X"}
    return {"steps": steps, "tracks": tracks}


@functools.lru_cache(maxsize=None)
def _results():
    return launch(_job, 2, timeout=120.0)


def test_sgd_with_two_backward_passes_a_step_equals_one_process():
    for r, result in enumerate(_results()):
        for step, (ours, single) in enumerate(result["steps"]):
            assert list(ours) == list(single)
            for key in single:
                torch.testing.assert_close(ours[key], single[key], rtol=0, atol=1e-10,
                                           msg=f"rank {r} step {step} {key}")
    first, start = _results()[0]["steps"][-1][1], _net().state_dict()
    assert not torch.equal(first["0.weight"], start["0.weight"]) and torch.equal(first["2.0.weight"], start["2.0.weight"])


def test_a_trace_puts_the_all_gathers_and_reduce_scatters_on_the_comm_track():
    tracks = _results()[0]["tracks"]
    collectives = {name: track for name, track in tracks.items() if name.startswith(("all_gather", "reduce_scatter"))}
    assert any(name.startswith("reduce_scatter") for name in collectives), tracks
    assert set(collectives.values()) == {"comm"}, collectives
