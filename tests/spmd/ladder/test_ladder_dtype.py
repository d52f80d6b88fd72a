"""Rung 4 (`BucketedDDP`) after `model.double()`: its buckets follow the parameters' dtype, so the gradients equal a
one-process float64 run's (before: float32 buckets, the gradients rounded); one rank alone casting its model makes
every rank raise, naming the dtype."""
import torch
import torch.distributed as dist
from torch import nn

from manualdp.spmd import launch
from manualdp.spmd.ladder import BucketedDDP


def _xs(n):
    return [torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) / 3 for r in range(n)]


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))


def _job():
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    net = _net()
    model = BucketedDDP(net, bucket_cap_mb=1e-4, timeout=20)  # a few small buckets
    net.double()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    out["grads"] = []
    for _ in range(2):
        opt.zero_grad()
        model(_xs(n)[rank]).pow(2).sum().backward()
        out["grads"].append([p.grad.clone() for p in net.parameters()])
        opt.step()
    net = _net()
    model = BucketedDDP(net, timeout=20, drift_check_every=0)  # the step check alone names the dtype
    if rank == n - 1:
        net.double()
    try:
        model(_xs(n)[rank].to(net[0].weight.dtype)).pow(2).sum().backward()
        out["one rank"] = None
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        out["one rank"] = f"{type(e).__name__}: {e}"
    return out


def _reference(n):
    """The gradients of two steps of SGD on the whole global batch, in float64, in one process."""
    net = _net().double()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    grads = []
    for _ in range(2):
        opt.zero_grad()
        (sum(net(x).pow(2).sum() for x in _xs(n)) / n).backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        opt.step()
    return grads


def test_bucketed_ddp_after_model_double_averages_in_float64_and_one_rank_casting_raises_everywhere():
    for n in (2, 3):
        want = _reference(n)
        for rank, out in enumerate(launch(_job, n, timeout=120)):
            for got_step, want_step in zip(out["grads"], want):
                for got, ref in zip(got_step, want_step):
                    assert got.dtype == torch.float64
                    torch.testing.assert_close(got, ref, rtol=0, atol=1e-13)
            message = out["one rank"]
            assert message is not None and message.startswith(f"ValueError: rank {rank}: "), message
            assert "dtype" in message and "float32" in message and "float64" in message, message
