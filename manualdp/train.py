"""One training step on every device (`train_batch`), and accuracy (`evaluate`).

The loop over epochs, with checkpoints and a progress bar, is `manualdp.runners.loop.train`.
"""
from __future__ import annotations

import copy
import inspect
import warnings
from typing import NamedTuple

import torch
from torch import nn

from .allreduce import allreduce
from .buckets import assign_buckets, flatten, unflatten_
from .guard import NONFINITE, NonFiniteGuard
from .replicate import broadcast_buffers
from .schedule import ALGORITHMS
from .split import split_batch
from .validate import check_devices, iterable, nn_module, one_of, positive_number, xy_pair

__all__ = ["StepResult", "summed_loss", "allreduce_gradients", "train_batch", "evaluate", "count_correct", "logits_of"]


class StepResult(NamedTuple):
    loss: float    # summed loss over the global batch
    correct: int   # correctly classified examples in the global batch
    skipped: bool  # True when a non-finite gradient made the step be skipped


def train_batch(
    X: torch.Tensor,
    y: torch.Tensor,
    replicas: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    devices: list[torch.device],
    loss_fn=None,
    *,
    algorithm: str = "naive",
    bucket_cap_mb: float | None = None,
    nonfinite: str | None = "raise",
    step: int | None = None,
) -> StepResult:
    """One synchronous data-parallel step over the global batch `X`, `y`.

    `nonfinite="raise"` (default) stops on a NaN/Inf gradient, `"skip"` skips the update, None does not
    check (`manualdp.guard`). A model may return a tuple or dict: `loss_fn` gets it as it is,
    accuracy uses `logits_of(out)`.
    """
    devices = check_devices(devices)
    _check_step_args(replicas, optimizers, devices, algorithm, bucket_cap_mb, nonfinite)
    loss_fn = summed_loss(loss_fn)
    guard = NonFiniteGuard(nonfinite, replicas, optimizers)  # before the forward pass: it may restore BatchNorm stats

    # 1. Split the global batch: shard i goes to device i.
    X_shards, y_shards = split_batch(X, y, devices)
    # 2. + 3. Forward and backward on every replica. The shard's summed loss over the global
    # batch size makes the sum of the replicas' gradients the one-device gradient.
    losses, corrects = [], []
    for net, opt, Xs, ys in zip(replicas, optimizers, X_shards, y_shards):
        opt.zero_grad(set_to_none=True)
        out = net(Xs)
        loss = loss_fn(out, ys) / len(X)
        loss.backward()
        losses.append(loss.detach())  # tensors: reading them now would make each device wait
        corrects.append(correct_tensor(logits_of(out).detach(), ys))
    # 4. Allreduce: every replica now holds the sum of all gradients.
    allreduce_gradients(replicas, algorithm, bucket_cap_mb)
    result = StepResult(sum(v.item() for v in losses) * len(X), sum(int(c) for c in corrects), False)
    if not guard.passes(step):
        return result._replace(skipped=True)
    # 5. Update: the same step on every replica keeps them identical; buffers follow replica 0.
    for opt in optimizers:
        opt.step()
    broadcast_buffers(replicas)
    return result


def allreduce_gradients(replicas: list[nn.Module], algorithm: str = "naive", bucket_cap_mb: float | None = None) -> None:
    """Sum the gradients of all replicas, in place, parameter by parameter or bucket by bucket."""
    one_of("algorithm", algorithm, ALGORITHMS)
    positive_number("bucket_cap_mb", bucket_cap_mb, none_ok=True)
    if isinstance(replicas, nn.Module) or not replicas or not all(isinstance(r, nn.Module) for r in replicas):
        raise TypeError(f"replicas must be a non-empty list of nn.Module, got {replicas!r:.80}")
    per_replica = [[p for p in r.parameters() if p.requires_grad] for r in replicas]
    # A parameter no replica used keeps grad None, as in plain PyTorch (an optimizer then
    # leaves it alone); one that only some replicas used gets zeros on the others.
    used = [any(params[i].grad is not None for params in per_replica) for i in range(len(per_replica[0]))]
    per_replica = [[p for p, u in zip(params, used) if u] for params in per_replica]
    for params in per_replica:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    if len(replicas) == 1:
        return
    for bucket in assign_buckets(per_replica[0], bucket_cap_mb):
        if len(bucket) == 1:
            allreduce([params[bucket[0]].grad for params in per_replica], algorithm)
            continue
        flats = [flatten([params[i].grad for i in bucket]) for params in per_replica]
        allreduce(flats, algorithm)
        for params, flat in zip(per_replica, flats):
            unflatten_(flat, [params[i].grad for i in bucket])


@torch.no_grad()
def evaluate(net: nn.Module, data_iter, device=None) -> float:
    """Classification accuracy of `net` on `data_iter`, computed on `device`."""
    nn_module("net", net)
    iterable("data_iter", data_iter)
    if device is None:
        first = next(iter(net.parameters()), None)
        if first is None:
            raise ValueError("net has no parameters to take a device from: pass device")
        device = first.device
    device = check_devices([device], "device")[0]
    was_training = net.training
    net.eval()
    correct = total = 0
    try:
        for batch in data_iter:
            X, y = xy_pair("data_iter", batch)
            correct += count_correct(logits_of(net(X.to(device))), y.to(device))
            total += len(y)
    finally:
        net.train(was_training)
    return correct / total if total else float("nan")


# ---------------------------------------------------------------- helpers of the two functions above

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


def _check_step_args(replicas, optimizers, devices, algorithm, bucket_cap_mb, nonfinite) -> None:
    if len(replicas) != len(devices) or len(optimizers) != len(devices):
        raise ValueError(f"need one replica and one optimizer per device: {len(devices)} devices, "
                         f"{len(replicas)} replicas, {len(optimizers)} optimizers")
    # An optimizer shared by replicas, or holding another replica's parameters, steps some of
    # them twice and others never: the replicas drift apart with no error.
    for i, (net, opt) in enumerate(zip(replicas, optimizers)):
        own = {id(p) for p in net.parameters()}
        if any(id(p) not in own for group in opt.param_groups for p in group["params"]):
            raise ValueError(f"optimizers[{i}] updates parameters that are not replicas[{i}]'s; "
                             "give every replica its own optimizer over its own parameters")
    one_of("algorithm", algorithm, ALGORITHMS)
    positive_number("bucket_cap_mb", bucket_cap_mb, none_ok=True)
    one_of("nonfinite", nonfinite, NONFINITE)
