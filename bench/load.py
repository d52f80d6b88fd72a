"""What else the machine was doing during a benchmark: its load average, and `--load`'s busy processes.

    python bench/allreduce.py --spmd --load     # one busy process per core for the whole run

`busy(n)` starts `n` processes that spin (`while True: pass`) and stops them when the run
ends, also when it fails; `LoadAverage` samples `os.getloadavg()` as the run goes, so that a
table says under what load its figures were taken. `spread` gives a ratio's min, median and
max over the rounds of a run.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys

__all__ = ["busy", "LoadAverage", "spread", "format_spread"]


@contextlib.contextmanager
def busy(n: int):
    """`n` processes that each keep a core busy while the block runs; none when `n` is 0."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    spinners = []
    try:
        for _ in range(n):
            spinners.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        yield spinners
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()


class LoadAverage:
    """The 1-minute load average, sampled at the start, at each `sample()`, and read as min/max."""

    def __init__(self) -> None:
        self.samples = [os.getloadavg()[0]]

    def sample(self) -> None:
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict:
        """min, max and last of the 1-minute load average, and the 5- and 15-minute ones now."""
        self.sample()
        now = os.getloadavg()
        return {"min": min(self.samples), "max": max(self.samples), "last": self.samples[-1],
                "5min": now[1], "15min": now[2], "cores": os.cpu_count() or 1}

    @staticmethod
    def format(summary: dict) -> str:
        return (f"load average during the run (1 min): {summary['min']:.2f} to {summary['max']:.2f} "
                f"on {summary['cores']} cores (5 min {summary['5min']:.2f}, 15 min {summary['15min']:.2f})")


def spread(ratios: list[float]) -> dict:
    """A ratio over the rounds of a run: its min, median and max."""
    if not ratios:
        raise ValueError("spread needs at least one ratio")
    return {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}


def format_spread(s: dict) -> str:
    """`1.02 (0.91-1.10)`: the median, then min-max."""
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"
