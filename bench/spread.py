"""What a benchmark's ratio varies by: its spread over rounds, the machine's load during the run, and `--load`.

A ratio measured on a shared machine swings from run to run; each benchmark that prints one
also prints its min / median / max over the rounds and the 1-minute load average sampled
during the run. `--load` starts one busy process per core (`while True: pass`) for the run and
stops them after, to show what the ratios become on a busy machine.
"""
from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import threading

__all__ = ["spread", "format_spread", "add_load_option", "LoadAverage", "busy", "measured_load", "format_load"]


def spread(values: list[float]) -> dict:
    """min, median and max of `values` (at least one)."""
    if not values:
        raise ValueError("values must hold at least one number, got none")
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def format_spread(s: dict, digits: int = 2) -> str:
    """`median (min-max)`, as the README's tables print a figure."""
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def add_load_option(parser) -> None:
    """`--load`: one busy process per core during the run."""
    parser.add_argument("--load", action="store_true",
                        help=f"run one busy process per core ({os.cpu_count()} here) during the benchmark, "
                             "stopped after it")


class LoadAverage:
    """The 1-minute load average, sampled every `interval` seconds while the block runs: start, max, end."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval, self.samples = interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="loadavg", daemon=True)

    def _sample(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "LoadAverage":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict:
        return {"start": self.samples[0], "max": max(self.samples), "end": self.samples[-1]}


@contextlib.contextmanager
def busy(processes: int):
    """`processes` busy Python processes for the block, each ended (by its own id) after it; none when 0."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
        raise ValueError(f"processes must be a non-negative int, got {processes!r}")
    started = []
    try:
        for _ in range(processes):
            started.append(subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield started
    finally:
        for proc in started:
            proc.send_signal(signal.SIGKILL)
        for proc in started:
            proc.wait()


@contextlib.contextmanager
def measured_load(load: bool):
    """The run's conditions: with `load`, one busy process per core; the load average sampled throughout.

    Yields a dict filled at the end: `busy_processes` and `loadavg_1min` (start, max, end).
    """
    info = {"busy_processes": (os.cpu_count() or 1) if load else 0}
    with busy(info["busy_processes"]), LoadAverage() as sampled:
        yield info
    info["loadavg_1min"] = sampled.summary()


def format_load(info: dict) -> str:
    """One line: the load average during the run, and whether `--load` added busy processes."""
    avg = info["loadavg_1min"]
    extra = f"; --load: {info['busy_processes']} busy processes" if info["busy_processes"] else ""
    return f"load average (1 min) during the run: start {avg['start']:.2f}, max {avg['max']:.2f}, " \
           f"end {avg['end']:.2f} on {os.cpu_count()} cores{extra}"
