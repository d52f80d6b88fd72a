"""The single-controller training loop: one Python process drives a list of devices."""
from __future__ import annotations

import copy
import time
from typing import NamedTuple

import torch
from torch import nn

from .allreduce import allreduce
from .buckets import assign_buckets, flatten, unflatten_
from .checkpoint import TrainingState, check_checkpoint_dir, check_layout
from .devices import check_devices
from .history import History
from .replicate import broadcast_buffers, copy_params_, replicate
from .schedule import ALGORITHMS
from .split import split_batch

__all__ = ["History", "NonFiniteGradientError", "StepResult", "summed_loss", "allreduce_gradients", "train_batch",
           "evaluate", "train"]


def summed_loss(loss_fn: nn.Module | None) -> nn.Module:
    """Return `loss_fn` with `reduction="sum"` (default: cross-entropy).

    The sum over a shard divided by the global batch size makes N devices compute exactly
    the one-device gradient, even with uneven shards; an average of per-shard means would not.
    """
    if loss_fn is None:
        return nn.CrossEntropyLoss(reduction="sum")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not hasattr(loss_fn, "reduction"):
        return _PerExample(loss_fn)
    if loss_fn.reduction != "sum":
        loss_fn = copy.copy(loss_fn)
        loss_fn.reduction = "sum"  # a "mean" or "none" loss gets summed here
    return loss_fn


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


def allreduce_gradients(replicas: list[nn.Module], algorithm: str = "naive", bucket_cap_mb: float | None = None) -> None:
    """Sum the gradients of all replicas, in place, parameter by parameter or bucket by bucket."""
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
    assign_buckets([], bucket_cap_mb)  # validates bucket_cap_mb
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


def _correct(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Correct predictions as a 0-d tensor on `out`'s device (reading it would wait for the device)."""
    if out.dim() == 2 and not y.is_floating_point() and y.dim() == 1:
        return (out.argmax(dim=1) == y).sum()
    return torch.zeros((), dtype=torch.long, device=out.device)


def _count_correct(out: torch.Tensor, y: torch.Tensor) -> int:
    return int(_correct(out, y))


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf after the allreduce."""


class StepResult(NamedTuple):
    loss: float    # summed loss over the global batch
    correct: int   # correctly classified examples in the global batch
    skipped: bool  # True when a non-finite gradient made the step be skipped


NONFINITE = (None, "raise", "skip")


def first_nonfinite(module: nn.Module) -> str | None:
    """Name of the first parameter whose gradient holds NaN or Inf, or None."""
    for name, p in module.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return name
    return None


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
    nonfinite: str | None = None,
    step: int | None = None,
) -> StepResult:
    """One synchronous data-parallel step over the global batch `X`, `y`.

    1. split the batch, 2. forward and backward on every replica, 3. allreduce the gradients,
    4. every replica takes the same optimizer step, 5. broadcast buffers from replica 0.
    `nonfinite="raise"` stops on a NaN/Inf gradient, `"skip"` skips the update instead.
    """
    devices = check_devices(devices)
    if len(replicas) != len(devices) or len(optimizers) != len(devices):
        raise ValueError(
            f"need one replica and one optimizer per device: {len(devices)} devices, "
            f"{len(replicas)} replicas, {len(optimizers)} optimizers"
        )
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
    loss_fn = summed_loss(loss_fn)
    X_shards, y_shards = split_batch(X, y, devices)
    # A skipped step must not keep what the bad forward pass wrote into BatchNorm statistics.
    saved_buffers = [b.detach().clone() for b in replicas[0].buffers()] if nonfinite == "skip" else None
    losses, corrects = [], []
    for net, opt, Xs, ys in zip(replicas, optimizers, X_shards, y_shards):
        opt.zero_grad(set_to_none=True)
        out = net(Xs)
        loss = loss_fn(out, ys) / len(X)
        loss.backward()
        # Kept as tensors: reading them here would make each device wait before the next starts.
        losses.append(loss.detach())
        corrects.append(_correct(out.detach(), ys))
    allreduce_gradients(replicas, algorithm, bucket_cap_mb)
    total_loss = sum(v.item() for v in losses) * len(X)
    correct = sum(int(c) for c in corrects)
    if nonfinite is not None:
        # Replicas are bitwise identical after the allreduce, so checking one decides for all.
        bad = first_nonfinite(replicas[0])
        if bad is not None:
            where = f" at step {step}" if step is not None else ""
            if nonfinite == "raise":
                raise NonFiniteGradientError(f"non-finite gradient in parameter {bad!r}{where}")
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            for r in replicas:
                for b, saved in zip(r.buffers(), saved_buffers):
                    b.copy_(saved)
            return StepResult(total_loss, correct, True)
    for opt in optimizers:
        opt.step()
    broadcast_buffers(replicas)
    return StepResult(total_loss, correct, False)


@torch.no_grad()
def evaluate(net: nn.Module, data_iter, device=None) -> float:
    """Classification accuracy of `net` on `data_iter`, computed on `device`."""
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be an nn.Module, got {type(net).__name__}")
    if not hasattr(data_iter, "__iter__"):
        raise TypeError(f"data_iter must be iterable (e.g. a DataLoader), got {type(data_iter).__name__}")
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
    nonfinite: str | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    progress: bool = True,
    log=print,
) -> History:
    """Train `net` on `devices` with SGD; afterwards `net` holds the trained parameters.

    With `checkpoint_dir`, a checkpoint is written after every epoch and every
    `checkpoint_every` steps; `resume=True` continues from the newest readable one, and the
    result is bitwise what an uninterrupted run gives (same seed, CPU).
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be an nn.Module, got {type(net).__name__}")
    devices = check_devices(devices)
    if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 1:
        raise ValueError(f"num_epochs must be a positive int, got {num_epochs!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
    if checkpoint_every is not None and (
            isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1):
        raise ValueError(f"checkpoint_every must be a positive int or None, got {checkpoint_every!r}")
    if (checkpoint_every is not None or resume) and checkpoint_dir is None:
        raise ValueError("checkpoint_every and resume need checkpoint_dir")
    if checkpoint_dir is not None:
        check_checkpoint_dir(checkpoint_dir, resume)
        check_layout(checkpoint_dir, per_rank=False)
    for name, it in (("train_iter", train_iter), ("test_iter", test_iter)):
        if not hasattr(it, "__iter__"):
            raise TypeError(f"{name} must be iterable (e.g. a DataLoader), got {type(it).__name__}")
    if log is not None and not callable(log):
        raise TypeError(f"log must be callable or None, got {log!r}")
    assign_buckets([], bucket_cap_mb)  # validates bucket_cap_mb before any work
    loss_fn = summed_loss(loss_fn)

    replicas = replicate(net, devices)
    optimizers = [torch.optim.SGD(r.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay) for r in replicas]
    history = History(config={
        "devices": [str(d) for d in devices], "num_epochs": num_epochs, "lr": lr,
        "algorithm": algorithm, "bucket_cap_mb": bucket_cap_mb,
    })
    loop = TrainingState(train_iter, checkpoint_dir)
    if resume:
        state = loop.resume(replicas, optimizers, history)
        if log:
            log(f"resumed from {state['path']} (epoch {state['epoch'] + 1}, step {state['global_step']})"
                if state is not None else f"no checkpoint in {checkpoint_dir}: starting from the beginning")
    for epoch in range(loop.epoch, num_epochs):
        for r in replicas:
            r.train()
        start = time.perf_counter()
        batches = _progress(loop.batches(epoch), progress, f"epoch {epoch + 1}/{num_epochs}", _len(train_iter))
        for X, y in batches:
            if len(X) < len(devices):  # typically the last batch of an epoch; drop_last=True avoids it
                if log:
                    log(f"epoch {epoch + 1}: skipped a batch of {len(X)}, fewer examples than the {len(devices)} devices")
                continue
            result = train_batch(X, y, replicas, optimizers, devices, loss_fn, algorithm=algorithm,
                                 bucket_cap_mb=bucket_cap_mb, nonfinite=nonfinite, step=loop.global_step)
            loop.record(result, len(X))
            if result.skipped and log:
                log(f"step {loop.global_step - 1}: non-finite gradient, update skipped")
            if hasattr(batches, "set_postfix"):
                batches.set_postfix(loss=f"{loop.loss_sum / loop.seen:.3f}", acc=f"{loop.correct / loop.seen:.3f}",
                                    refresh=False)
            if checkpoint_every and loop.global_step % checkpoint_every == 0:
                loop.save(replicas, optimizers, history)
        if loop.seen == 0:
            raise ValueError(f"train_iter gave no usable batch in epoch {epoch + 1}")
        seconds = loop.seconds + time.perf_counter() - start
        test_acc = evaluate(replicas[0], test_iter, devices[0])
        seen = max(loop.seen, 1)
        history.train_loss.append(loop.loss_sum / seen)
        history.train_acc.append(loop.correct / seen)
        history.test_acc.append(test_acc)
        history.epoch_seconds.append(seconds)
        history.samples_per_second.append(loop.seen / seconds if seconds > 0 else float("nan"))
        if log:
            log(f"epoch {epoch + 1}: loss {history.train_loss[-1]:.3f}, train acc {history.train_acc[-1]:.3f}, "
                f"test acc {test_acc:.3f}, {seconds:.1f} sec/epoch, {history.samples_per_second[-1]:.0f} samples/s")
        loop.end_epoch()
        if checkpoint_dir is not None:
            loop.save(replicas, optimizers, history)
    copy_params_(net, replicas[0])
    return history


def _len(iterable) -> int | None:
    try:
        return len(iterable)
    except TypeError:
        return None


def _progress(iterable, enabled: bool, desc: str, total: int | None = None):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)
