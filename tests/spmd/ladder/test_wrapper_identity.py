"""Two wrappers over two same-shaped modules, called a(b(x)) on one rank and b(a(x)) on the other: every rung and the
drop-in raise on every rank naming both wrappers (before: their allreduces paired across the wrappers, replicas
0.042 apart after 2 steps, no error). Called in the same order on every rank, they still average right.
"""
import functools

import torch
import torch.distributed as dist
from torch import nn

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP, launch

WRAPPERS = {"naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP, "bucketed": BucketedDDP,
            "drop-in": functools.partial(DistributedDataParallel, algorithm="ring")}


def _number(wrapper) -> int:
    return getattr(wrapper, "number", None) or getattr(getattr(wrapper, "calls", None), "number", None)


def _job():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, make in WRAPPERS.items():
        for swapped, every in ((True, 0), (True, 1), (False, 1)):  # the replicas' check off: the step check names them
            torch.manual_seed(0)
            a, b = (make(nn.Linear(4, 4), timeout=20, drift_check_every=every) for _ in range(2))
            numbers = (_number(a), _number(b))
            try:
                (a(b(x)) if rank == 0 or not swapped else b(a(x))).pow(2).sum().backward()
                grads = [p.grad.clone() for w in (a, b) for p in w.module.parameters()]
                out[name, swapped, every] = ("ok", numbers, grads)
            except Exception as e:  # noqa: BLE001 - what each rank saw is the result
                out[name, swapped, every] = ("err", numbers, f"{type(e).__name__}: {e}")
            del a, b
    return out


def test_two_wrappers_called_in_another_order_on_one_rank_raise_on_every_rank_naming_both():
    results = launch(_job, 2, timeout=180)
    for name in WRAPPERS:
        for rank, out in enumerate(results):
            assert "called differently across ranks" in out[name, True, 0][2], out[name, True, 0]
            assert "replica at step 0 differs across ranks: wrapper " in out[name, True, 1][2], out[name, True, 1]
            for every in (0, 1):  # the step check names them, or with the replicas' check on, that check first
                kind, (a, b), message = out[name, True, every]
                assert kind == "err", (name, rank, message)
                assert message.startswith((f"ValueError: rank {rank}: ", f"RuntimeError: rank {rank}: ")), message
                assert "as a(b(x)) on one rank and b(a(x)) on another" in message, message
                assert f"wrapper #{a}..#{b} (per rank: " in message, (name, rank, message)
        # the same order everywhere: no error, and the ranks hold the same averages
        same = [out[name, False, 1] for out in results]
        assert all(kind == "ok" for kind, _, _ in same), (name, same)
        for g0, g1 in zip(same[0][2], same[1][2]):
            assert torch.equal(g0, g1), name
