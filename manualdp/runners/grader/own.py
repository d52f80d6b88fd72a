"""The library's own code taken for an answer: made to raise "write it yourself" while the file's code runs.

Before the file loads, the library's function that an exercise asks for (`LIBRARY`) has its code replaced by one
that raises, naming it, so that a file whose function only calls it (through an import, a `partial`, torch's enum of
hooks) fails saying so. `write_it_yourself` gives back what puts them back, for a process that runs the library's
own version after the file's (the hook check's reference).
"""
from __future__ import annotations

import importlib
from typing import Callable

__all__ = ["LIBRARY", "write_it_yourself"]

# an exercise's name for it -> module, attribute (a method too: "Class.__init__"), and in words
LIBRARY = {"cost": ("manualdp.cost", "cost", "manualdp.cost.cost"),
           "fp16_compress_hook": ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks", "fp16_compress_hook",
                                  "torch's fp16_compress_hook"),
           "torch_ddp": ("torch.nn.parallel.distributed", "DistributedDataParallel.__init__",
                         "torch's DistributedDataParallel (its buckets and hooks)")}


def write_it_yourself(names: list[str]) -> Callable[[], None]:
    """Make the library's function that each of `names` stands for (`LIBRARY`; other names are left alone) raise
    when called, naming it; what puts every one of them back."""
    undo = []
    for name in names:
        if name not in LIBRARY:
            continue
        module, attr, words = LIBRARY[name]
        owner = importlib.import_module(module)
        *path, last = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = getattr(owner, last)
        message, ns = f"write it yourself: {words} is what this exercise asks you to write", {}
        source = f"def refused(*args, **kwargs):\n    raise RuntimeError({message!r})\n"  # no closure: as fn's
        # compiled as the library's file, so that the grader still tells the library's function taken for an answer
        exec(compile(source, fn.__code__.co_filename, "exec"), ns)
        if fn.__code__.co_freevars:  # a method that calls super(): its class takes the refusal in its place
            setattr(owner, last, ns["refused"])
            undo.append(lambda owner=owner, last=last, fn=fn: setattr(owner, last, fn))
        else:
            code, fn.__code__ = fn.__code__, ns["refused"].__code__
            undo.append(lambda fn=fn, code=code: setattr(fn, "__code__", code))

    def put_back() -> None:
        for step in reversed(undo):
            step()

    return put_back
