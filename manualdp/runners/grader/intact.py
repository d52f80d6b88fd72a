"""The grader's own code in a rank where a student's file runs: what the file replaced, found after it ran.

A rank of the ddp, hook and buckets checks loads the file and then trains with the grader's functions (`train_steps`,
`_hooked_steps`...), torch's and manualdp's, in the same process: a file that replaces one of them (an attribute of a
module or a class, or a function's `__code__`) could forge what the rank reports. Each job binds its own functions
before the file loads, `snapshot()` records the rest there, and `check(before)` raises `Patched` after the run, naming
the first one replaced. A patch undone before the run ends is not seen: the checks that matter compare against torch's
results computed in ranks where the file never runs.
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


class Patched(RuntimeError):
    """The file replaced a function or class of the grader's, torch's or manualdp's while its rank ran."""


def _owners() -> list[tuple[str, object]]:
    """(name, module or class) of everything watched: the modules, and the classes they define."""
    owners = []
    for name, module in list(sys.modules.items()):
        if module is not None and (name in WATCHED or name.startswith("manualdp.")):
            owners.append((name, module))
            owners += [(f"{name}.{k}", v) for k, v in list(vars(module).items())
                       if isinstance(v, type) and getattr(v, "__module__", None) == name]
    return owners


def _functions() -> dict:
    """{(owner, attribute): object} of every function and class of the watched modules and classes."""
    with warnings.catch_warnings():  # looking at torch's deprecated names (`reduce_op`) warns
        warnings.simplefilter("ignore")
        return {(name, k): v for name, owner in _owners() for k, v in list(vars(owner).items())
                if callable(v) or isinstance(v, (staticmethod, classmethod))}


def snapshot() -> dict:
    """{(owner, attribute): (object, its __code__)} for every function and class of the watched modules and classes."""
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # torch wraps SGD.step on its first instance
    return {key: (v, getattr(v, "__code__", None)) for key, v in _functions().items()}


def check(before: dict) -> None:
    """Raise `Patched` naming the first function or class of `before` (a `snapshot`) replaced since, or whose code
    was."""
    functions = _functions()
    for key, (obj, code) in before.items():
        now = functions.get(key, MISSING)
        if now is not obj or getattr(now, "__code__", None) is not code:
            raise Patched(f"your code replaced {'.'.join(key)}, which the grader runs in your rank to measure your "
                          "answer: an answer may not patch the grader, torch or manualdp")
