"""bench/spread.py: a ratio's spread over rounds, the load average during a run, and `--load`'s busy processes."""
import os

import pytest

from bench.spread import busy, format_load, format_spread, measured_load, spread


def test_spread_is_min_median_max_and_refuses_nothing_to_spread():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"min": 1.0, "median": 2.5, "max": 10.0}
    assert format_spread(spread([0.9, 1.1, 1.0])) == "1.00 (0.90-1.10)"
    with pytest.raises(ValueError, match="values must hold at least one number"):
        spread([])


def test_busy_processes_run_during_the_block_and_are_gone_after():
    with busy(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.returncode is not None for p in procs)
    with pytest.raises(RuntimeError, match="inside"), busy(1) as procs:
        raise RuntimeError("inside")
    assert procs[0].returncode is not None  # ended when the block raised too
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"processes must be a non-negative int, got {bad!r}"), busy(bad):
            pass
    with busy(0) as none:
        assert none == []


def test_measured_load_counts_one_busy_process_per_core_and_samples_the_load_average():
    with measured_load(True) as info:
        assert info["busy_processes"] == (os.cpu_count() or 1)
    avg = info["loadavg_1min"]
    assert avg["start"] >= 0 and avg["max"] >= max(avg["start"], avg["end"])
    assert f"--load: {os.cpu_count()} busy processes" in format_load(info)
    with measured_load(False) as quiet:
        pass
    assert quiet["busy_processes"] == 0 and "--load" not in format_load(quiet)
