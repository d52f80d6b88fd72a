"""The non-finite guard: what a step does when the allreduced gradients hold NaN or Inf.

Read it last: it is reliability, not data parallelism. After the allreduce every replica
(and every rank) holds bitwise the same gradients, so each one reaches the same decision.
"""
from __future__ import annotations

import torch
from torch import nn

from .validate import one_of

__all__ = ["NONFINITE", "NonFiniteGradientError", "NonFiniteGuard", "first_nonfinite"]

NONFINITE = (None, "raise", "skip")  # None: do not check


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf after the allreduce."""


def first_nonfinite(module: nn.Module) -> str | None:
    """Name of the first parameter whose gradient holds NaN or Inf, or None."""
    for name, p in module.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return name
    return None


class NonFiniteGuard:
    """Made before a step's forward pass, asked after its allreduce whether to update.

    `mode="raise"` raises `NonFiniteGradientError` naming the parameter and step; `"skip"`
    clears the gradients and puts back the buffers (BatchNorm statistics) the bad forward
    pass wrote, so the step leaves no trace; `None` lets everything through.
    """

    def __init__(self, mode: str | None, modules: list[nn.Module], optimizers: list, where: str = "") -> None:
        self.mode = one_of("nonfinite", mode, NONFINITE)
        self.modules = modules        # the replicas (single controller) or [this rank's module]
        # After an allreduce one replica speaks for all; when the optimizer sums the gradients in
        # its step (ZeRO-2), a NaN on any device poisons the sum, so every replica is read.
        self.reduced = not any(getattr(opt, "reduces_gradients", False) for opt in optimizers)
        self.optimizers = optimizers  # their optimizers, to clear the gradients of a skipped step
        self.where = where            # e.g. "rank 1: ", put before the message
        # Only a skip needs the statistics as they were before the forward pass.
        self.saved = [b.detach().clone() for b in modules[0].buffers()] if mode == "skip" else None

    def passes(self, step: int | None = None) -> bool:
        """True to take the update; False after undoing a skipped step; raises in mode "raise"."""
        return self.passes_on(((name, p.grad) for m in self.modules[:1 if self.reduced else None]
                               for name, p in m.named_parameters() if p.grad is not None), step)

    def passes_on(self, grads, step: int | None = None) -> bool:
        """`passes`, for gradients held elsewhere than in `.grad` (ZeRO-3's summed shards): (name, tensor) pairs."""
        if self.mode is None:
            return True
        bad = next((name for name, g in grads if not bool(torch.isfinite(g).all())), None)
        if bad is None:
            return True
        at = f" at step {step}" if step is not None else ""
        if self.mode == "raise":
            raise NonFiniteGradientError(f"{self.where}non-finite gradient in parameter {bad!r}{at}")
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m in self.modules:
                for b, saved in zip(m.buffers(), self.saved):
                    b.copy_(saved)
        return False
