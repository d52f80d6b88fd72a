"""The backward passes of a replica group's ranks, counted and compared each step (`GroupManager.watch`).

Inside a group the ranks' gradients are summed (plain data parallelism, or `fully_shard`'s
reduce-scatter), so a rank that runs one backward more than the others (an extra `loss.backward()`
before the step) adds its gradient twice, and the group's sum is wrong with nothing to show for it.
A hook on the module's parameters (`register_multi_grad_hook`, mode "any": once per backward that
reaches them) counts this rank's backward passes since `start_step`; at the step's first average
the group's ranks compare their counts (the MAX of the count and of its negative: both ends in one
allreduce), and when they differ the step is discarded on every member group, each rank of the
group saying so in one line. Ranks that all run the same number (gradient accumulation) pass.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

_log = logging.getLogger("manualdp.spmd.ft")

__all__ = ["BackwardCount"]


class BackwardCount:
    """This rank's backward passes through a module's parameters since the step started."""

    def __init__(self, module: nn.Module) -> None:
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"module has no parameter that requires grad: nothing to count ({type(module).__name__})")
        self.count = 0
        self._handle = torch.autograd.graph.register_multi_grad_hook(params, self._seen, mode="any")

    def _seen(self, grad) -> None:
        self.count += 1

    def reset(self) -> None:
        self.count = 0

    def spread(self, group: dist.ProcessGroup | None) -> tuple[int, int]:
        """The fewest and most backward passes any rank of `group` ran (one allreduce; RuntimeError: a rank gone)."""
        both = torch.tensor([self.count, -self.count], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        return -int(both[1]), int(both[0])

    def alike(self, group: dist.ProcessGroup | None, who: str) -> bool:
        """Whether every rank of `group` ran as many backward passes; if not, `who` (the rank and step) says so."""
        fewest, most = self.spread(group)
        if fewest == most:
            return True
        _log.warning(f"{who} discarded on every member group: the group's ranks ran backward from {fewest} to {most} "
                     f"times since start_step() (this rank {self.count}); every rank must run the same backward "
                     "passes per step")
        return False

    def remove(self) -> None:
        self._handle.remove()
