"""One bucket of the drop-in's reducer: rung 4's bucket (`ladder/bucket.py`) plus two flags per parameter.

The flags, "used" and "ready", sit after the gradients in the same flat buffer and are summed
with them by the same allreduce, so that every rank learns how many ranks used each parameter
and whose hooks fired (unused parameters, static graph). The bucket also remembers which
gradients came sparse, to write them back sparse.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ladder.bucket import Bucket

__all__ = ["FlaggedBucket"]


class FlaggedBucket(Bucket):
    """Rung 4's `Bucket`, with a "used" and a "ready" flag per parameter summed beside the gradients."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        k = len(params)
        super().__init__(params, extra=2 * k)
        self.flags = self.flat[self.offsets[-1]:]  # reduced apart from the gradients when a comm hook runs
        # This rank's flags while gradients arrive, written into `flags` once, by `seal`: a write
        # into a tensor element is a torch call, two per parameter per step otherwise.
        self.used_here = [0] * k  # 1 where this rank's backward produced gradient i (or a no_sync one did)
        self.ready_here = [0] * k  # 1 where gradient i's hook fired in this rank's backward pass
        self.used = self.flags[:k]  # `used_here` once sealed; after the allreduce, how many ranks used gradient i
        self.ready = self.flags[k:]  # `ready_here` once sealed; after the allreduce, how many ranks' hooks fired
        self.sparse = [False] * k  # whose gradient came sparse (densified here, sparse again after)
        self.check = None  # the call check this step's allreduce carries (set on the worker by `step_check`), or None

    def copy_in(self, i: int, grad: torch.Tensor | None) -> None:
        super().copy_in(i, grad.to_dense() if grad is not None and grad.is_sparse else grad)

    def mark_ready(self, i: int, grad: torch.Tensor | None) -> bool:
        if self.arrived[i]:
            raise RuntimeError("a gradient arrived twice in one backward pass (reentrant backward?), "
                               "which manualdp.DistributedDataParallel does not support")
        if grad is not None:  # else the hook fired but autograd produced nothing: as if unused here
            self.sparse[i] = grad.is_sparse
            self.used_here[i] = 1
        self.ready_here[i] = 1
        if torch.is_grad_enabled():  # backward(create_graph=True) runs hooks with grad on; the bucket is plain data
            with torch.no_grad():
                return super().mark_ready(i, grad)
        return super().mark_ready(i, grad)  # the usual backward: no context entered, per parameter per step

    def fill_missing(self, used_earlier: set[int] = frozenset()) -> None:
        """End of backward: unused parameters send their accumulated gradient (or zeros); the bucket is ready.

        `used_earlier`: ids of parameters used in a `no_sync` step since the last sync; they count as
        used, as torch keeps its used map across `no_sync` iterations (pytorch#69031).
        """
        for i, (p, arrived) in enumerate(zip(self.params, self.arrived)):
            if not arrived and id(p) in used_earlier:
                self.used_here[i] = 1
        super().fill_missing()

    def seal(self) -> None:
        """Every gradient is in: write this rank's flags into `flat`, to be summed with the gradients."""
        if all(self.used_here) and all(self.ready_here):  # the usual step: no tensor made from a list
            self.flags.fill_(1)
        else:
            self.flags.copy_(torch.tensor(self.used_here + self.ready_here, dtype=self.flags.dtype))

    def reset(self) -> None:
        super().reset()
        self.flags.zero_()
        self.check = None
        self.used_here = [0] * len(self.params)
        self.ready_here = [0] * len(self.params)
