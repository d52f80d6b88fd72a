"""Rung 1 of the ladder: after backward, one allreduce per parameter, then divide.

This is the textbook's algorithm (d2l's `allreduce` then `sgd`) with one process per
device. It is used exactly as torch's DDP is:

    model = NaiveDDP(net)
    loss_fn(model(X), y).backward()   # when backward returns, every .grad is the average over ranks
    optimizer.step()

How "when backward returns" is arranged is the one new idea of this rung: a hook on every
parameter fires once its gradient is accumulated; the first one to fire queues a callback
that autograd runs after the whole backward pass (torch's DDP and picotron do the same).
The rungs above change only what the hooks and that callback do.
"""
from __future__ import annotations

import torch
from torch import nn

from ...validate import nn_module, one_of, timeout_seconds
from ..collectives import ENGINE_ALGORITHMS, allreduce
from ..transport.agree import broadcast_from_rank0, check_same_model
from ..transport.peers import group_ranks

__all__ = ["NaiveDDP"]


class NaiveDDP(nn.Module):
    """Average the gradients of `module` over the ranks of `group`, one parameter at a time.

    Args:
        module: the model, on this rank's device.
        algorithm: the allreduce schedule (`manualdp.schedule`; "auto" lets the cost model pick).
        group: the process group (default: all ranks); timeout: seconds to wait for a peer.

    Every rank must build the same model and use every parameter in every step.
    """

    def __init__(self, module: nn.Module, *, algorithm: str = "ring", group=None, timeout: float | None = None):
        super().__init__()
        self.module = nn_module("module", module)
        self.algorithm = one_of("algorithm", algorithm, ENGINE_ALGORITHMS)
        self.group, self.timeout = group, timeout_seconds("timeout", timeout)
        self.rank, peers = group_ranks(group)
        self.world_size = len(peers)
        self.params = [p for p in module.parameters() if p.requires_grad]  # frozen ones need no sync
        if not self.params:
            raise ValueError("module has no parameter that requires grad: nothing to average "
                             f"({type(module).__name__})")
        # the same model on every rank, from rank 0's state: else the messages below would pair up wrong
        check_same_model(module, group, what=f"{type(self).__name__}'s model", timeout=self.timeout)
        broadcast_from_rank0([*module.parameters(), *module.buffers()], group, self.timeout)
        self._queued = False  # whether this backward pass has queued `_end_of_backward`
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad(self, p: torch.Tensor) -> None:
        """Autograd calls this once `p.grad` holds this backward pass's gradient."""
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
        for p in self.params:
            if p.grad is None:  # not used in this step on this rank: it adds nothing to the sum
                p.grad = torch.zeros_like(p)
            allreduce(p.grad, self.algorithm, self.group, timeout=self.timeout, check=False)
            p.grad.div_(self.world_size)
