"""The loss of a shard, and its score: what makes N devices compute one device's gradient.

Each device sums the losses of its shard and divides by the size of the *global* batch;
the sum of the devices' gradients is then exactly the one-device gradient, also for uneven
shards. An average of per-shard means would not be (`summed_loss`).
"""
from __future__ import annotations

import copy
import math

import torch
from torch import nn

__all__ = ["summed_loss", "logits_of", "correct_tensor", "count_correct"]


def summed_loss(loss_fn: nn.Module | None) -> nn.Module:
    """Return `loss_fn` with `reduction="sum"` (default: cross-entropy).

    The sum over a shard divided by the global batch size makes N devices compute exactly
    the one-device gradient, even with uneven shards; an average of per-shard means would not.
    A custom loss module is checked by behaviour at its first call (`_ChecksSum`).
    """
    if loss_fn is None:
        return _CrossEntropyOfLogits(reduction="sum")
    if isinstance(loss_fn, (_CrossEntropyOfLogits, _PerExample, _ChecksSum)):
        return loss_fn  # summed already: `train` hands its summed loss to `train_batch`
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not hasattr(loss_fn, "reduction"):
        return _PerExample(loss_fn)
    if loss_fn.reduction != "sum":
        loss_fn = copy.copy(loss_fn)
        loss_fn.reduction = "sum"  # a "mean" or "none" loss gets summed here
    forward = getattr(type(loss_fn), "forward", None)
    if getattr(forward, "__module__", "").startswith("torch."):
        return loss_fn  # torch's own losses honour reduction
    return _ChecksSum(loss_fn)


class _ChecksSum:
    """A custom loss with `reduction="sum"`, asked at its first call whether it really sums.

    A copy of it (so that a loss counting its calls is not disturbed) scores the first shard
    and that shard twice: a sum doubles, a mean stays. A mean would be divided by the batch
    again (gradients too small), so it is refused before any update.
    """

    def __init__(self, fn):
        self.fn, self.checked = fn, False

    def __call__(self, out, y):
        if not self.checked:
            self.checked = True
            once, twice = _score_twice(self.fn, out, y)
            if once is not None and once != 0 and abs(twice - once) <= 1e-3 * abs(once):
                raise ValueError(f"loss_fn {type(self.fn).__name__} ignores reduction='sum': it gives a batch and "
                                 f"that batch twice the same loss ({once:.4g}), so it averages, and the average "
                                 "would be divided by the batch again; make its forward honour self.reduction")
        return self.fn(out, y)


def _score_twice(loss_fn, out, y) -> tuple[float | None, float | None]:
    """A copy of `loss_fn` on (`out`, `y`) and on them twice over; (None, None) where that cannot be asked."""
    if not isinstance(out, torch.Tensor) or not isinstance(y, torch.Tensor) or len(out) != len(y) or len(y) == 0:
        return None, None
    try:
        probe = copy.deepcopy(loss_fn)
        with torch.no_grad():
            out = out.detach()
            once, twice = probe(out, y), probe(torch.cat([out, out]), torch.cat([y, y]))
        once, twice = float(once), float(twice)
    except Exception:  # a loss that cannot be copied, or is not one number: not ours to judge here
        return None, None
    return (once, twice) if math.isfinite(once) and math.isfinite(twice) else (None, None)


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
