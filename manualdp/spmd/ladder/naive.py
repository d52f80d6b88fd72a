"""Rung 1 of the ladder: after backward, one allreduce per parameter, then divide.

This is the textbook's algorithm (d2l's `allreduce` then `sgd`) with one process per
device. It is used exactly as torch's DDP is:

    model = NaiveDDP(net)
    loss_fn(model(X), y).backward()   # when backward returns, every .grad is the average over ranks
    optimizer.step()

How "when backward returns" is arranged is the one new idea of this rung: a hook on every
parameter fires once its gradient is accumulated; the first one to fire queues a callback
that autograd runs after the whole backward pass (torch's DDP and picotron do the same).
The rungs above change only what the hooks and that callback do. A backward pass that raised
part-way never reaches that callback: the next forward pass with grad forgets it
(`forget_backward`, which each rung extends with its own state) and raises, as rung 5 does.

What every rung keeps besides (`rules.Rung`, this rung's base): the ranks agree on the model
and the settings at construction and on the step before its first allreduce, rank 0's buffers
are copied before each forward pass with grad, and a parameter no rank used keeps its `.grad`.
"""
from __future__ import annotations

import torch
from torch import nn

from ..collectives import allreduce
from .rules import Rung, weak_hook

__all__ = ["NaiveDDP"]


class NaiveDDP(Rung):
    """Average the gradients of `module` over the ranks of `group`, one parameter at a time.

    Takes `Rung`'s arguments: `module`, and the keywords `algorithm`, `group`, `timeout`,
    `broadcast_buffers`. Every rank must build the same model with the same arguments, and run
    the same forward passes (with grad enabled) and backward passes; else every rank raises,
    naming the field. A parameter unused in a step on some ranks counts as zero there (its
    `.grad`, if it has one); one that no rank used keeps its `.grad` as it was.
    """

    def __init__(self, module: nn.Module, **kwargs):
        super().__init__(module, **kwargs)  # the ranks agree, and every rank starts from rank 0's weights
        self._queued = False  # whether this backward pass has queued `_end_of_backward`
        # The hooks hold the rung weakly: once it is gone, its module is a plain module again.
        self._hooks = [p.register_post_accumulate_grad_hook(weak_hook(self)) for p in self.params]

    def forward(self, *args, **kwargs):
        if self._queued and torch.is_grad_enabled():
            # The last backward's callback never ran: it raised part-way, some gradients unaveraged (rungs 3-4: some
            # sent). Forget it, and count no step, so that ranks that all failed alike stay in step.
            self.forget_backward()
            raise RuntimeError(f"rank {self.rank}: {type(self).__name__}: the previous backward pass failed part-way, "
                               "before its gradients were averaged; the rung has forgotten it and can go on if it "
                               "failed on every rank: run the step again")
        return super().forward(*args, **kwargs)

    def forget_backward(self) -> None:
        """Forget a backward pass that stopped part-way: nothing is queued, no hook has fired."""
        self._queued = False
        self.take_reached()

    def _on_grad(self, p: torch.Tensor) -> None:
        """Autograd calls this once `p.grad` holds this backward pass's gradient."""
        # for the rule on unused parameters (`Rung.unused_everywhere`); a hook that fired with no gradient (a custom
        # autograd.Function that returned None for it) is an unused parameter, as in torch's DDP
        self.reached[self.position[id(p)]] = p.grad is not None
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.grad_ready(p)

    def _end_of_backward(self) -> None:
        self._queued = False
        with torch.no_grad():
            self.sync_gradients()

    def grad_ready(self, p: torch.Tensor) -> None:
        """Rung 1 waits for the end of backward; the overlapping rungs start communicating here."""

    def sync_gradients(self) -> None:
        """The end of backward: sum every gradient over the ranks, then divide by their number."""
        reached = self.take_reached()
        untouched = self.unused_everywhere(reached, self.check_step(flag=not all(reached)))
        for p in self.params:
            if p.grad is None:  # not used in this step on this rank: it adds nothing to the sum
                p.grad = torch.zeros_like(p)
            allreduce(p.grad, self.algorithm, self.group, timeout=self.timeout, check=False)
            p.grad.div_(self.world_size)
        self.restore(untouched)  # no rank used these: their .grad as it was
