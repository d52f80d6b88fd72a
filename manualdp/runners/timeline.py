"""Record a training run's timeline from the outside: module and optimizer hooks, no change to the step.

- forward: forward pre-hook to forward hook of each replica (or this rank's module);
- backward: from the gradient of the module's output to the last gradient accumulated into a parameter;
- step: the optimizer's `step`;
- communication: in the single controller, the allreduce of the gradients runs between the
  last backward and the first step, all of it exposed; under SPMD the DDP wrapper records
  each bucket's allreduce on its communication thread (`DistributedDataParallel.recorder`).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from ..support.trace import COMM, Trace

__all__ = ["Timeline", "merge_ranks"]


class Timeline:
    """Hooks that write forward, backward and step spans of `modules` (one track each) into `trace`."""

    def __init__(self, trace: Trace, modules: list[nn.Module], tracks: list[str], optimizers: list,
                 single_controller: bool) -> None:
        self.trace, self.tracks, self.single_controller = trace, tracks, single_controller
        self.started: dict[str, float] = {}        # track -> start of its running forward or backward
        self.last_grad: dict[str, float] = {}      # track -> when its latest gradient was accumulated
        self.steps = 0
        for module, track in zip(modules, tracks):
            module.register_forward_pre_hook(functools.partial(self._begin, track))
            module.register_forward_hook(functools.partial(self._end_forward, track))
            for p in module.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(functools.partial(self._grad, track))
        for i, opt in enumerate(optimizers):
            opt.step = functools.partial(self._step, opt.step, tracks[i], i == 0)

    def _begin(self, track, *_):
        self.started[track] = self.trace.now_us()

    def _end_forward(self, track, _module, _inputs, output):
        name = "forward" if torch.is_grad_enabled() else "evaluate"  # the test set, between epochs
        self.trace.add(name, track, self.started.pop(track, self.trace.now_us()), self.trace.now_us())
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._begin_backward, track))  # its gradient comes first

    def _begin_backward(self, track, grad):
        self.started[track] = self.trace.now_us()
        return grad

    def _grad(self, track, _param):
        self.last_grad[track] = self.trace.now_us()

    def close_backward(self) -> float:
        """Write the backward spans that ended; return when the last one ended."""
        ends = []
        for track in self.tracks:
            if track in self.started and track in self.last_grad:
                self.trace.add("backward", track, self.started.pop(track), self.last_grad.pop(track))
                ends.append(self.trace.events[-1]["ts"] + self.trace.events[-1]["dur"])
        return max(ends, default=self.trace.now_us())

    def _step(self, step, track, first, *args, **kwargs):
        if first:
            self.steps += 1
            last_backward = self.close_backward()
            if self.single_controller:  # the allreduce (and the non-finite check) ran in between
                self.trace.add("allreduce", "comm", last_backward, self.trace.now_us(), cat=COMM)
        with self.trace.span("step", track):
            return step(*args, **kwargs)


def merge_ranks(trace: Trace) -> dict | None:
    """Every rank's events, on rank 0 (None elsewhere): one process (pid) per rank in the trace file."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (trace.wall0, trace.to_dict()))
    if dist.get_rank() != 0:
        return None
    start = min(w for w, _ in everyone)
    events = []
    for wall0, data in everyone:
        for e in data["traceEvents"]:
            if "ts" in e:
                e = dict(e, ts=e["ts"] + (wall0 - start) * 1e6)  # the ranks' clocks started apart
            events.append(e)
    return {"traceEvents": events, "displayTimeUnit": "ms"}
