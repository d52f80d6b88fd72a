"""The opt-in desync check: ranks about to reduce different buckets all raise, naming the parameter."""
import copy
import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch

JOB_TIMEOUT = 120.0


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x, use_b):
        h = torch.tanh(self.trunk(x))
        return self.b(h) + self.a(h) if use_b else self.a(h)


def _agreeing():
    """Debug mode on (by environment variable) with unused parameters that differ by rank: no false alarm."""
    rank = dist.get_rank()
    os.environ["MANUALDP_DEBUG"] = "1"
    torch.manual_seed(0)
    module = _TwoHeads().double()
    ours = DistributedDataParallel(copy.deepcopy(module), find_unused_parameters=True)
    del os.environ["MANUALDP_DEBUG"]
    theirs = TorchDDP(copy.deepcopy(module), find_unused_parameters=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    g = torch.Generator().manual_seed(rank)
    rows = []
    for step in range(3):
        X = torch.randn(5, 6, generator=g, dtype=torch.float64)
        for m, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            m(X, use_b=rank == 1).pow(2).sum().backward()
            opt.step()
        rows.append((torch.cat([p.detach().reshape(-1) for p in ours.parameters()]),
                     torch.cat([p.detach().reshape(-1) for p in theirs.parameters()])))
    return {"debug": ours.debug, "rows": rows}


def _out_of_order():
    """Two wrappers, backward passes in opposite orders on the two ranks: caught before any message is sent."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    # the replicas' check off: at the first forward it would name the two wrappers before the buckets are compared
    wide = DistributedDataParallel(nn.Linear(6, 4), debug=True, drift_check_every=0)
    narrow = DistributedDataParallel(nn.Linear(6, 3), debug=True, drift_check_every=0)
    order = [wide, narrow] if rank == 0 else [narrow, wide]
    try:
        for model in order:
            model(torch.randn(2, 6)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


def _job():
    return {"agreeing": _agreeing(), "out_of_order": _out_of_order()}


@functools.lru_cache(maxsize=None)
def _results():
    return launch(_job, 2, (), timeout=JOB_TIMEOUT)


def test_debug_mode_trains_like_torch_ddp_with_rank_dependent_unused_parameters():
    for result in _results():
        assert result["agreeing"]["debug"] is True
        for ours, theirs in result["agreeing"]["rows"]:
            assert torch.allclose(ours, theirs, rtol=0, atol=1e-12)


def test_desync_raises_on_every_rank_naming_the_bucket_and_parameter():
    for result in _results():
        message = result["out_of_order"]
        assert message is not None and "desync" in message
        assert "numel 21..28 (per rank: " in message
        assert "unused parameters (per rank: " in message


def test_debug_must_be_a_boolean():
    with pytest.raises(TypeError, match="debug"):
        DistributedDataParallel(nn.Linear(2, 2), debug="yes")
