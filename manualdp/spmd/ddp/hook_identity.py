"""What the ranks compare of a comm hook and its state: what the hook will compute, never where it was defined.

A function is its name and a digest of its code (the bytecode, its constants with nested functions' code, the
names it reads) and defaults, so the same code defined in two modules (a script run as `__main__` on one rank and
imported on the other) is equal, and other code under the same name differs. A `functools.partial`'s bound
arguments are compared by value (scalars, strings, lists, tuples and dicts of them, tensors by their dtype, shape
and the drift check's digest of their bits, `ladder.drift.tensor_digest`; anything else by its type): torch's DDP
refuses a partial outright (it has no `__name__`), so a partial that differs per rank is named, never trained with
rank-weighted gradients.

What a hook carries beside its code (a closure's cells, a callable object's or a bound method's object's
attributes, the `state` handed to `register_comm_hook`) is compared by its class only, as torch's DDP compares
nothing of it: values there differ per rank by design more often than not (a dict keyed by `id(p)`, a flag that
logs on rank 0 only, a timestamp, a process id, a per-rank path; an adversary's nine such hooks, all equal in
what they compute, were refused when these were compared by value). A PowerSGD state is compared by its
settings (a different approximation rank per rank aborts gloo in torch's), never its per-rank memory.
The identity is taken once, at registration.
"""
from __future__ import annotations

import functools
import hashlib
import types

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..comm_hooks import hook_name
from ..ladder.drift import tensor_digest

__all__ = ["hook_identity", "state_identity"]

_DEPTH = 4  # nested values deeper than this are compared by type (a cycle ends here too)
# the settings of torch's and manualdp's `PowerSGDState`: what the ranks must share (not its per-rank memory)
_POWERSGD_SETTINGS = ("matrix_approximation_rank", "rank", "start_powerSGD_iter",
                      "min_compression_rate", "orthogonalization_epsilon", "use_error_feedback", "warm_start",
                      "batch_tensors_per_layer", "seed")


def hook_identity(hook) -> str:
    """What the ranks compare of a hook: its name, a digest of its code, and what it carries that may differ."""
    return _callable(hook, 0)


def state_identity(state: object) -> str:
    """What the ranks compare of `register_comm_hook`'s `state`: its class (a PowerSGD state: its settings)."""
    if type(state).__name__ == "PowerSGDState":
        fields = ", ".join(f"{n}={_value(getattr(state, n), 1)}" for n in _POWERSGD_SETTINGS if hasattr(state, n))
        return f"PowerSGDState({fields})"
    return type(state).__qualname__


def _callable(fn, depth: int) -> str:
    """A callable as text equal on two ranks when it computes the same thing."""
    if isinstance(fn, functools.partial):
        bound = [_value(a, depth + 1) for a in fn.args]
        bound += [f"{k}={_value(v, depth + 1)}" for k, v in sorted(fn.keywords.items())]
        return f"{_callable(fn.func, depth + 1)}({', '.join(bound)})"
    if isinstance(fn, types.MethodType):
        return f"{_callable(fn.__func__, depth + 1)} of {type(fn.__self__).__qualname__}"
    if isinstance(fn, types.FunctionType):
        return f"{fn.__qualname__} [{_function_digest(fn, depth)}]"
    call = getattr(type(fn), "__call__", None)
    if isinstance(call, types.FunctionType):  # a callable object: its class and its class's __call__
        return f"{type(fn).__qualname__} [{_function_digest(call, depth)}]"
    return hook_name(fn)  # a builtin or C function: its module-qualified name


def _function_digest(fn: types.FunctionType, depth: int) -> str:
    """A digest of `fn`'s code and defaults."""
    h = hashlib.sha1(_code_bytes(fn.__code__))
    h.update(_value(fn.__defaults__, depth + 1).encode())
    h.update(_value(fn.__kwdefaults__, depth + 1).encode())
    return f"code {h.hexdigest()[:12]}"


def _code_bytes(code: types.CodeType) -> bytes:
    """The bytes of what `code` computes: bytecode, names read and constants (nested code alike); no line numbers."""
    consts = [_code_bytes(c) if isinstance(c, types.CodeType) else repr(c).encode() for c in code.co_consts]
    return b"\0".join([code.co_code, repr(code.co_names).encode(), *consts])


def _value(value, depth: int) -> str:
    """A value as text equal on two ranks when the values are: never an address, a tensor by a digest."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return _tensor_text(value)
    if depth > _DEPTH:
        return type(value).__qualname__
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}({', '.join(_value(v, depth + 1) for v in value)})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_value(k, depth + 1)}: {_value(v, depth + 1)}" for k, v in value.items()) + "}"
    if isinstance(value, type):
        return f"class {value.__qualname__}"
    if callable(value):
        return _callable(value, depth + 1)
    return type(value).__qualname__  # not comparable (a process group, a lock, an RNG): its type only


def _tensor_text(t: torch.Tensor) -> str:
    """A tensor's dtype, shape and a digest of its bits (`tensor_digest`; its repr would round and cut its values)."""
    head = f"tensor({str(t.dtype).replace('torch.', '')}, {list(t.shape)}"
    if t.is_meta or t.layout != torch.strided or is_traceable_wrapper_subclass(t):  # no bits of its own to read
        return head + ")"
    try:
        value = tensor_digest(t)
    except (RuntimeError, TypeError, NotImplementedError):  # another tensor it cannot read: by dtype and shape
        return head + ")"
    return f"{head}, digest {value & (2**64 - 1):016x})"
