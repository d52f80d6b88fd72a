"""bench/ddp_profile.py: CPU per step by thread and counts per step, manualdp's DDP against torch's."""
import cProfile
import pstats

import pytest
import torch

from bench.compare_ddp import NAMES
from bench.ddp_profile import _bare, _counts, format_table, main


def test_a_builtins_own_name_is_read_from_cprofiles_label():
    assert _bare("<method 'copy_' of 'torch._C.TensorBase' objects>") == "copy_"
    assert _bare("<built-in method torch.zeros>") == "zeros"
    assert _bare("<built-in method builtins.len>") == "len"
    assert _bare("grad_ready") == "grad_ready"


def test_counts_per_step_follow_from_the_profiled_calls():
    a, b = torch.ones(4), torch.zeros(4)

    def step():
        b.copy_(a)
        torch.div(a, 2, out=b)  # the reducer's copy out of a bucket
        torch.zeros(2)
        torch.empty(3)

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(4):
        step()
    profile.disable()
    counts = _counts(pstats.Stats(profile), 4, top=3)
    assert counts["copies"] == 2 and counts["tensor_makers"] == 2 and counts["submits"] == 0
    assert counts["calls"] >= 4  # step, copy_, div, zeros, empty each time (and the profiler's own disable once)
    assert len(counts["top"]) == 3


def test_the_table_shows_each_thread_the_total_and_ours_minus_torchs():
    counts = {name: {"calls": 10.0 * (k + 1), "submits": float(k), "copies": 4.0 * k, "tensor_makers": 1.0,
                     "top": [("f", 1.0)]} for k, name in enumerate((*NAMES, "worker"))}
    result = {"model": "mlp", "world_size": 2, "max_diff": 0.0, "counts": counts,
              "cpu_us": {NAMES[0]: {"MainThread": 100, "other": 50}, NAMES[1]: {"MainThread": 120, "manualdp-x": 30}}}
    lines = format_table(result).splitlines()
    row = {line.split()[0]: line.split()[1:] for line in lines[2:6]}
    assert row["MainThread"] == ["100", "120", "20"]
    assert row["other"] == ["50", "0", "-50"]
    assert row["manualdp-x"] == ["0", "30", "30"]
    assert row["total"] == ["150", "150", "0"]
    assert any(line.split()[:2] == ["main:", "calls"] and line.split()[2:] == ["10.0", "20.0", "10.0"]
               for line in lines)


@pytest.mark.soak  # starts rank processes
def test_both_wrappers_are_profiled_and_train_alike(capsys):
    assert main(["--models", "mlp", "--steps", "3", "--warmup", "2", "--batch-size", "16", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "max |parameter difference| 0)" in out
    assert "manualdp's worker per step:" in out and "main: submits" in out
