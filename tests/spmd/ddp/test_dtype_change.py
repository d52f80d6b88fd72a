"""The drop-in after `model.double()`: its buckets follow the parameters' dtype, so that training equals a float64
run in one process (before: float32 buckets, 1.3e-8 off; torch's DDP is off by far more). One rank alone casting its
model makes every rank raise, naming the difference.
"""
import torch
import torch.distributed as dist
from torch import nn

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch


def _xs(n):
    return [torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) / 3 for r in range(n)]


def _job():
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for view in (False, True):
        torch.manual_seed(0)
        net = nn.Linear(4, 2)
        model = DistributedDataParallel(net, algorithm="ring", gradient_as_bucket_view=view, timeout=20)
        net.double()
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        for _ in range(2):
            opt.zero_grad()
            model(_xs(n)[rank]).pow(2).sum().backward()
            opt.step()
        out[view] = [p.detach().clone() for p in net.parameters()]
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    model = DistributedDataParallel(net, algorithm="ring", timeout=20)
    if rank == n - 1:
        net.double()
    try:
        model(_xs(n)[rank].to(net.weight.dtype)).pow(2).sum().backward()
        out["one rank"] = None
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        out["one rank"] = f"{type(e).__name__}: {e}"
    return out


def _reference(n):
    """Two steps of SGD on the whole global batch, in float64, in one process."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        (sum(net(x).pow(2).sum() for x in _xs(n)) / n).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def test_the_drop_in_after_model_double_trains_in_float64_and_one_rank_casting_raises_everywhere():
    n = 2
    want = _reference(n)
    for rank, out in enumerate(launch(_job, n, timeout=120)):
        for view in (False, True):
            for got, ref in zip(out[view], want):
                assert got.dtype == torch.float64
                torch.testing.assert_close(got, ref, rtol=0, atol=1e-13)
        message = out["one rank"]
        assert message is not None and f"rank {rank}: " in message and "differs across ranks" in message \
            or "called differently across ranks" in message, message
