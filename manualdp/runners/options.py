"""The options of a training run, in one object: `train` and `train_spmd` check them here, once.

Both loops take the same options as keyword arguments (their signatures are the documented
API); each gathers them into a `RunOptions` at its first line, and everything below it reads
that one object instead of passing twenty arguments along.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from ..guard import NONFINITE
from ..validate import (boolean, callable_or_none, factory, learning_rate, mapping_or_none, non_negative_number,
                        one_of, path, positive_int, positive_number, timeout_seconds)

__all__ = ["RunOptions", "optimizer_factory", "optimizer_name"]


@dataclass(frozen=True)
class RunOptions:
    num_epochs: int
    lr: float
    loss_fn: Any = None
    algorithm: str = "naive"
    bucket_cap_mb: float | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    nonfinite: str | None = "raise"
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume: bool = False
    config: dict | None = None
    progress: bool = True
    log: Any = print
    optimizer: Any = None
    zero: int | None = None
    trace: str | None = None
    timeout: float | None = None  # train_spmd only
    device: Any = None            # train_spmd only

    @classmethod
    def of(cls, arguments: dict) -> "RunOptions":
        """The options among a loop's `locals()` (its other arguments, such as `net`, stay out)."""
        return cls(**{f.name: arguments[f.name] for f in fields(cls) if f.name in arguments})

    def checked(self, algorithms: tuple[str, ...]) -> "RunOptions":
        """Check every option, naming the bad one; returns the options with `timeout` as a float or None."""
        positive_int("num_epochs", self.num_epochs)
        learning_rate("lr", self.lr)
        one_of("algorithm", self.algorithm, algorithms)
        positive_number("bucket_cap_mb", self.bucket_cap_mb, none_ok=True)
        non_negative_number("momentum", self.momentum)
        non_negative_number("weight_decay", self.weight_decay)
        one_of("nonfinite", self.nonfinite, NONFINITE)
        path("checkpoint_dir", self.checkpoint_dir, none_ok=True)
        positive_int("checkpoint_every", self.checkpoint_every, none_ok=True)
        boolean("resume", self.resume)
        mapping_or_none("config", self.config)
        if (self.checkpoint_every is not None or self.resume) and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every and resume need checkpoint_dir")
        callable_or_none("log", self.log)
        one_of("zero", self.zero, (None, 0, 1, 2, 3))
        if self.optimizer is not None:
            factory("optimizer", self.optimizer)
        path("trace", self.trace, none_ok=True)
        return replace(self, timeout=timeout_seconds("timeout", self.timeout))

    def identity(self, net, **where) -> dict:
        """What makes this run this run: a resume refuses a checkpoint whose identity differs (but `num_epochs`)."""
        return {**where, "num_epochs": self.num_epochs, "lr": self.lr, "algorithm": self.algorithm,
                "bucket_cap_mb": self.bucket_cap_mb, "momentum": self.momentum, "weight_decay": self.weight_decay,
                "nonfinite": self.nonfinite, "model": type(net).__name__, "optimizer": optimizer_name(self.optimizer),
                "zero": self.zero or None, **(self.config or {})}

    def history_config(self, **where) -> dict:
        """What a run's History records of its options."""
        return {**where, "num_epochs": self.num_epochs, "lr": self.lr, "algorithm": self.algorithm,
                "bucket_cap_mb": self.bucket_cap_mb}


def optimizer_name(optimizer) -> str:
    """The optimizer's name for a run's identity: the class (or a partial's function), default SGD."""
    if optimizer is None:
        return "SGD"
    func = getattr(optimizer, "func", optimizer)  # functools.partial
    return getattr(func, "__qualname__", None) or type(func).__name__


def optimizer_factory(optimizer, lr: float, momentum: float, weight_decay: float, zero=None):
    """The optimizer class or factory (default SGD) and its keyword arguments; checks `optimizer` and `zero`."""
    one_of("zero", zero, (None, 0, 1, 2, 3))
    if optimizer is None:
        return torch.optim.SGD, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
    factory("optimizer", optimizer)
    kwargs = {"lr": lr}
    if momentum:
        kwargs["momentum"] = momentum
    if weight_decay:
        kwargs["weight_decay"] = weight_decay
    return optimizer, kwargs
