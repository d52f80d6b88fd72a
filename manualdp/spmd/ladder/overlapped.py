"""Rung 3 of the ladder: each parameter's allreduce starts as soon as its gradient is ready.

Backward computes the last layer's gradients first. Rungs 1 and 2 wait for the whole pass,
then communicate while the processor idles; here the allreduce of a finished gradient runs
on a background thread while backward computes the earlier layers' gradients. At the end of
backward the callback waits for the allreduces still running, then divides.

Three details:
- a parameter used twice in one forward pass gets its gradient in two parts, which autograd
  sums before any hook of the parameter fires (once per backward); the post-accumulate hook
  fires after that sum is written into `.grad`, so the gradient it sends is complete;
- the ranks pair their messages by the order they send them, so the allreduces are paired by
  parameter, not by the order gradients happen to be ready: each rank starts them in one fixed
  order, the reverse of `module.parameters()` (about the order backward produces them), a
  parameter only once all those before it have started, as rung 4 starts its buckets. Two
  same-shaped layers applied in another order on one rank, or a layer used on some ranks
  only, still average right; a parameter that no hook reported (unused in this step) is sent
  after backward, its `.grad` or zeros;
- before the first allreduce of a backward pass the step's check (`NaiveDDP.check_step`) is
  queued on the same thread, so it runs while backward computes.
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
        self.order = self.params[::-1]  # the order every rank starts its allreduces in
        self.slot = {id(p): i for i, p in enumerate(self.order)}
        self.ready = [False] * len(self.order)  # whose gradient this backward pass has produced
        self.next = 0  # the next parameter of `order` to start: they start in order
        self.checked: concurrent.futures.Future | None = None  # this backward pass's step check, on the worker
        self.running: list[tuple[torch.Tensor, concurrent.futures.Future]] = []  # started this backward

    def queue_check(self) -> None:
        """The first gradient of a backward pass: queue the step's check ahead of its allreduces."""
        if self.checked is None:
            self.checked = self.worker.submit(self.check_step)

    def grad_ready(self, p: torch.Tensor) -> None:
        self.queue_check()
        self.ready[self.slot[id(p)]] = True
        while self.next < len(self.order) and self.ready[self.next]:
            self.start(self.order[self.next])
            self.next += 1

    def start(self, p: torch.Tensor) -> None:
        """Send `p.grad` now; autograd will not touch it again in this backward pass."""
        self.running.append((p, self.worker.submit(self.reduce, p.grad, self.checked)))

    def reduce(self, tensor: torch.Tensor, checked: concurrent.futures.Future) -> None:
        """On the worker: sum `tensor` over the ranks, once this step's check has passed (it ran just before)."""
        checked.result()  # raises on every rank if the ranks are at different steps: nothing is sent
        allreduce(tensor, self.algorithm, self.group, timeout=self.timeout, check=False)

    def sync_gradients(self, params=None) -> None:
        self.queue_check()
        for p in self.order[self.next:]:  # unused in this step on this rank: its .grad, or zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.start(p)
        running, self.running = self.running, []
        self.ready, self.next, self.checked = [False] * len(self.order), 0, None
        wait_all(future for _, future in running)  # raises the first error (a PeerError naming a silent rank)
        for p, _ in running:
            p.grad.div_(self.world_size)


def wait_all(futures) -> None:
    """Wait for every future, then raise the first one's error: nothing of this step still runs afterwards."""
    error = None
    for future in futures:
        try:
            future.result()
        except Exception as e:  # noqa: BLE001 - raised below, once all are done
            error = error or e
    if error is not None:
        raise error
