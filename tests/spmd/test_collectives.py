"""The engine's collectives across processes: allreduce, reduce-scatter, all-gather, reduce and broadcast equal
torch.distributed's and the single controller's, bit for bit where they run the same schedule in the same order.

One spawned job per world size (2, 3, 4 ranks, gloo on 127.0.0.1, one thread each, killed
after a timeout) returns tensors; the assertions run here, in the parent.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from manualdp import collectives
from manualdp.allreduce import run_schedule
from manualdp.distributed import allreduce
from manualdp.schedule import ALGORITHMS, get_schedule
from manualdp.spmd import collectives as spmd_collectives
from manualdp.spmd import launch
from manualdp.spmd.transport.group import group_state
from manualdp.spmd.transport.p2p import run_allreduce
from tests.helpers import device_inputs

JOB_TIMEOUT = 240.0
SIZES = [(0, None), (1, None), ("n-1", None), ("n+1", None), (1001, None), (30011, 1000)]  # (numel, segment_bytes)
DTYPES = [torch.float32, torch.float64, torch.int64]
P2P_SIZES = [0, 1, 3, 5, 1001, 30011]


# ---------------------------------------------------------------- what every rank runs

def _input(rank, numel, dtype):
    g = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)


def _numel(size, n):
    return {"n-1": n - 1, "n+1": n + 1}.get(size, size)


def _allreduce_checks():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for algorithm in sorted(ALGORITHMS):
        for size, segment_bytes in SIZES:
            for dtype in DTYPES:
                x = _input(rank, _numel(size, n), dtype)
                ref = x.clone()
                dist.all_reduce(ref)
                kw = {"segment_bytes": segment_bytes} if segment_bytes else {}
                allreduce(x, algorithm, **kw)
                out[(algorithm, size, dtype)] = (x, ref)
        # The executor NCCL would use (one group per round), run here on gloo.
        x = _input(rank, 1001, torch.float64)
        run_allreduce(x, algorithm, group_state(), segment_bytes=800, early=False)
        out[(algorithm, "grouped")] = x
        x = _input(rank, 35, torch.float32).view(7, 5).t()  # not contiguous
        ref = x.contiguous()
        dist.all_reduce(ref)
        allreduce(x, algorithm)
        out[(algorithm, "transposed")] = (x.clone(), ref)
    if n >= 3:  # a group whose rank 0 is global rank 1: group ranks must be mapped to global ones
        group = dist.new_group([1, 2])
        for algorithm in sorted(ALGORITHMS):
            x = _input(rank, 101, torch.float64)
            if rank in (1, 2):
                allreduce(x, algorithm, group)
            out[(algorithm, "group")] = x
    return out


def _p2p_checks():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for numel in P2P_SIZES:
        for dtype in DTYPES:
            x = device_inputs(n, numel, dtype)[rank]
            ref = x.clone()
            dist.all_reduce(ref)
            mine = x.clone()
            out[("reduce_scatter", numel, dtype)] = (spmd_collectives.reduce_scatter(mine, segment_bytes=4000).clone(),
                                                     collectives.chunk(ref, rank, n))
            mine = x.clone()
            spmd_collectives.all_gather(mine)
            parts = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(parts, x)
            ref = torch.empty_like(x)
            for d in range(n):
                collectives.chunk(ref, d, n).copy_(collectives.chunk(parts[d], d, n))
            out[("all_gather", numel, dtype)] = (mine, ref)
            root = n - 1
            mine, ref = x.clone(), x.clone()
            spmd_collectives.reduce(mine, dst=root)
            dist.reduce(ref, dst=root)
            out[("reduce", numel, dtype)] = (mine, ref) if rank == root else (ref, ref)
            mine, ref = x.clone(), x.clone()
            spmd_collectives.broadcast(mine, src=root)
            dist.broadcast(ref, src=root)
            out[("broadcast", numel, dtype)] = (mine, ref)
    return out


def _job():
    return {"p2p": _p2p_checks(), "allreduce": _allreduce_checks()}


@functools.lru_cache(maxsize=None)
def _results(n):
    return launch(_job, n, timeout=JOB_TIMEOUT)


def _p2p_results(n):
    return [ranks["p2p"] for ranks in _results(n)]


# ---------------------------------------------------------------- across processes, against torch.distributed

@pytest.mark.parametrize("n", [2, 3, 4])
def test_spmd_allreduce_equals_all_reduce_and_the_single_controller(n):
    results = _results(n)
    for algorithm in sorted(ALGORITHMS):
        for size, _ in SIZES:
            for dtype in DTYPES:
                key = (algorithm, size, dtype)
                inputs = [_input(r, _numel(size, n), dtype) for r in range(n)]
                run_schedule(get_schedule(algorithm, n), inputs)  # the single-controller executor
                for r in range(n):
                    got, ref = results[r]["allreduce"][key]
                    assert torch.equal(got, results[0]["allreduce"][key][0]), f"{key}: rank {r} differs from rank 0"
                    assert torch.equal(got, inputs[r]), f"{key}: differs from the single-controller executor"
                    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        for r in range(n):
            got, ref = results[r]["allreduce"][(algorithm, "transposed")]
            torch.testing.assert_close(got, ref)
        inputs = [_input(r, 1001, torch.float64) for r in range(n)]
        run_schedule(get_schedule(algorithm, n), inputs)
        for r in range(n):
            assert torch.equal(results[r]["allreduce"][(algorithm, "grouped")], inputs[r]), "grouped executor"


@pytest.mark.parametrize("n", [3, 4])
def test_spmd_allreduce_in_a_subgroup(n):
    results = _results(n)
    for algorithm in sorted(ALGORITHMS):
        expected = _input(1, 101, torch.float64) + _input(2, 101, torch.float64)
        for r in range(n):
            got = results[r]["allreduce"][(algorithm, "group")]
            if r in (1, 2):
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
            else:
                assert torch.equal(got, _input(r, 101, torch.float64)), "a rank outside the group was changed"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_p2p_collectives_equal_torch_distributed_and_the_single_controller(n):
    results = _p2p_results(n)
    for key, pairs in results[0].items():
        collective, numel, dtype = key
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=0, atol=1e-9)
        xs = device_inputs(n, numel, dtype)
        single = [x.clone() for x in xs]
        if collective == "reduce_scatter":
            single = collectives.reduce_scatter(single)
        else:
            getattr(collectives, collective)(single, *(() if collective == "all_gather" else (n - 1,)))
        for r in range(n):
            got, ref = results[r][key]
            torch.testing.assert_close(got, ref, **tol)
            if collective != "reduce" or r == n - 1:  # the same schedule in the same order: bit for bit
                assert torch.equal(got, single[r]), f"{key}: rank {r} differs from the single controller"
