"""One training step on every device (`train_batch`), and accuracy (`evaluate`).

The loss each device computes is in `manualdp.loss`.
The loop over epochs, with checkpoints and a progress bar, is `manualdp.runners.loop.train`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .allreduce import allreduce
from .buckets import assign_buckets, flatten, unflatten_
from .guard import NONFINITE, NonFiniteGuard
from .loss import correct_tensor, count_correct, logits_of, summed_loss
from .replicate import broadcast_buffers
from .schedule import ALGORITHMS
from .split import split_batch
from .validate import check_devices, iterable, nn_module, one_of, positive_number, trainable, xy_pair

__all__ = ["StepResult", "allreduce_gradients", "train_batch", "evaluate"]


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
    devices = _check_step_args(replicas, optimizers, devices, algorithm, bucket_cap_mb, nonfinite)
    loss_fn = summed_loss(loss_fn)
    guard = NonFiniteGuard(nonfinite, replicas, optimizers)  # before the forward pass: it may restore BatchNorm stats
    # 1. Split the global batch: shard i goes to device i.
    X_shards, y_shards = split_batch(X, y, devices)
    # 2. + 3. Forward, backward on every replica: shard loss sum / global batch, so gradients add up to one device's.
    losses, corrects = [], []  # tensors: reading them now would make each device wait for the next
    for net, opt, Xs, ys in zip(replicas, optimizers, X_shards, y_shards):
        opt.zero_grad(set_to_none=True)
        out = net(Xs)
        loss = loss_fn(out, ys) / len(X)
        loss.backward()
        losses.append(loss.detach())
        corrects.append(correct_tensor(logits_of(out).detach(), ys))
    # 4. Allreduce: every replica now holds the sum of all gradients (ZeRO-2 reduce-scatters it in its step).
    if not any(getattr(opt, "reduces_gradients", False) for opt in optimizers):
        allreduce_gradients(replicas, algorithm, bucket_cap_mb)
    result = StepResult(sum(v.item() for v in losses) * len(X), sum(int(c) for c in corrects), skipped=False)
    if not guard.passes(step):  # NaN or Inf: raise, or undo the step (the replicas agree, they hold the same sums)
        return result._replace(skipped=True)
    # 5. Update: the same step on every replica keeps them identical; buffers follow replica 0.
    for opt in optimizers:
        opt.step()
    broadcast_buffers(replicas)
    return result


def allreduce_gradients(replicas: list[nn.Module], algorithm: str = "naive",
                        bucket_cap_mb: float | None = None) -> None:
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


def _check_step_args(replicas, optimizers, devices, algorithm, bucket_cap_mb, nonfinite) -> list[torch.device]:
    devices = check_devices(devices)
    if len(replicas) != len(devices) or len(optimizers) != len(devices):
        raise ValueError(f"need one replica and one optimizer per device: {len(devices)} devices, "
                         f"{len(replicas)} replicas, {len(optimizers)} optimizers")
    trainable("replicas[0]", replicas[0])
    # An optimizer shared by replicas, or holding another replica's parameters, steps some of
    # them twice and others never: the replicas drift apart with no error.
    for i, (net, opt) in enumerate(zip(replicas, optimizers)):
        own = {id(p) for p in net.parameters()}
        # (ZeRO's per-device handles have no param_groups: they step the shards together.)
        if any(id(p) not in own for group in getattr(opt, "param_groups", ()) for p in group["params"]):
            raise ValueError(f"optimizers[{i}] updates parameters that are not replicas[{i}]'s; "
                             "give every replica its own optimizer over its own parameters")
    one_of("algorithm", algorithm, ALGORITHMS)
    positive_number("bucket_cap_mb", bucket_cap_mb, none_ok=True)
    one_of("nonfinite", nonfinite, NONFINITE)
    return devices
