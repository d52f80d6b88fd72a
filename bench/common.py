"""What the benchmarks share: their `--json` / `--plot` outputs, checked before they run and written after;
`--backend` (gloo on CPUs, NCCL on GPUs) and a stopwatch that times GPU work as it runs, not as it is queued."""
from __future__ import annotations

import contextlib
import os
import time

import torch

__all__ = ["environment", "check_output_paths", "save_outputs", "BACKENDS", "check_backend", "Stopwatch"]

BACKENDS = ("gloo", "nccl")  # gloo: one process per rank on CPUs; nccl: one GPU per rank


@contextlib.contextmanager
def environment(**values):
    """Set these environment variables for the block, and put back what was there (or nothing) after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_output_paths(parser, args) -> None:
    """Refuse `--json` / `--plot` paths that could only fail after the benchmark has run."""
    for option in ("json", "plot"):
        path = getattr(args, option, None)
        if not path:
            continue
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"--{option}: the directory of {path!r} does not exist")
        if os.path.isdir(path):
            parser.error(f"--{option}: {path!r} is a directory")
        if option == "plot" and not path.lower().endswith(".png"):
            parser.error(f"--plot: {path!r} must end in .png")


def save_outputs(result: dict, json_path: str | None, plot_path: str | None, plot=None) -> None:
    """Write `result` as JSON and draw it with `plot(result, path)`, for each path given."""
    from manualdp.support.files import write_json_atomic

    if json_path:
        write_json_atomic(json_path, result)
        print(f"wrote {json_path}")
    if plot_path:
        plot(result, plot_path)
        print(f"wrote {plot_path}")


def check_backend(parser, backend: str, world_size: int) -> None:
    """Refuse `--backend nccl` where there are fewer GPUs than ranks (NCCL takes one GPU per rank)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and gpus < world_size:
        parser.error(f"--backend nccl needs a GPU per rank: {world_size} ranks, {gpus} GPU(s) here")


class Stopwatch:
    """Seconds of the work between `start()` and `stop()` on `device`.

    On a CPU: `time.perf_counter`. On a GPU, work is queued and runs later, so the clock of
    the host says when it was queued: CUDA events recorded on the current stream around it
    instead, and `stop` waits for the second one before reading their interval.
    """

    def __init__(self, device) -> None:
        self.cuda = torch.device(device).type == "cuda"  # where the work runs
        self.began = None                                 # perf_counter() or the first event

    def start(self) -> None:
        if self.cuda:
            self.began = torch.cuda.Event(enable_timing=True)
            self.began.record()
        else:
            self.began = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self.began
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self.began.elapsed_time(end) / 1e3  # ms
