"""One bucket of the drop-in's reducer: the gradients of a few parameters in one flat buffer, and two flags each.

Rung 4's buckets are bare slices of a buffer. The drop-in's also carry, per parameter, a
"used" and a "ready" flag after the gradients, summed with them by the same allreduce, so
that every rank learns how many ranks used each parameter and whose hooks fired; and they
remember which gradients came sparse, to write them back sparse.
"""
from __future__ import annotations

import concurrent.futures

import torch
from torch import nn

__all__ = ["Bucket"]


class Bucket:
    """Gradients of a few parameters, flattened into one buffer and allreduced together."""

    def __reduce__(self):
        # Built afresh from its parameters: plain pickle would store `flat` and each of its views
        # apart, and the copy's flags would no longer be the ones the allreduce sums.
        return Bucket, (self.params,)

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params  # parameters whose gradients live here, in the order they sit in `flat`
        self.offsets = [0]  # where each parameter's gradient starts in `flat` (one extra entry: the end)
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        # the gradients, then two flags per parameter ("used", "ready"); after the allreduce their sums
        k = len(params)
        self.flat = torch.zeros(self.offsets[-1] + 2 * k, dtype=params[0].dtype, device=params[0].device)
        self.grads = self.flat[:self.offsets[-1]]  # what a comm hook sees
        self.flags = self.flat[self.offsets[-1]:]  # reduced apart from the gradients when a comm hook runs
        # This rank's flags while gradients arrive, written into `flags` once, by `seal`: a write
        # into a tensor element is a torch call, two per parameter per step otherwise.
        self.used_here = [0] * k  # 1 where this rank's backward produced gradient i (or a no_sync one did)
        self.ready_here = [0] * k  # 1 where gradient i's hook fired in this rank's backward pass
        self.used = self.flags[:k]  # `used_here` once sealed; after the allreduce, how many ranks used gradient i
        self.ready = self.flags[k:]  # `ready_here` once sealed; after the allreduce, how many ranks' hooks fired
        # Each parameter's slice of `flat`, made once: slicing and reshaping in every hook costs as
        # much as copying a small gradient.
        self.views = [self.flat[a:b].view(p.shape) for p, a, b in zip(params, self.offsets, self.offsets[1:])]
        self.arrived = [False] * len(params)  # whose gradient this backward pass has copied into `flat`
        self.sparse = [False] * len(params)  # whose gradient came sparse (densified here, sparse again after)
        self.pending = len(params)  # gradients still to arrive before the bucket can be sent
        self.future: concurrent.futures.Future | None = None  # the running allreduce, or None

    def view(self, i: int) -> torch.Tensor:
        """Parameter `i`'s slice of `flat`, shaped like the parameter."""
        return self.views[i]

    def mark_ready(self, i: int, grad: torch.Tensor | None) -> bool:
        """Copy parameter `i`'s finished gradient in; True when it was the last one missing."""
        if self.arrived[i]:
            raise RuntimeError("a gradient arrived twice in one backward pass (reentrant backward?), "
                               "which manualdp.DistributedDataParallel does not support")
        if grad is None:  # the hook fired but autograd produced nothing: as if unused here
            self.view(i).zero_()
        else:
            self.sparse[i] = grad.is_sparse
            view = self.view(i)
            if grad.is_sparse:
                view.copy_(grad.to_dense())
            elif grad.data_ptr() != view.data_ptr():  # gradient_as_bucket_view: already in place
                view.copy_(grad)
            self.used_here[i] = 1
        self.ready_here[i] = 1
        self.arrived[i] = True
        self.pending -= 1
        return self.pending == 0

    def fill_missing(self, used_earlier: set[int]) -> None:
        """End of backward: unused parameters send their accumulated gradient (or zeros); the bucket is ready.

        `used_earlier`: ids of parameters used in a `no_sync` step since the last sync; they count as
        used, as torch keeps its used map across `no_sync` iterations (pytorch#69031).
        """
        for i, arrived in enumerate(self.arrived):
            if arrived:
                continue
            p = self.params[i]
            if p.grad is None:
                self.view(i).zero_()
            elif p.grad.data_ptr() != self.view(i).data_ptr():
                self.view(i).copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
            if id(p) in used_earlier:
                self.used_here[i] = 1
        self.pending = 0

    def seal(self) -> None:
        """Every gradient is in: write this rank's flags into `flat`, to be summed with the gradients."""
        self.flags.copy_(torch.tensor(self.used_here + self.ready_here, dtype=self.flags.dtype))

    def reset(self) -> None:
        """Forget this backward pass: no gradient has arrived, nothing is running."""
        self.flags.zero_()
        self.used_here = [0] * len(self.params)
        self.ready_here = [0] * len(self.params)
        self.arrived = [False] * len(self.params)
        self.pending = len(self.params)
        self.future = None
