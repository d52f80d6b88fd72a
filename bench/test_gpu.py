"""Checks that need CUDA; `bash bench/gpu.sh` runs them (`pytest -m gpu`), the CPU suite in tests/ never
collects them."""
import time

import pytest
import torch
import torch.distributed as dist

from bench.common import Stopwatch
from manualdp import allreduce, try_all_gpus
from manualdp.schedule import ALGORITHMS
from manualdp.spmd import launch

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
two_gpus = pytest.mark.skipif(GPUS < 2, reason="NCCL takes one GPU per rank: this needs 2")


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_the_book_allreduce_sums_on_gpus(algorithm):
    devices = try_all_gpus()
    devices = (devices * 4)[:max(2, len(devices))]  # one GPU: two simulated devices on it
    tensors = [torch.arange(1000.0, device=d) * (i + 1) for i, d in enumerate(devices)]
    allreduce(tensors, algorithm)
    expected = torch.arange(1000.0) * sum(range(1, len(devices) + 1))
    for t, d in zip(tensors, devices):
        assert t.device == d and torch.equal(t.cpu(), expected)


def test_the_stopwatch_times_gpu_work_not_its_queueing():
    clock = Stopwatch("cuda")
    clock.start()
    queued = time.perf_counter()
    torch.cuda._sleep(200_000_000)  # a kernel that spins about 0.1 s
    queued = time.perf_counter() - queued
    ran = clock.stop()
    assert ran > 10 * queued and ran > 0.01


def _spmd_allreduce(algorithms):
    from manualdp.spmd import allreduce as spmd_allreduce
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for algorithm in algorithms:
        x = torch.arange(1 << 20, dtype=torch.float32, device="cuda") * (rank + 1)
        spmd_allreduce(x, algorithm)
        out[algorithm] = torch.equal(x.cpu(), torch.arange(1 << 20, dtype=torch.float32) * (n * (n + 1) // 2))
    mismatched = torch.ones(6 if rank == 0 else 9, device="cuda")
    try:
        spmd_allreduce(mismatched, "ring", timeout=60)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


@two_gpus
def test_the_spmd_allreduce_sums_over_nccl_and_its_call_check_holds():
    results = launch(_spmd_allreduce, min(GPUS, 4), ([*sorted(ALGORITHMS), "auto"],), backend="nccl", timeout=300)
    for out in results:
        assert all(out[a] for a in [*ALGORITHMS, "auto"]), out
        assert "allreduce called differently across ranks: elements 6..9" in out["mismatch"]
