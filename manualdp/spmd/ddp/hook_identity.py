"""What the ranks compare of a comm hook and its state: what the hook will compute, never where it was defined.

A function is a digest of its code (the bytecode, its constants with nested functions' code, the names it reads)
and its default arguments by value, so the same code defined in two modules (a script run as `__main__` on one
rank and imported on the other), or under two names, is equal, and other code differs. Its name is shown in the
text (`hook_identity`) but left out of what the ranks compare (`hook_identity(hook, named=False)`). A
`functools.partial`'s bound arguments and a function's defaults are compared by value (scalars, strings, lists,
tuples and dicts of them, tensors by their dtype, shape and the drift check's digest of their bits,
`ladder.drift.tensor_digest`, numpy values by their dtype, shape and a sha1 of their bytes; anything else by its
type): torch's DDP refuses a partial outright (it has no `__name__`), so a partial that differs per rank is named,
never trained with rank-weighted gradients. One identity reads at most `_BUDGET` values; past it (a long or deep
list, a cycle) a value is compared by a digest of its pickle, never dropped.

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
import pickle
import types

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..comm_hooks import hook_name
from ..ladder.drift import tensor_digest

__all__ = ["hook_identity", "state_identity", "defaults_of", "code_identity"]

_BUDGET = 4096  # values one identity reads by value; past it, a value is compared by a digest of its pickle
_DEEPEST = 32  # nesting read by value (Python's stack is the bound); deeper, a value by a digest of its pickle
# the settings of torch's and manualdp's `PowerSGDState`: what the ranks must share (not its per-rank memory)
_POWERSGD_SETTINGS = ("matrix_approximation_rank", "rank", "start_powerSGD_iter",
                      "min_compression_rate", "orthogonalization_epsilon", "use_error_feedback", "warm_start",
                      "batch_tensors_per_layer", "seed")


def hook_identity(hook, named: bool = True) -> str:
    """What the ranks compare of a hook: a digest of its code, its defaults and bound arguments (`named`: its name)."""
    return _Reader(named).callable(hook)


def state_identity(state: object) -> str:
    """What the ranks compare of `register_comm_hook`'s `state`: its class (a PowerSGD state: its settings)."""
    if type(state).__name__ == "PowerSGDState":
        read = _Reader(True)
        fields = ", ".join(f"{n}={read.value(getattr(state, n))}" for n in _POWERSGD_SETTINGS if hasattr(state, n))
        return f"PowerSGDState({fields})"
    return type(state).__qualname__


def defaults_of(hook) -> dict[str, str]:
    """The default arguments of the function `hook` runs (a partial's or a method's function), by name, as compared."""
    fn = _main_function(hook)
    return _Reader(True).defaults(fn) if fn is not None else {}


def code_identity(hook) -> str:
    """`hook_identity(hook)` without the defaults of the function it runs: equal where only they differ."""
    read = _Reader(True)
    read.bare = _main_function(hook)
    return read.callable(hook)


def _main_function(hook) -> types.FunctionType | None:
    """The Python function `hook` runs: a partial's or a method's, a callable object's `__call__`."""
    fn = hook
    while isinstance(fn, (functools.partial, types.MethodType)):
        fn = fn.func if isinstance(fn, functools.partial) else fn.__func__
    fn = fn if isinstance(fn, types.FunctionType) else getattr(type(fn), "__call__", None)
    return fn if isinstance(fn, types.FunctionType) else None


class _Reader:
    """One walk over a hook: whether names are shown, and how many values it may still read by value."""

    def __init__(self, named: bool) -> None:
        self.named, self.left, self.depth = named, _BUDGET, 0
        self.bare: types.FunctionType | None = None  # a function whose defaults are left out (`code_identity`)

    def callable(self, fn) -> str:
        """A callable as text equal on two ranks when it computes the same thing."""
        self.left, self.depth = self.left - 1, self.depth + 1
        try:
            return hook_name(fn) if self.left < 0 or self.depth > _DEEPEST else self._callable(fn)
        finally:
            self.depth -= 1

    def _callable(self, fn) -> str:
        if isinstance(fn, functools.partial):
            bound = [self.value(a) for a in fn.args] + [f"{k}={self.value(v)}" for k, v in sorted(fn.keywords.items())]
            return f"{self.callable(fn.func)}({', '.join(bound)})"
        if isinstance(fn, types.MethodType):
            return f"{self.callable(fn.__func__)} of {type(fn.__self__).__qualname__}"
        if isinstance(fn, types.FunctionType):
            return (f"{fn.__qualname__} " if self.named else "") + self.function(fn)
        call = getattr(type(fn), "__call__", None)
        if isinstance(call, types.FunctionType):  # a callable object: its class and its class's __call__
            return f"{type(fn).__qualname__} {self.function(call)}"
        return hook_name(fn)  # a builtin or C function: its module-qualified name

    def function(self, fn: types.FunctionType) -> str:
        """A digest of `fn`'s code, and its defaults by name and value."""
        defaults = "" if fn is self.bare else ", ".join(f"{k}={v}" for k, v in self.defaults(fn).items())
        code = hashlib.sha1(_code_bytes(fn.__code__)).hexdigest()[:12]
        return f"[code {code}; defaults {defaults}]" if defaults else f"[code {code}]"

    def defaults(self, fn: types.FunctionType) -> dict[str, str]:
        """`fn`'s default arguments (positional, then keyword-only), by name."""
        code, positional = fn.__code__, fn.__defaults__ or ()
        names = code.co_varnames[code.co_argcount - len(positional):code.co_argcount]
        pairs = list(zip(names, positional)) + sorted((fn.__kwdefaults__ or {}).items())
        return {name: self.value(v) for name, v in pairs}

    def value(self, value) -> str:
        """A value as text equal on two ranks when the values are: never an address, a tensor by a digest."""
        self.left, self.depth = self.left - 1, self.depth + 1
        try:
            return self._value(value)
        finally:
            self.depth -= 1

    def _value(self, value) -> str:
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            return repr(value)
        if isinstance(value, torch.Tensor):
            return _tensor_text(value)
        if type(value).__module__ == "numpy" and hasattr(value, "tobytes") and hasattr(value, "dtype"):
            return self.numpy(value)
        if self.left < 0 or self.depth > _DEEPEST:  # past the budget (long, deep, a cycle): a digest of all of it
            return _opaque(value)
        if isinstance(value, (list, tuple)):
            return f"{type(value).__name__}({', '.join(self.value(v) for v in value)})"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{self.value(k)}: {self.value(v)}" for k, v in value.items()) + "}"
        if isinstance(value, type):
            return f"class {value.__qualname__}"
        if callable(value):
            return self.callable(value)
        return type(value).__qualname__  # not comparable (a process group, a lock, an RNG): its type only

    def numpy(self, value) -> str:
        """A numpy array or scalar: its dtype, shape and a sha1 of its bytes (objects: their values)."""
        head = f"numpy({value.dtype.str}, {list(value.shape)}"
        if value.dtype.hasobject:  # its bytes are addresses
            return f"{head}, {self.value(value.tolist())})"
        shown = f", {value.tolist()!r}" if value.size <= 4 else ""  # a few values, for the reader
        return f"{head}{shown}, sha1 {hashlib.sha1(value.tobytes()).hexdigest()[:16]})"


def _opaque(value) -> str:
    """A value too big to read by value: a digest of its pickle (of its repr where it cannot be pickled)."""
    try:
        data = pickle.dumps(value, protocol=4)
    except Exception:  # noqa: BLE001 - a lock, a process group, a local function: its repr
        data = repr(value).encode()
    return f"{type(value).__qualname__} sha1 {hashlib.sha1(data).hexdigest()[:16]}"


def _code_bytes(code: types.CodeType) -> bytes:
    """The bytes of what `code` computes: bytecode, names read and constants (nested code alike); no line numbers."""
    consts = [_code_bytes(c) if isinstance(c, types.CodeType) else repr(c).encode() for c in code.co_consts]
    return b"\0".join([code.co_code, repr(code.co_names).encode(), *consts])


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
