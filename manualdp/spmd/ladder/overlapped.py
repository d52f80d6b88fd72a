"""Rung 3 of the ladder: each parameter's allreduce starts as soon as its gradient is ready.

Backward computes the last layer's gradients first. Rungs 1 and 2 wait for the whole pass,
then communicate while the processor idles; here the allreduce of a finished gradient runs
on a background thread while backward computes the earlier layers' gradients. At the end of
backward the callback waits for the allreduces still running, then divides.

Two details:
- a parameter used twice in one forward pass gets its gradient in two parts, which autograd
  sums before any hook of the parameter fires (once per backward); the post-accumulate hook
  fires after that sum is written into `.grad`, so the gradient it sends is complete;
- the allreduces of all ranks are paired in the order they are started, so every rank must
  see its gradients become ready in the same order (the same model and the same graph).
  A parameter that no hook reported (unused in this step) is sent after backward, by rung 2.
"""
from __future__ import annotations

import concurrent.futures

import torch

from .flat import FlatDDP
from ..collectives import allreduce
from ..transport.group import group_worker  # the one thread per process group that runs collectives in order

__all__ = ["OverlappedDDP"]


class OverlappedDDP(FlatDDP):
    """`FlatDDP` whose per-parameter allreduces start during backward, on the group's ordered worker thread."""

    def __init__(self, module, **kwargs):
        super().__init__(module, **kwargs)
        self.worker = group_worker(self.group)
        self.running: list[tuple[torch.Tensor, concurrent.futures.Future]] = []  # started this backward

    def grad_ready(self, p: torch.Tensor) -> None:
        self.start(p)

    def start(self, p: torch.Tensor) -> None:
        """Send `p.grad` now; autograd will not touch it again in this backward pass."""
        self.running.append((p, self.worker.submit(allreduce, p.grad, self.algorithm, self.group,
                                                   timeout=self.timeout, check=False)))

    def sync_gradients(self, params=None) -> None:
        running, self.running = self.running, []
        for _, future in running:
            future.result()  # raises the allreduce's error (a PeerError naming a silent rank)
        started = {id(p) for p, _ in running}
        for p, _ in running:
            p.grad.div_(self.world_size)
        missed = [p for p in self.params if id(p) not in started]
        if missed:
            super().sync_gradients(missed)
