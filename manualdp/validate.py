"""Argument checks, one line each at a public boundary: `positive_int("lr", lr)`.

Every check names the argument and shows the bad value, and returns the value (possibly
normalised), so a caller can write `devices = check_devices(devices)`. The book imports
this module and nothing else of the package's machinery.
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers
import os

import torch
from torch import nn

__all__ = [
    "is_int", "positive_int", "non_negative_int", "positive_number", "non_negative_number", "finite_number",
    "one_of", "int_between", "learning_rate", "mapping_or_none", "MAX_LR",
    "MAX_TIMEOUT", "MAX_SEED", "seed", "non_empty_path", "index", "boolean", "nn_module", "initialized", "trainable",
    "iterable", "callable_or_none", "same_replicas", "no_closure",
    "factory", "a_callable", "path", "timeout_seconds",
    "check_devices", "tensor_list", "check_tensors", "check_summable", "check_batch", "xy_pair",
]


def is_int(value) -> bool:
    """True for an int (also numpy's) that is not a bool (`True` is an int to Python, never a count to us)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_int(name: str, value, *, none_ok: bool = False):
    if (value is None and none_ok) or (is_int(value) and value >= 1):
        return value
    raise ValueError(f"{name} must be a positive int{' or None' if none_ok else ''}, got {value!r}")


def non_negative_int(name: str, value):
    if is_int(value) and value >= 0:
        return value
    raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def positive_number(name: str, value, *, none_ok: bool = False, finite: bool = False):
    """A number > 0 (NaN is refused; `finite=True` also refuses inf)."""
    if value is None and none_ok:
        return value
    if _is_number(value) and value > 0 and (not finite or math.isfinite(value)):
        return value
    what = "a positive finite number" if finite else "a positive number"
    raise ValueError(f"{name} must be {what}{' or None' if none_ok else ''}, got {value!r}")


def non_negative_number(name: str, value):
    if _is_number(value) and 0 <= value < math.inf:
        return value
    raise ValueError(f"{name} must be a non-negative number, got {value!r}")


def fraction(name: str, value, high: float = 1):
    """A number from 0 to `high` (1: a fraction)."""
    if not _is_number(value) or not 0 <= value <= high:
        raise ValueError(f"{name} must be a number from 0 to {high:g}, got {value!r}")
    return value


def finite_number(name: str, value):
    if _is_number(value) and math.isfinite(value):
        return value
    raise ValueError(f"{name} must be a finite number, got {value!r}")


def one_of(name: str, value, choices):
    # `value in choices` on a dict or set needs a hashable value; a list passed by mistake is not.
    if isinstance(value, (str, type(None), bool, int)) and value in choices:
        return value
    shown = sorted(choices, key=str) if isinstance(choices, (dict, set, frozenset)) else tuple(choices)
    raise ValueError(f"{name} must be one of {shown}, got {value!r}")


# The largest float32: a learning rate past it is inf once the optimizer multiplies it into a
# float32 gradient, so every step is NaN. Smaller but still huge rates can train (and diverge,
# which the non-finite guard reports with the step); these cannot, so they are refused.
MAX_LR = float(torch.finfo(torch.float32).max)


def learning_rate(name: str, value):
    """A learning rate: a number > 0, finite and at most MAX_LR (float32's largest, 3.4e38)."""
    if _is_number(value) and 0 < value <= MAX_LR:
        return value
    raise ValueError(f"{name} must be a positive number, got {value!r} "
                     f"(finite, at most {MAX_LR:.3g}: float32's largest)")


def mapping_or_none(name: str, value):
    if value is None or isinstance(value, dict):
        return value
    raise TypeError(f"{name} must be a dict or None, got {type(value).__name__}")


def boolean(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    raise TypeError(f"{name} must be a bool, got {value!r}")


def nn_module(name: str, value) -> nn.Module:
    if isinstance(value, nn.Module):
        return value
    raise TypeError(f"{name} must be an nn.Module, got {type(value).__name__}")


def initialized(name: str, module: nn.Module) -> nn.Module:
    """A module whose parameters all have shapes and values: no lazy module (LazyLinear) before its first forward."""
    lazy = [n for n, p in module.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise ValueError(f"{name} has uninitialized parameters "
                         f"({', '.join(lazy[:3])}{', ...' if len(lazy) > 3 else ''}: "
                         "a lazy module such as LazyLinear); run one forward pass on a batch first, so that they "
                         "get their shapes and values")
    return module


def trainable(name: str, module: nn.Module) -> nn.Module:
    """An initialized module with at least one parameter that requires grad: something to train."""
    initialized(name, module)
    params = list(module.parameters())
    if not any(p.requires_grad for p in params):
        raise ValueError(f"{name} has no parameters that require grad "
                         f"({f'all {len(params)} are frozen' if params else 'it has none'}): there is nothing to train")
    return module


def same_replicas(name: str, replicas) -> list[nn.Module]:
    """A non-empty list of distinct modules, one per device, holding equal parameters and buffers.

    A sharded optimizer keeps device i's chunk of each replica's values: replicas that differ
    would be put together into a model that is none of them. The same module twice (or two that
    share a parameter) would be stepped twice. Values must be equal exactly (NaN equals NaN).
    """
    if isinstance(replicas, nn.Module) or not isinstance(replicas, (list, tuple)) or not replicas:
        raise TypeError(f"{name} must be a non-empty list of nn.Module, got {replicas!r:.80}")
    first = nn_module(f"{name}[0]", replicas[0])
    owner: dict[int, int] = {}  # id of a module, parameter or buffer -> the replica it belongs to
    for i, r in enumerate(replicas):
        nn_module(f"{name}[{i}]", r)
        for t in (r, *r.parameters(), *r.buffers()):
            j = owner.setdefault(id(t), i)
            if j != i:
                what = "is" if t is r else f"shares a {'parameter' if isinstance(t, nn.Parameter) else 'tensor'} with"
                raise ValueError(f"{name}[{i}] {what} {name}[{j}]: every device needs its own copy "
                                 "(manualdp.replicate makes them)")
        for kind, mine, theirs in (("parameter", r.named_parameters(), first.named_parameters()),
                                   ("buffer", r.named_buffers(), first.named_buffers())):
            mine, theirs = list(mine), list(theirs)
            if [(n, t.shape, t.dtype) for n, t in mine] != [(n, t.shape, t.dtype) for n, t in theirs]:
                raise ValueError(f"{name}[{i}] does not have {name}[0]'s {kind}s (names, shapes, dtypes)")
            for (n, a), (_, b) in zip(mine, theirs):
                if not _bitwise_equal(a.detach(), b.detach().to(a.device)):
                    raise ValueError(f"{name}[{i}]'s {kind} {n!r} differs from {name}[0]'s: replicas must start "
                                     "equal (copy one model with manualdp.replicate)")
    return list(replicas)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())


def no_closure(name: str, optimizer):
    """An optimizer whose `step` needs no closure (LBFGS's does: it evaluates the loss itself)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (AttributeError, TypeError, ValueError):  # no step, or one inspect cannot read: let it run as it is
        return optimizer
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(f"{name}: {type(optimizer).__name__}'s step needs a closure (it evaluates the loss itself), "
                         "and ZeRO steps each shard alone: its line search and dot products would see one rank's "
                         "shard only, another algorithm than on the whole model (torch's ZeroRedundancyOptimizer "
                         "runs it so, and its ranks may call the closure a different number of times): use an "
                         "elementwise optimizer (SGD, Adam, AdamW)")
    return optimizer


def iterable(name: str, value):
    if hasattr(value, "__iter__"):
        return value
    raise TypeError(f"{name} must be iterable (e.g. a DataLoader), got {type(value).__name__}")


def callable_or_none(name: str, value):
    if value is None or callable(value):
        return value
    raise TypeError(f"{name} must be callable or None, got {value!r}")


def factory(name: str, value):
    """A class or function that builds something, e.g. `torch.optim.Adam`."""
    if callable(value):
        return value
    raise TypeError(f"{name} must be a class or factory such as torch.optim.Adam, got {value!r}")


def a_callable(name: str, value):
    if callable(value):
        return value
    raise TypeError(f"{name} must be callable, got {value!r}")


def path(name: str, value, *, none_ok: bool = False):
    if (value is None and none_ok) or isinstance(value, (str, os.PathLike)):
        return value
    raise TypeError(f"{name} must be a path, got {type(value).__name__}")


# A year: longer timeouts overflow the backends' own (timedelta, milliseconds in a C long).
MAX_TIMEOUT = 365 * 24 * 3600.0
MAX_SEED = 2**32 - 1  # numpy's legacy seeding and most tools take 32 bits


def timeout_seconds(name: str, value, *, none_ok: bool = True) -> float | None:
    """A timeout: positive seconds up to MAX_TIMEOUT (a year) as a float; None (the backend's own) if none_ok."""
    if value is None and none_ok:
        return None
    if _is_number(value) and 0 < value <= MAX_TIMEOUT:
        return float(value)
    raise ValueError(f"{name} must be a positive number of seconds{' or None' if none_ok else ''}, got {value!r} "
                     f"(at most {MAX_TIMEOUT:.0f}, a year)")


def seed(name: str, value) -> int:
    return int_between(name, value, 0, MAX_SEED)


def non_empty_path(name: str, value):
    """A path that is not ''."""
    path(name, value)
    if os.fspath(value) == "":
        raise ValueError(f"{name} must not be empty, got ''")
    return value


def check_devices(devices, name: str = "devices") -> list[torch.device]:
    """A non-empty list of existing 'cpu' or 'cuda' devices, as `torch.device` objects."""
    if isinstance(devices, (str, torch.device)) or not hasattr(devices, "__iter__"):
        raise TypeError(f"{name} must be a list of devices, got {devices!r}")
    out = []
    for d in devices:
        try:
            device = torch.device(d)
        except (TypeError, RuntimeError) as e:
            raise TypeError(f"{name} contains {d!r}, which is not a device") from e
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if (device.index or 0) >= count:
                raise ValueError(f"{name} contains {str(device)!r}, but this machine has {count} GPU(s)")
        elif device.type != "cpu":
            raise ValueError(f"{name} contains {str(device)!r}; manualdp runs on 'cpu' and 'cuda' devices")
        out.append(device)
    if not out:
        raise ValueError(f"{name} must not be empty, got {devices!r}")
    return out


def int_between(name: str, value, low: int, high: int):
    if is_int(value) and low <= value <= high:
        return value
    raise ValueError(f"{name} must be an int >= {low} and <= {high}, got {value!r}")


def index(name: str, value, length: int, of: str):
    if is_int(value) and 0 <= value < length:
        return value
    raise ValueError(f"{name} must index {of} (0..{length - 1}), got {value!r}")


def tensor_list(name: str, tensors) -> list[torch.Tensor]:
    """A list or tuple of tensors (not one tensor: a list of its rows would be a surprise)."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors (one per device), got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return list(tensors)


def check_tensors(tensors, name: str = "tensors", *, sums: bool = True) -> None:
    """A non-empty list of same-shape, same-dtype, non-aliasing tensors (one per device).

    `sums=True` (a reduction) also asks for dense tensors of real numbers.
    The overlap test compares address ranges, so two interleaved views of one buffer (the
    columns of a matrix) count as sharing memory even where no element is shared.
    """
    tensor_list(name, tensors)
    if not tensors:
        raise ValueError(f"{name} must not be empty, got {tensors!r}")
    spans = []
    for i, t in enumerate(tensors):
        if t.device.type not in ("cpu", "cuda"):  # a meta tensor has no data: the copy into it would fail half-way
            raise ValueError(f"{name}[{i}] is on {t.device}; collectives run on 'cpu' and 'cuda' tensors")
        if sums:
            check_summable(t, f"{name}[{i}]")
        if t.shape != tensors[0].shape:
            raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)}, but {name}[0] has {tuple(tensors[0].shape)}")
        if t.dtype != tensors[0].dtype:
            raise TypeError(f"{name}[{i}] has dtype {t.dtype}, but {name}[0] has {tensors[0].dtype}")
        if t.numel():
            lo, hi = _span(t)
            for j, device, jlo, jhi in spans:
                if device == t.device and lo < jhi and jlo < hi:
                    raise ValueError(f"{name}[{i}] and {name}[{j}] share memory; every device needs its own copy")
            spans.append((i, t.device, lo, hi))


def check_summable(t: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """A dense tensor of real numbers that owns its elements, so a collective can write it in place."""
    if t.layout != torch.strided:
        raise TypeError(f"{name} has layout {t.layout}; allreduce sums dense tensors only")
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name} has dtype {t.dtype}; allreduce sums real numbers")
    if not _adds(t.dtype, t.device):
        raise TypeError(f"{name} has dtype {t.dtype}, which torch cannot add on {t.device.type} "
                        "(allreduce sums with add_); convert it first, e.g. to torch.int64 or torch.float32")
    if any(st == 0 and s > 1 for s, st in zip(t.shape, t.stride())):
        # An expanded tensor cannot be written in place; torch would fail half-way through.
        raise ValueError(f"{name} has stride 0 (an expanded view); pass a tensor that owns its elements")
    return t


@functools.lru_cache(maxsize=None)
def _adds(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch implements `add_` for `dtype` on `device` (not for uint16-64 or float8 on CPU in torch 2.13).

    Only torch's "not implemented" is an answer; any other error (out of memory) is raised, not kept.
    """
    try:
        torch.zeros(2, dtype=dtype, device=device).add_(torch.zeros(2, dtype=dtype, device=device))
        return True
    except NotImplementedError:
        return False
    except RuntimeError as e:
        if "not implemented" in str(e):
            return False
        raise


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Address range of `t`'s bytes; absolute, since two storages can share memory (e.g. `torch.from_numpy`)."""
    extent = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return (start, start + extent * t.element_size())


def xy_pair(name: str, batch):
    """One batch of a data iterator as `(X, y)`; a dict or anything else that is not a pair is refused by name."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch
    if isinstance(batch, dict):
        raise TypeError(f"{name} must yield (X, y) pairs, got a dict with keys {sorted(batch, key=str)}; wrap it, "
                        f"e.g. ((b['image'], b['label']) for b in loader)")
    what = (f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list))
            else f"a {type(batch).__name__}")
    raise TypeError(f"{name} must yield (X, y) pairs, got {what}")


def check_batch(X, y, parts: int, what: str = "devices") -> None:
    """`X` and `y` are tensors of one length, with at least one example for each of `parts` devices."""
    for name, t in (("X", X), ("y", y)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError(f"{name} must have a batch dimension, got a 0-d tensor")
    if len(X) != len(y):
        raise ValueError(f"X and y must have the same length, got len(X)={len(X)} and len(y)={len(y)}")
    if len(X) < parts:
        raise ValueError(f"batch of {len(X)} is smaller than the {parts} {what}: every one needs at least one example")
