"""The DDP ladder on a timeline: every rung trains one small model on the ranks, and each step is recorded.

    from manualdp.runners.ladder import record_ladder
    from manualdp.spmd import launch
    timelines = launch(record_ladder, 2)[0]   # rung -> rank 0's spans of its median step

Chapter 4 of the book prints what overlaps, and book/figures.py draws it. The rungs are not
changed: their synchronous allreduce (`sync_gradients`) and the calls they hand to their
communication thread (`worker.submit`) are wrapped on the instance. Forward, backward and the
optimizer step come from `manualdp.runners.timeline.Timeline`. bench/ladder.py times the rungs.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from ..spmd import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP
from ..support.trace import COMM, Trace
from .timeline import Timeline

__all__ = ["RUNGS", "mlp", "record_ladder"]

BUCKET_CAP_MB = 0.3  # the MLP below is about 1 MiB of gradients: three or four buckets
RUNGS = {"naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP,
         "bucketed": functools.partial(BucketedDDP, bucket_cap_mb=BUCKET_CAP_MB)}


def mlp(width: int = 256, depth: int = 4) -> nn.Sequential:
    """`depth` layers of `width`: backward yields one layer's gradients at a time, the last layer's first."""
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class _TimedWorker:
    """A rung's communication thread, with a span for every call it runs and the moment it was handed over."""

    def __init__(self, worker, trace: Trace):
        self.worker, self.trace = worker, trace

    def submit(self, fn, *args, **kwargs):
        queued = self.trace.now_us()

        def run():
            start = self.trace.now_us()
            try:
                return fn(*args, **kwargs)
            finally:
                self.trace.add("allreduce", "comm", start, self.trace.now_us(), cat=COMM, queued_us=queued)
        return self.worker.submit(run)


def _record(ddp: NaiveDDP, trace: Trace) -> None:
    """Spans for the rung's communication: all of it at the end of backward, or on its thread while backward runs."""
    overlaps = hasattr(ddp, "worker")
    sync = ddp.sync_gradients

    def timed_sync(*args, **kwargs):
        # The overlapping rungs only wait here for what their thread has not finished.
        with trace.span("wait" if overlaps else "allreduce", "compute" if overlaps else "comm",
                        cat="wait" if overlaps else COMM):
            return sync(*args, **kwargs)

    ddp.sync_gradients = timed_sync
    if overlaps:
        ddp.worker = _TimedWorker(ddp.worker, trace)


def _spans(trace: Trace, start: float, end: float) -> list[dict]:
    """The spans that began between `start` and `end` (us), in ms from `start`."""
    return [{"name": e["name"], "track": "comm" if e["cat"] == COMM else "compute",
             "start_ms": (e["ts"] - start) / 1e3, "end_ms": (e["ts"] + e["dur"] - start) / 1e3,
             **({"queued_ms": (e["args"]["queued_us"] - start) / 1e3} if "queued_us" in e["args"] else {})}
            for e in trace.events if e["ph"] == "X" and start <= e["ts"] < end]


def record_ladder(steps: int = 3, width: int = 256, batch: int = 64) -> dict:
    """Run on every rank: each rung trains `mlp(width)` for `steps` steps after one warm-up step.

    Returns, per rung, the spans of its median step (by length) as dicts: name, track, start and
    end in ms from the step's start, and for allreduces handed to the thread, when they were
    handed over.
    """
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    X, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
    out = {}
    for name, make in RUNGS.items():
        ddp = make(mlp(width))
        trace = Trace(pid=rank)
        _record(ddp, trace)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        Timeline(trace, [ddp.module], ["compute"], [opt], single_controller=False)
        starts = []
        for step in range(steps + 1):
            if step == 1:
                trace.events.clear()  # the first step builds caches: leave it out
            starts.append(trace.now_us())
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(X), y).backward()
            opt.step()
        starts.append(trace.now_us())
        dist.barrier()
        # The step of median length: a busy machine stretches some steps tenfold.
        steps_spans = [_spans(trace, starts[i], starts[i + 1]) for i in range(1, steps + 1)]
        steps_spans.sort(key=lambda spans: max(s["end_ms"] for s in spans))
        out[name] = {"spans": steps_spans[len(steps_spans) // 2]}
    return out
