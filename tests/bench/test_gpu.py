"""bench/gpu.sh and the benchmarks' --backend nccl, on a machine without CUDA; bench/test_gpu.py checks them on GPUs."""
import os
import pathlib
import subprocess
import time

import pytest
import torch

from bench.common import Stopwatch

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def no_gpu(monkeypatch):
    """This process sees no GPU, also on a machine that has some."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_without_cuda_gpu_sh_says_so_and_exits_0_having_run_nothing(tmp_path):
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh")], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUT": str(tmp_path / "gpu")})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ("bench/gpu.sh: no CUDA device here (torch.cuda.is_available() is False); "
                                  "nothing to run")
    assert not (tmp_path / "gpu").exists()


@pytest.mark.parametrize("module, argv", [
    ("compare_ddp", ["--world-size", "2"]),
    ("scaling", ["--world-sizes", "1", "2"]),
    ("allreduce", ["--spmd", "--world-size", "2"]),
    ("zero", ["--world-size", "2"]),
])
def test_backend_nccl_without_a_gpu_per_rank_is_refused_before_any_rank_starts(module, argv, capsys, monkeypatch,
                                                                                no_gpu):
    import importlib

    import manualdp.spmd
    bench = importlib.import_module(f"bench.{module}")
    monkeypatch.setattr(manualdp.spmd, "launch", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as e:
        bench.main([*argv, "--backend", "nccl"])
    assert e.value.code == 2
    assert "--backend nccl needs a GPU per rank: 2 ranks, 0 GPU(s) here" in capsys.readouterr().err


def test_launch_refuses_nccl_without_a_gpu_per_rank(no_gpu):
    from manualdp.spmd import launch
    with pytest.raises(ValueError, match="backend 'nccl' needs a GPU per rank: 2 ranks, 0 GPU"):
        launch(print, 2, backend="nccl")
    with pytest.raises(ValueError, match="backend must be one of"):
        launch(print, 2, backend="mpi")


def test_on_a_cpu_the_stopwatch_is_the_host_clock():
    clock = Stopwatch("cpu")
    clock.start()
    time.sleep(0.02)
    assert 0.02 <= clock.stop() < 1.0
    assert not clock.cuda and Stopwatch("cuda:0").cuda  # a GPU is timed by its events (bench/test_gpu.py)
