"""The loss of a shard, and its score: what makes N devices compute one device's gradient.

Each device sums the losses of its shard and divides by the size of the *global* batch;
the sum of the devices' gradients is then exactly the one-device gradient, also for uneven
shards. An average of per-shard means would not be (`summed_loss`).
"""
from __future__ import annotations

import copy
import inspect
import warnings

import torch
from torch import nn

__all__ = ["summed_loss", "logits_of", "correct_tensor", "count_correct"]


def summed_loss(loss_fn: nn.Module | None) -> nn.Module:
    """Return `loss_fn` with `reduction="sum"` (default: cross-entropy).

    The sum over a shard divided by the global batch size makes N devices compute exactly
    the one-device gradient, even with uneven shards; an average of per-shard means would not.
    """
    if loss_fn is None:
        return _CrossEntropyOfLogits(reduction="sum")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not hasattr(loss_fn, "reduction"):
        return _PerExample(loss_fn)
    if loss_fn.reduction != "sum":
        loss_fn = copy.copy(loss_fn)
        loss_fn.reduction = "sum"  # a "mean" or "none" loss gets summed here
    if _ignores_reduction(loss_fn):
        warnings.warn(f"loss_fn {type(loss_fn).__name__}'s forward neither reads self.reduction nor calls its parent: "
                      "if it returns a mean, that mean is divided by the batch again (gradients too small); make it "
                      "honour reduction='sum'", stacklevel=3)
    return loss_fn


def _ignores_reduction(loss_fn) -> bool:
    """True for a custom loss whose own forward never looks at `reduction` (read from its source, not by calling it:
    a second call could change a loss that counts its calls)."""
    forward = getattr(type(loss_fn), "forward", None)
    if forward is None or getattr(forward, "__module__", "").startswith("torch."):
        return False
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return "reduction" not in source and "super()" not in source


def logits_of(out):
    """The scores in a model's output: the output itself, the first tensor of a tuple or list, or `out["logits"]`.

    The convention for models that return more than scores: `loss_fn` gets the output as it
    is; accuracy (and the default cross-entropy) use these scores.
    """
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        if "logits" in out:
            return out["logits"]
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        first = next((t for t in out if isinstance(t, torch.Tensor)), None)
        if first is not None:
            return first
    raise TypeError(f"the model's output holds no scores to take accuracy from: a tensor, a tuple whose first tensor "
                    f"is the scores, or a dict with 'logits' expected, got {type(out).__name__}")


class _CrossEntropyOfLogits(nn.CrossEntropyLoss):
    """Cross-entropy of the scores `logits_of` finds: the default loss also works for tuple and dict outputs."""

    def forward(self, out, y):
        return super().forward(logits_of(out), y)


class _PerExample:
    """A plain loss function: it must return one loss per example, which we sum.

    A scalar could be a mean or a sum and we cannot tell which, so it is refused:
    a mean would silently break the N-device = one-device equivalence.
    """

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, out, y):
        loss = self.fn(out, y)
        if not isinstance(loss, torch.Tensor) or loss.dim() == 0 or len(loss) != len(y):
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn must return one loss per example (shape ({len(y)},)), got {shape}; pass e.g. "
                "functools.partial(F.cross_entropy, reduction='none') or an nn loss module")
        return loss.sum()


def correct_tensor(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Correct predictions as a 0-d tensor on `out`'s device (reading it would wait for the device)."""
    if out.dim() == 2 and not y.is_floating_point() and y.dim() == 1:
        return (out.argmax(dim=1) == y).sum()
    return torch.zeros((), dtype=torch.long, device=out.device)


def count_correct(out: torch.Tensor, y: torch.Tensor) -> int:
    """Correctly classified examples in a batch (0 where `out` is not a score per class)."""
    return int(correct_tensor(out, y))
