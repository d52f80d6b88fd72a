"""The single-controller training loop: one Python process drives a list of devices."""
from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .allreduce import allreduce
from .buckets import assign_buckets, flatten, unflatten_
from .devices import check_devices
from .replicate import broadcast_buffers, copy_params_, replicate
from .schedule import ALGORITHMS
from .split import split_batch

__all__ = ["History", "summed_loss", "allreduce_gradients", "train_batch", "evaluate", "train"]


@dataclass
class History:
    """Per-epoch results of `train`; `to_json` / `plot` write them out."""

    train_loss: list[float] = field(default_factory=list)
    train_acc: list[float] = field(default_factory=list)
    test_acc: list[float] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    samples_per_second: list[float] = field(default_factory=list)
    config: dict = field(default_factory=dict)

    def to_json(self, path: str) -> None:
        """Write the history as JSON, atomically (a temporary file renamed into place)."""
        write_json_atomic(path, asdict(self))

    @classmethod
    def from_json(cls, path: str) -> "History":
        with open(path) as f:
            return cls(**json.load(f))

    def plot(self, path: str) -> None:
        """Plot loss and accuracies against epochs into a PNG at `path`."""
        from .plot import plot_history
        plot_history(self, path)


def write_json_atomic(path: str, obj) -> None:
    """Write `obj` as JSON to `path` so a crash leaves the old file or the new one, never half of one."""
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def summed_loss(loss_fn: nn.Module | None) -> nn.Module:
    """Return `loss_fn` with `reduction="sum"` (default: cross-entropy).

    The sum over a shard divided by the global batch size makes N devices compute exactly
    the one-device gradient, even with uneven shards; an average of per-shard means would not.
    """
    if loss_fn is None:
        return nn.CrossEntropyLoss(reduction="sum")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if getattr(loss_fn, "reduction", "sum") != "sum":
        loss_fn = copy.copy(loss_fn)
        loss_fn.reduction = "sum"  # a "mean" or "none" loss gets summed here; sum(dim) below covers "none"
    return loss_fn


def allreduce_gradients(replicas: list[nn.Module], algorithm: str = "naive", bucket_cap_mb: float | None = None) -> None:
    """Sum the gradients of all replicas, in place, parameter by parameter or bucket by bucket."""
    per_replica = [[p for p in r.parameters() if p.requires_grad] for r in replicas]
    for params in per_replica:
        for p in params:
            if p.grad is None:  # a parameter this step did not use: its gradient is zero
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


def _count_correct(out: torch.Tensor, y: torch.Tensor) -> int:
    if out.dim() == 2 and not y.is_floating_point() and y.dim() == 1:
        return int((out.argmax(dim=1) == y).sum())
    return 0


def train_batch(X, y, replicas, optimizers, devices, loss_fn=None, *, algorithm="naive", bucket_cap_mb=None):
    """One synchronous data-parallel step; returns (summed loss, number correct) over the global batch.

    1. split the batch, 2. forward and backward on every replica, 3. allreduce the gradients,
    4. every replica takes the same optimizer step, 5. broadcast buffers from replica 0.
    """
    devices = check_devices(devices)
    if len(replicas) != len(devices) or len(optimizers) != len(devices):
        raise ValueError(
            f"need one replica and one optimizer per device: {len(devices)} devices, "
            f"{len(replicas)} replicas, {len(optimizers)} optimizers"
        )
    loss_fn = summed_loss(loss_fn)
    X_shards, y_shards = split_batch(X, y, devices)
    total_loss, correct = 0.0, 0
    for net, opt, Xs, ys in zip(replicas, optimizers, X_shards, y_shards):
        opt.zero_grad(set_to_none=True)
        out = net(Xs)
        loss = loss_fn(out, ys).sum() / len(X)
        loss.backward()
        total_loss += loss.item() * len(X)
        correct += _count_correct(out.detach(), ys)
    allreduce_gradients(replicas, algorithm, bucket_cap_mb)
    for opt in optimizers:
        opt.step()
    broadcast_buffers(replicas)
    return total_loss, correct


@torch.no_grad()
def evaluate(net: nn.Module, data_iter, device=None) -> float:
    """Classification accuracy of `net` on `data_iter`, computed on `device`."""
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be an nn.Module, got {type(net).__name__}")
    if device is None:
        device = next(net.parameters()).device
    device = check_devices([device], "device")[0]
    was_training = net.training
    net.eval()
    correct = total = 0
    try:
        for X, y in data_iter:
            out = net(X.to(device))
            correct += _count_correct(out, y.to(device))
            total += len(y)
    finally:
        net.train(was_training)
    return correct / total if total else float("nan")


def train(
    net: nn.Module,
    train_iter,
    test_iter,
    devices,
    num_epochs: int,
    lr: float,
    *,
    loss_fn=None,
    algorithm: str = "naive",
    bucket_cap_mb: float | None = None,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    progress: bool = True,
    log=print,
) -> History:
    """Train `net` on `devices` with SGD; afterwards `net` holds the trained parameters."""
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be an nn.Module, got {type(net).__name__}")
    devices = check_devices(devices)
    if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 1:
        raise ValueError(f"num_epochs must be a positive int, got {num_epochs!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
    assign_buckets([], bucket_cap_mb)  # validates bucket_cap_mb before any work
    loss_fn = summed_loss(loss_fn)

    replicas = replicate(net, devices)
    optimizers = [torch.optim.SGD(r.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay) for r in replicas]
    history = History(config={
        "devices": [str(d) for d in devices], "num_epochs": num_epochs, "lr": lr,
        "algorithm": algorithm, "bucket_cap_mb": bucket_cap_mb,
    })
    for epoch in range(num_epochs):
        for r in replicas:
            r.train()
        start = time.perf_counter()
        loss_sum = correct = seen = 0
        batches = _progress(train_iter, progress, f"epoch {epoch + 1}/{num_epochs}")
        for X, y in batches:
            loss, ok = train_batch(X, y, replicas, optimizers, devices, loss_fn,
                                   algorithm=algorithm, bucket_cap_mb=bucket_cap_mb)
            loss_sum, correct, seen = loss_sum + loss, correct + ok, seen + len(X)
            if hasattr(batches, "set_postfix"):
                batches.set_postfix(loss=f"{loss_sum / seen:.3f}", acc=f"{correct / seen:.3f}", refresh=False)
        seconds = time.perf_counter() - start
        test_acc = evaluate(replicas[0], test_iter, devices[0])
        history.train_loss.append(loss_sum / max(seen, 1))
        history.train_acc.append(correct / max(seen, 1))
        history.test_acc.append(test_acc)
        history.epoch_seconds.append(seconds)
        history.samples_per_second.append(seen / seconds if seconds > 0 else float("nan"))
        if log:
            log(f"epoch {epoch + 1}: loss {history.train_loss[-1]:.3f}, train acc {history.train_acc[-1]:.3f}, "
                f"test acc {test_acc:.3f}, {seconds:.1f} sec/epoch, {history.samples_per_second[-1]:.0f} samples/s")
    copy_params_(net, replicas[0])
    return history


def _progress(iterable, enabled: bool, desc: str):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, desc=desc, leave=False, dynamic_ncols=True)
