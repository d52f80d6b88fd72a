"""Ranks that call reduce-scatter, all-gather, reduce or broadcast differently: every rank raises, naming itself and
the field, before any data is used; the tensor is unchanged and the group still pairs its messages afterwards.

Before the call check covered these collectives, other sizes on one rank made gloo abort the
process ("Received data size doesn't match"), and other dtypes or roots gave wrong numbers
without an error. One launch per world size (2 and 3 ranks) runs every case; the last rank
differs. The assertions run here, in the parent.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from manualdp.spmd import all_gather, allreduce, broadcast, launch, reduce, reduce_scatter

CALLS = {"reduce_scatter": lambda t, **kw: reduce_scatter(t, timeout=20, **kw),
         "all_gather": lambda t, **kw: all_gather(t, timeout=20, **kw),
         "reduce": lambda t, root=0, **kw: reduce(t, root, timeout=20, **kw),
         "broadcast": lambda t, root=0, **kw: broadcast(t, root, timeout=20, **kw)}


def _try(out, name, fn, tensor):
    before = tensor.clone()
    try:
        fn()
        out[name] = ("ok",)
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        out[name] = ("err", type(e).__name__, str(e), torch.equal(tensor, before))


def _job():
    torch.set_num_threads(1)
    r, n = dist.get_rank(), dist.get_world_size()
    last = r == n - 1
    out = {}
    for name, call in CALLS.items():
        t = torch.arange(10.0 if last else 12.0)
        _try(out, f"{name} size", lambda: call(t), t)
        t = torch.arange(12, dtype=torch.int32 if last else torch.float32)
        _try(out, f"{name} dtype", lambda: call(t), t)
        t = torch.ones(0 if last else 12)
        _try(out, f"{name} empty on one rank", lambda: call(t), t)
        t = torch.arange(12.0)
        _try(out, f"{name} segment_bytes", lambda: call(t, segment_bytes=8 if last else 16), t)
        if name in ("reduce", "broadcast"):
            t = torch.arange(12.0) + r
            _try(out, f"{name} root", lambda: call(t, root=1 if last else 0), t)
    t = torch.arange(12.0)
    _try(out, "all_gather against allreduce", lambda: allreduce(t, "ring", timeout=20) if last else all_gather(t),
         t)
    t = torch.arange(12.0)
    _try(out, "broadcast against reduce", lambda: CALLS["reduce" if last else "broadcast"](t), t)
    # the group still pairs its messages, and each collective gives what it gives unchecked
    for check in (True, False):
        x = torch.arange(12.0) + r
        mine = reduce_scatter(x.clone(), timeout=20, check=check).clone()
        gathered = x.clone()
        all_gather(gathered, timeout=20, check=check)
        summed = x.clone()
        reduce(summed, n - 1, timeout=20, check=check)
        copied = x.clone()
        broadcast(copied, n - 1, timeout=20, check=check)
        out[f"after {check}"] = {"reduce_scatter": mine, "all_gather": gathered, "reduce": summed, "broadcast": copied}
    return out


@functools.lru_cache(maxsize=None)
def _results(n):
    return launch(_job, n, timeout=180)


def _raised(results, name, collective, *parts):
    for r, out in enumerate(results):
        assert out[name][0] == "err", (r, name, out[name])
        _, kind, message, unchanged = out[name]
        assert kind == "ValueError", (r, name, kind, message)
        assert message.startswith(f"rank {r}: {collective} called differently across ranks: "), (r, name, message)
        for part in parts:
            assert part in message, (r, name, part, message)
        assert unchanged, (r, name, "the refused call changed the tensor")


def _per(n, a, b):
    return "(per rank: " + ", ".join([a] * (n - 1) + [b]) + ")"


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("collective", sorted(CALLS))
def test_another_size_dtype_or_segment_size_on_one_rank_raises_on_every_rank(n, collective):
    res = _results(n)
    _raised(res, f"{collective} size", collective, "elements 10..12 " + _per(n, "12", "10"))
    _raised(res, f"{collective} dtype", collective, "dtype int32..float32 " + _per(n, "float32", "int32"))
    _raised(res, f"{collective} empty on one rank", collective, "elements 0..12 " + _per(n, "12", "0"))
    _raised(res, f"{collective} segment_bytes", collective, "segment_bytes 8..16 " + _per(n, "16", "8"))


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("collective", ["reduce", "broadcast"])
def test_another_root_on_one_rank_raises_on_every_rank(n, collective):
    _raised(_results(n), f"{collective} root", collective, "root 0..1 " + _per(n, "0", "1"))


@pytest.mark.parametrize("n", [2, 3])
def test_another_collective_on_one_rank_raises_on_every_rank(n):
    res = _results(n)
    for r, out in enumerate(res):
        mine = "allreduce" if r == n - 1 else "all_gather"
        assert out["all_gather against allreduce"][2].startswith(f"rank {r}: {mine} called differently"), out
        assert "collective allreduce..all_gather" in out["all_gather against allreduce"][2], out
        assert out["broadcast against reduce"][0] == "err" and "collective reduce..broadcast" in \
            out["broadcast against reduce"][2], out


@pytest.mark.parametrize("n", [2, 3])
def test_after_the_refusals_every_collective_is_right(n):
    res = _results(n)
    total = sum(torch.arange(12.0) + r for r in range(n))
    for r, out in enumerate(res):
        for name, got in out["after True"].items():
            assert torch.equal(got, out["after False"][name]), (r, name)  # the check changes nothing
        assert torch.equal(out["after True"]["all_gather"], res[0]["after True"]["all_gather"]), r
        assert torch.equal(out["after True"]["broadcast"], torch.arange(12.0) + n - 1), r
    assert torch.equal(res[n - 1]["after True"]["reduce"], total)
    assert torch.equal(torch.sort(torch.cat([out["after True"]["reduce_scatter"] for out in res])).values, total)
