"""One bucket of rung 4: the gradients of a few parameters in one flat buffer, sent together once all have come.

Rung 5 (`manualdp.spmd.ddp.bucket.FlaggedBucket`) is this bucket plus two flags per parameter.
"""
from __future__ import annotations

import concurrent.futures

import torch
from torch import nn

__all__ = ["Bucket"]


class Bucket:
    """Gradients of a few parameters, flattened into one buffer and allreduced together.

    Args:
        params: the parameters whose gradients live here, in the order they sit in `flat`.
        extra: elements after the gradients, sent with them (rung 5's flags).
    """

    def __reduce__(self):
        # Built afresh from its parameters: plain pickle would store `flat` and each of its views apart.
        return type(self), (self.params,)

    def __init__(self, params: list[nn.Parameter], extra: int = 0) -> None:
        self.params = params
        self.offsets = [0]  # where each parameter's gradient starts in `flat` (one extra entry: the end)
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.flat = torch.zeros(self.offsets[-1] + extra, dtype=params[0].dtype, device=params[0].device)
        self.grads = self.flat[:self.offsets[-1]]  # the gradients alone (what a comm hook sees)
        # Each parameter's slice of `flat`, made once: slicing and reshaping in every hook costs as
        # much as copying a small gradient.
        self.views = [self.flat[a:b].view(p.shape) for p, a, b in zip(params, self.offsets, self.offsets[1:])]
        self.arrived = [False] * len(params)  # whose gradient this backward pass has copied into `flat`
        self.pending = len(params)  # gradients still to arrive before the bucket can be sent
        self.future: concurrent.futures.Future | None = None  # the running allreduce, or None

    def view(self, i: int) -> torch.Tensor:
        """Parameter `i`'s slice of `flat`, shaped like the parameter."""
        return self.views[i]

    def copy_in(self, i: int, grad: torch.Tensor | None) -> None:
        """Parameter `i`'s gradient into its slice; zeros for none."""
        view = self.views[i]
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():  # a gradient that is the bucket's view is in place already
            view.copy_(grad)

    def mark_ready(self, i: int, grad: torch.Tensor | None) -> bool:
        """Copy parameter `i`'s finished gradient in; True when it was the last one missing."""
        self.copy_in(i, grad)
        self.arrived[i] = True
        self.pending -= 1
        return self.pending == 0

    def fill_missing(self) -> None:
        """End of backward: a parameter unused in this step sends what its `.grad` holds, or zeros."""
        for i, arrived in enumerate(self.arrived):
            if not arrived:
                self.copy_in(i, self.params[i].grad)
        self.pending = 0

    def reset(self) -> None:
        """Forget this backward pass: no gradient has arrived, nothing is running."""
        self.arrived = [False] * len(self.params)
        self.pending = len(self.params)
        self.future = None
