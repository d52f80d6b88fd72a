"""What the ranks compare of a comm hook and its state: what the hook will compute, never where it was defined.

A function is its name and a digest of its code (the bytecode, its constants with nested functions' code, the
names it reads) and defaults, so the same code defined in two modules (a script run as `__main__` on one rank and
imported on the other) is equal, and other code under the same name differs. Beside the code, what the hook
carries that may differ per rank: a closure's cell values, a `functools.partial`'s bound arguments, a callable
object's (or a bound method's object's) plain attributes, and the `state` handed to `register_comm_hook`.
Plain values are compared by value (scalars, strings, lists, tuples and dicts of them, tensors by a digest of
their bytes); anything else (a process group, a lock, an RNG, an object whose text holds an address) by its type
only; a value named (or keyed) `rank`, `local_rank` or `global_rank` not at all: it is which rank this is, as in
a hook that logs on rank 0 only. A PowerSGD state is compared by its settings only: its error feedback and RNG
differ per rank by design.
The identity is taken once, at registration: a state that changes while training is not compared again.
"""
from __future__ import annotations

import functools
import hashlib
import types

import torch

from ..comm_hooks import hook_name

__all__ = ["hook_identity", "state_identity"]

_DEPTH = 4  # nested values deeper than this are compared by type (a cycle ends here too)
# the settings of torch's and manualdp's `PowerSGDState`: what the ranks must share (not its per-rank memory)
# names that hold which rank this is (a hook that logs on rank 0 only): differ by design, shown but not compared
_RANK_NAMES = ("rank", "local_rank", "global_rank")
_POWERSGD_SETTINGS = ("matrix_approximation_rank", "rank", "start_powerSGD_iter",
                      "min_compression_rate", "orthogonalization_epsilon", "use_error_feedback", "warm_start",
                      "batch_tensors_per_layer", "seed")


def hook_identity(hook) -> str:
    """What the ranks compare of a hook: its name, a digest of its code, and what it carries that may differ."""
    return _callable(hook, 0)


def state_identity(state: object) -> str:
    """What the ranks compare of `register_comm_hook`'s `state`: its plain values, other objects by type."""
    return _object(state, 0) if _plain_object(state) else _value(state, 0)


def _callable(fn, depth: int) -> str:
    """A callable as text equal on two ranks when it computes the same thing."""
    if isinstance(fn, functools.partial):
        bound = [_value(a, depth + 1) for a in fn.args]
        bound += [f"{k}={_value(v, depth + 1)}" for k, v in sorted(fn.keywords.items())]
        return f"{_callable(fn.func, depth + 1)}({', '.join(bound)})"
    if isinstance(fn, types.MethodType):
        return f"{_callable(fn.__func__, depth + 1)} of {_object(fn.__self__, depth + 1)}"
    if isinstance(fn, types.FunctionType):
        return f"{fn.__qualname__} [{_function_digest(fn, depth)}]{_closure(fn, depth)}"
    if _plain_object(fn):  # a callable object: its class's __call__ and its attributes
        call = getattr(type(fn), "__call__", None)
        code = f" [{_function_digest(call, depth)}]" if isinstance(call, types.FunctionType) else ""
        return f"{_object(fn, depth + 1)}{code}"
    return hook_name(fn)  # a builtin or C function: its module-qualified name


def _function_digest(fn: types.FunctionType, depth: int) -> str:
    """A digest of `fn`'s code and defaults."""
    h = hashlib.sha1(_code_bytes(fn.__code__))
    h.update(_value(fn.__defaults__, depth + 1).encode())
    h.update(_value(fn.__kwdefaults__, depth + 1).encode())
    return f"code {h.hexdigest()[:12]}"


def _closure(fn: types.FunctionType, depth: int) -> str:
    """The values `fn` closes over, by name (its cells), shown so that a per-rank one is named; "" for none."""
    if not fn.__closure__:
        return ""
    values = []
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__):
        if name in _RANK_NAMES:
            values.append(f"{name}=(this rank's)")
            continue
        try:
            values.append(f"{name}={_value(cell.cell_contents, depth + 1)}")
        except ValueError:  # an empty cell (a name assigned later in the enclosing function)
            values.append(f"{name}=<empty>")
    return f" over ({', '.join(values)})"


def _code_bytes(code: types.CodeType) -> bytes:
    """The bytes of what `code` computes: bytecode, names read and constants (nested code alike); no line numbers."""
    consts = [_code_bytes(c) if isinstance(c, types.CodeType) else repr(c).encode() for c in code.co_consts]
    return b"\0".join([code.co_code, repr(code.co_names).encode(), *consts])


def _value(value, depth: int) -> str:
    """A value as text equal on two ranks when the values are: never an address, a tensor by a digest."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return _tensor_digest(value)
    if depth > _DEPTH:
        return type(value).__qualname__
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}({', '.join(_value(v, depth + 1) for v in value)})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_value(k, depth + 1)}: {_value(v, depth + 1)}" for k, v in value.items()
                               if k not in _RANK_NAMES) + "}"
    if isinstance(value, type):
        return f"class {value.__qualname__}"
    if callable(value):
        return _callable(value, depth + 1)
    return type(value).__qualname__  # not comparable (a process group, a lock, an RNG): its type only


def _plain_object(value) -> bool:
    """Whether `value` is an instance of a Python class whose attributes can be listed (not a builtin value)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, list, tuple, dict, torch.Tensor,
                                           type, types.FunctionType, types.MethodType, functools.partial)):
        return False
    return hasattr(value, "__dict__") or hasattr(type(value), "__slots__")


def _attributes(obj) -> dict:
    """An object's attributes: its `__dict__` and `__slots__`; a PowerSGD state's settings only."""
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    if type(obj).__name__ == "PowerSGDState":
        names = [n for n in names if n in _POWERSGD_SETTINGS]
    else:
        names = [n for n in names if n not in _RANK_NAMES]
    return {n: getattr(obj, n) for n in sorted(set(names)) if not n.startswith("__") and hasattr(obj, n)}


def _object(obj, depth: int) -> str:
    """An object as its type and its attributes (plain values by value, others by type)."""
    if not _plain_object(obj) or depth > _DEPTH:
        return _value(obj, depth)
    fields = ", ".join(f"{k}={_value(v, depth + 1)}" for k, v in _attributes(obj).items())
    return f"{type(obj).__qualname__}({fields})"


def _tensor_digest(t: torch.Tensor) -> str:
    """A tensor's dtype, shape and a digest of its bytes (its repr would round and cut its values)."""
    head = f"tensor({str(t.dtype).replace('torch.', '')}, {list(t.shape)}"
    try:
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError, NotImplementedError):  # meta, sparse, a subclass: compared by dtype and shape
        return head + ")"
    return f"{head}, sha1 {hashlib.sha1(data).hexdigest()[:12]})"
