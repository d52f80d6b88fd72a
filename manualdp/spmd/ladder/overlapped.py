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
- the step's check (`rules.Rung.check_step`) rides on the first allreduce of each backward
  pass (`allreduce(..., check=True, step=...)`: fixed-size headers beside its data, no round
  trip more); the others start once it has passed;
- which parameters some rank used (`rules.py`: one no rank used keeps its `.grad`) is known
  only once every hook has fired, long after the check went out. The last parameter of `order`
  starts last, when this rank's flags (one per parameter) are final, so its allreduce carries
  them: its gradient and the flags are copied into one buffer (`tail`), no message more. A
  parameter this rank did not use sends a stand-in (a copy of its `.grad`, or zeros), so that its
  `.grad` is written only if some rank used it.
"""
from __future__ import annotations

import concurrent.futures

import torch

from .flat import FlatDDP
from .identity import naming_wrappers
from .rules import steps_named
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
        self.checked: concurrent.futures.Future | None = None  # this backward's first allreduce, which checks the step
        # started this backward: (parameter, the tensor sent for it, its allreduce)
        self.running: list[tuple[torch.Tensor, torch.Tensor, concurrent.futures.Future]] = []
        self.tail: torch.Tensor | None = None  # the last parameter's gradient, then the flags: sent together

    def grad_ready(self, p: torch.Tensor) -> None:
        self.ready[self.slot[id(p)]] = True
        while self.next < len(self.order) and self.ready[self.next]:
            self.start(self.order[self.next])
            self.next += 1

    def start(self, p: torch.Tensor, sent: torch.Tensor | None = None) -> None:
        """Send `p.grad` (or `sent` for it) now; autograd will not touch it again in this backward pass."""
        sent = p.grad if sent is None else sent
        if sent is None:  # its hook fired with no gradient (an autograd.Function returned None): unused here
            sent = torch.zeros_like(p)
        if p is not self.order[-1]:
            self.running.append((p, sent, self.submit(sent)))
            return
        if self.tail is None:
            self.tail = torch.empty(p.numel() + len(self.params), dtype=p.dtype, device=p.device)
        with torch.no_grad():  # backward(create_graph=True) runs hooks with grad on; `tail` is plain data
            self.tail[:p.numel()].view(p.shape).copy_(sent)
            self.tail[p.numel():].copy_(torch.tensor(self.reached))  # every other parameter has started: final
        self.running.append((p, sent, self.submit(self.tail)))

    def submit(self, tensor: torch.Tensor) -> concurrent.futures.Future:
        """Queue the allreduce of `tensor` on the worker; the step's first carries the step's check."""
        future = self.worker.submit(self.reduce, tensor, self.checked, self.steps)
        if self.checked is None:
            self.checked = future
        return future

    def reduce(self, tensor: torch.Tensor, checked: concurrent.futures.Future | None, step: int) -> None:
        """On the worker: sum `tensor` over the ranks; the step's first call compares the ranks' steps and wrappers
        (`step`: this wrapper's step count, its number the call's identity)."""
        if checked is None:  # the step's first: every rank raises if the ranks are at different steps
            with steps_named(type(self).__name__), naming_wrappers(self.built.names, type(self).__name__):
                allreduce(tensor, self.algorithm, self.group, timeout=self.timeout, check=True, step=step,
                          identity=self.number)
        else:
            checked.result()  # done (the worker runs in order); raises if the check refused: nothing is sent
            allreduce(tensor, self.algorithm, self.group, timeout=self.timeout, check=False)

    def forget_backward(self) -> None:
        super().forget_backward()
        concurrent.futures.wait([future for _, _, future in self.running])  # their errors belong to the pass forgotten
        self.running, self.ready, self.next, self.checked = [], [False] * len(self.order), 0, None

    def sync_gradients(self) -> None:
        for p in self.order[self.next:]:  # unused in this step on this rank: a copy of its .grad, or zeros
            self.start(p, torch.zeros_like(p) if p.grad is None else p.grad.clone())
        self.take_reached()
        running, self.running = self.running, []
        self.ready, self.next, self.checked = [False] * len(self.order), 0, None
        wait_all(future for _, _, future in running)  # raises the first error (a PeerError naming a silent rank)
        last, k = self.order[-1], self.order[-1].numel()
        used = (self.tail[k:] > 0).tolist()  # how many ranks used each parameter
        running[-1][1].copy_(self.tail[:k].view(last.shape))
        for p, sent, _ in running:
            if sent is p.grad:  # used here
                sent.div_(self.world_size)
            elif used[self.position[id(p)]]:  # used elsewhere: the average replaces what .grad held
                p.grad = sent.div_(self.world_size) if p.grad is None else p.grad.copy_(sent.div_(self.world_size))


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
