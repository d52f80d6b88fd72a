"""A rung lives while someone holds it or a graph of its forward awaits backward; then its module is plain again."""
import gc
import pickle

import torch
import torch.distributed as dist
from torch import nn

from manualdp.spmd import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP, launch

RUNGS = (NaiveDDP, FlatDDP, OverlappedDDP, BucketedDDP)


def _job():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for rung in RUNGS:
        torch.manual_seed(0)
        net = nn.Linear(3, 2)
        x = torch.full((4, 3), float(rank + 1))
        rung(net, timeout=30)(x).sum().backward()  # no one holds the rung: its graph does, until backward
        gc.collect()
        want = sum(torch.full((4, 3), float(r + 1)).sum(0) for r in range(n)) / n
        out[f"{rung.__name__} inline"] = torch.allclose(net.weight.grad[0], want)
        net.zero_grad()
        net(x).sum().backward()  # the rung is gone: the rank's own gradient
        out[f"{rung.__name__} after"] = torch.equal(net.weight.grad[0], x.sum(0))
        out[f"{rung.__name__} pickles"] = pickle.loads(pickle.dumps(net)).weight.shape == net.weight.shape
    return out


def test_an_inline_rung_averages_then_lets_its_module_go():
    for r, got in enumerate(launch(_job, 2, timeout=120)):
        assert all(got.values()), (r, {k: v for k, v in got.items() if not v})
