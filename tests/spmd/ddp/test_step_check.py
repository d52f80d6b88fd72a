"""The drop-in's per-step call check compares the step (forward passes that began a synchronised step), at 2 ranks.

- one rank runs one backward pass more in the middle of a step (`retain_graph`): every rank raises one line
  naming the rank and the step (before: its extra allreduces were paired silently with the peers' next step);
- one rank runs a forward pass with grad and no backward (a validation pass): no false alarm, the training
  equals torch's DDP, which allows it.
"""
import copy
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _train(model, x, extra_backward=False, extra_forward=False, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        if extra_forward and step == 1:
            model(x)  # a validation pass with grad on, and no backward
        loss = model(x).pow(2).sum()
        loss.backward(retain_graph=extra_backward and step == 1)
        if extra_backward and step == 1:
            loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _job():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    out = {}
    for debug in (False, True):
        try:
            _train(DistributedDataParallel(_net(), timeout=10, debug=debug), x, extra_backward=rank == 1)
            out["extra backward", debug] = "no error"
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            out["extra backward", debug] = str(e)
    out["extra forward"] = (_train(DistributedDataParallel(_net(), timeout=10), x, extra_forward=rank == 0),
                            _train(TorchDDP(_net()), x, extra_forward=rank == 0))
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return launch(_job, 2, timeout=90)


def test_one_backward_more_on_one_rank_raises_on_every_rank_naming_the_step():
    for r, out in enumerate(_results()):
        message = out["extra backward", False]
        assert message.startswith(f"rank {r}: ") and "\n" not in message.strip(), (r, message)
        assert "step 2..3 (per rank: 3, 2)" in message, (r, message)


def test_in_debug_mode_too_every_rank_raises_naming_the_step():
    for r, out in enumerate(_results()):
        message = out["extra backward", True]
        assert message.startswith(f"rank {r}: ") and "step 2..3 (per rank: 3, 2)" in message, (r, message)


def test_a_forward_without_backward_on_one_rank_trains_as_torchs_ddp():
    for r, out in enumerate(_results()):
        ours, theirs = out["extra forward"]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12, msg=f"rank {r}")
