"""The grader's own code in a rank where a student's file runs: what the file replaced, found after it ran.

A rank of the ddp, hook and buckets checks loads the file and then trains with the grader's functions (`train_steps`,
`_hooked_steps`...), torch's and manualdp's, in the same process: a file that replaces one of them (an attribute of a
module or a class, or a function's `__code__` or defaults) could forge what the rank reports. Each job binds its own
functions before the file loads, `snapshot()` records the rest there, and `check(before)` raises `Patched` after the
run, naming the first one replaced. Watched are the modules of `WATCHED` and every manualdp module, every class they
hold (torch's C++ ones too: `ProcessGroup`, `Work`) and every class above those (`torch._C.TensorBase` above
`torch.Tensor`): an attribute replaced, removed, or added to one of them (`torch.Tensor.clone = f` shadows
`TensorBase.clone`: what `getattr` finds through the class's MRO changed) is named. Classes that Python refuses to
change (built-in, immutable) are skipped. A patch undone before the run ends is not seen: the checks that matter
compare against torch's results computed in ranks where the file never runs.
"""
from __future__ import annotations

import sys
import warnings

__all__ = ["Patched", "snapshot", "check"]

# the modules whose functions and classes the ranks' jobs run (every manualdp module loaded, too)
WATCHED = ("torch", "torch.nn.functional", "torch.distributed", "torch.distributed.distributed_c10d", "torch.autograd",
           "torch.optim.sgd", "torch.optim.optimizer", "torch.nn.modules.module", "torch.nn.modules.linear",
           "torch._tensor", "torch.nn.parallel.distributed", "torch.futures")
MISSING = object()
IMMUTABLE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: a class whose attributes nothing can set (object, TensorBase)


class Patched(RuntimeError):
    """The file replaced a function or class of the grader's, torch's or manualdp's while its rank ran."""


def _owners() -> dict[str, object]:
    """{name: module or class} of everything watched: the modules, every class they hold, every class above those."""
    modules = [(n, m) for n, m in list(sys.modules.items()) if m is not None and (n in WATCHED or
                                                                                  n.startswith("manualdp."))]
    owners, seen = {}, set()
    with warnings.catch_warnings():  # looking at torch's deprecated names (`reduce_op`) warns
        warnings.simplefilter("ignore")
        for name, module in modules:
            owners[name] = module
            for v in list(vars(module).values()):
                for cls in v.__mro__ if isinstance(v, type) else ():
                    if id(cls) not in seen and not cls.__flags__ & IMMUTABLE:
                        seen.add(id(cls))
                        owners[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return owners


def _watched(owners: dict) -> dict:
    """{(owner, attribute): object} of every function, class and descriptor (a property) of `owners`."""
    with warnings.catch_warnings():  # looking at torch's deprecated names (`reduce_op`) warns
        warnings.simplefilter("ignore")
        return {(name, k): v for name, owner in owners.items() for k, v in list(vars(owner).items())
                if callable(v) or hasattr(type(v), "__get__")}


def snapshot() -> dict:
    """What `check` compares against: every function, class and descriptor of the watched modules and classes, with
    its code and defaults; each owner's attribute names; each class's MRO."""
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # torch wraps SGD.step on its first instance
    owners = _owners()
    return {"functions": {key: (v, _inside(v)) for key, v in _watched(owners).items()},
            "names": {name: (owner, frozenset(vars(owner))) for name, owner in owners.items()},
            "mro": {name: owner.__mro__ for name, owner in owners.items() if isinstance(owner, type)}}


def check(before: dict) -> None:
    """Raise `Patched` naming the first function, class or descriptor of `before` (a `snapshot`) replaced since (or
    its code or defaults), or the first attribute added since to a module or class it watched."""
    functions = _watched({name: owner for name, (owner, _) in before["names"].items()})
    for key, (obj, inside) in before["functions"].items():
        now = functions.get(key, MISSING)
        now_inside = _inside(now)
        if now is not obj or len(now_inside) != len(inside) or any(a is not b for a, b in zip(now_inside, inside)):
            raise Patched(_told(f"replaced {'.'.join(key)}"))
    for name, (owner, names) in before["names"].items():
        for k in set(vars(owner)) - names:
            if not _harmless(name, owner, k):
                raise Patched(_told(f"added {name}.{k}{_shadowing(owner, k)}"))
        if isinstance(owner, type) and owner.__mro__ != before["mro"][name]:
            raise Patched(_told(f"replaced the base classes of {name}"))


def _inside(fn: object) -> tuple:
    """What a function runs with besides its name: its code, its defaults, its keyword-only defaults (each value)."""
    kw = getattr(fn, "__kwdefaults__", None)
    kw = tuple(kw.items()) if type(kw) is dict else ()
    return (getattr(fn, "__code__", None), getattr(fn, "__defaults__", None), *(x for item in kw for x in item))


def _harmless(name: str, owner: object, k: str) -> bool:
    """Whether the attribute `k` added to `owner` is Python's or an import's doing: a submodule imported since
    (`import torch.distributed.algorithms` sets it on its package), the warnings' registry."""
    value = vars(owner)[k]
    return k == "__warningregistry__" or (not isinstance(owner, type) and sys.modules.get(f"{name}.{k}") is value)


def _shadowing(owner: object, k: str) -> str:
    """", over BASE.k" where the added `k` hides a base class's attribute of that name."""
    for base in owner.__mro__[1:] if isinstance(owner, type) else ():
        if k in vars(base):
            return f", over {base.__module__}.{base.__qualname__}.{k}"
    return ""


def _told(what: str) -> str:
    return (f"your code {what}, which the grader runs in your rank to measure your answer: an answer may not patch "
            "the grader, torch or manualdp")
