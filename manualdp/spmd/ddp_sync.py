"""A wrapper's state across ranks: compare it (model, communication layout) and copy rank 0's.

At construction every rank must hold the same model and build the same buckets with the same
settings, or their messages would pair up wrong; these checks make every rank raise instead,
naming what differs. `broadcast_from_rank0` then gives every rank rank 0's parameters, and
before each forward its buffers.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..buckets import flatten, unflatten_
from ..validate import positive_int
from .group import group_state
from .peers import talking_to, wait

__all__ = ["check_same_model", "check_same_layout", "comm_layout", "broadcast_from_rank0"]


# torch's words when a wrapper on another group than the default one is copied (the copy would use the default group)
NOT_COPIED = ("DDP Pickling/Unpickling are only supported when using DDP with the default process group. That is, "
              "when you have called init_process_group and have not passed process_group argument to DDP constructor")


def check_same_model(module: nn.Module, group, world_size: int) -> None:
    """Raise on every rank unless every rank has the same parameter and buffer names, shapes and dtypes."""
    mine = [(kind, name, tuple(t.shape), str(t.dtype), t.requires_grad)
            for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers()))
            for name, t in named]
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    for r, theirs in enumerate(everyone):
        if theirs == everyone[0]:
            continue
        if len(theirs) != len(everyone[0]):
            detail = f"rank 0 has {len(everyone[0])} parameters and buffers, rank {r} has {len(theirs)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(everyone[0], theirs)) if a != b)
            detail = f"entry {i} is {everyone[0][i]} on rank 0 but {theirs[i]} on rank {r}"
        raise ValueError(f"DistributedDataParallel: the model differs across ranks ({detail}); "
                         "every rank must build the same model")


def check_same_layout(layout: dict, group, world_size: int) -> None:
    """Raise on every rank unless every rank gives the same `layout` (field name -> value).

    The wrapper compares its communication layout at construction: buckets (count, element
    counts, dtypes), bucket_cap_mb, algorithm (then each bucket's resolved one), segment_bytes
    and the flags that change which messages are sent. Ranks that differ there would pair wrong
    messages from the first backward on. The error names every differing field with each
    rank's value, in `check_same_call`'s form (`manualdp.spmd.call_check`).
    """
    if not isinstance(layout, dict) or not all(isinstance(k, str) for k in layout):
        raise TypeError(f"layout must be a dict from field names to values, got {layout!r}")
    positive_int("world_size", world_size)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, layout, group=group)
    if all(theirs == everyone[0] for theirs in everyone):
        return
    differ = []
    for field in dict.fromkeys(k for theirs in everyone for k in theirs):
        values = [_shown(theirs.get(field, "missing")) for theirs in everyone]
        if len(set(values)) > 1:
            differ.append(f"{field} {'..'.join(sorted(set(values), key=lambda v: (len(v), v)))} "
                          f"(per rank: {', '.join(values)})")
    raise ValueError(f"rank {dist.get_rank(group)}: DistributedDataParallel built differently across ranks: "
                     f"{'; '.join(differ)}; every rank must construct the wrapper with the same arguments "
                     "and the same model")


def comm_layout(ddp, buckets: list[list[torch.Tensor]], caps, rebuild_buckets: bool) -> dict:
    """What every rank's wrapper `ddp` must agree on for their messages to pair up (see `check_same_layout`)."""
    return {"buckets": len(buckets),
            "bucket elements": [sum(p.numel() for p in b) for b in buckets],
            "bucket dtypes": [str(b[0].dtype).replace("torch.", "") for b in buckets],
            "bucket_cap_mb": ddp.bucket_cap_mb, "bucket caps (MiB)": caps, "algorithm": ddp.algorithm,
            "segment_bytes": ddp.segment_bytes, "rebuild_buckets": rebuild_buckets,
            "broadcast_buffers": ddp.forward_sync_buffers, "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
            "static_graph": ddp.static_graph, "find_unused_parameters": ddp.find_unused_parameters, "debug": ddp.debug}


def _shown(value) -> str:
    """A layout value as the error shows it: lists in brackets without quotes."""
    if isinstance(value, (list, tuple)):
        return "[" + " ".join(map(str, value)) + "]"
    return str(value)


def broadcast_from_rank0(tensors: list[torch.Tensor], rank: int, peers: list[int], group, timeout, src: int = 0) -> None:
    """Overwrite `tensors` with those of the group's rank `src` (default 0), one flat message per dtype and device."""
    if len(peers) == 1:
        return
    held = []
    with torch.no_grad():
        # in the order they first appear: the same on every rank (a module may span several devices)
        for dtype, device in dict.fromkeys((t.dtype, t.device) for t in tensors):
            same = [t for t in tensors if t.dtype == dtype and t.device == device and t.numel()]
            if not same:
                continue
            flat = flatten(same)
            root = peers[src]
            peer = root if rank != src else None
            with talking_to(peer, timeout):
                work = dist.broadcast(flat, src=root, group=group, async_op=True)
            wait(work, peer, timeout)
            # .data: autograd may have saved these buffers (BatchNorm, two forwards before one backward)
            unflatten_(flat, [t.data for t in same])
            held.append((work, flat))
    # Held until this thread's next broadcast: gloo's thread lets go of a finished work a moment
    # after `wait` returns, and if its reference to `flat` were the last one, freeing it would need
    # the interpreter, which, when the script has just ended, aborts the process ("terminate called
    # without an active exception"; 6 of 40 processes that ended after a forward pass, torch's DDP 4).
    group_state(group).local.broadcast = held


def kept_named(named, ignored: set[str]) -> list:
    """The (name, tensor) pairs of `named` whose name is not in `ignored`."""
    return [(n, t) for n, t in named if n not in ignored]


def state_tensors(module: nn.Module, ignored: set[str], params: bool = False, buffers: bool = True) -> list[torch.Tensor]:
    """The module's buffers (and parameters first, with `params`) that are not ignored."""
    kept = kept_named(module.named_buffers(), ignored) if buffers else []
    return [t for _, t in (kept_named(module.named_parameters(), ignored) if params else []) + kept]


class KeptModule:
    """`module` as `check_same_model` sees it: without the parameters and buffers that are ignored."""

    def __init__(self, module: nn.Module, ignored: set[str]) -> None:
        self.module, self.ignored = module, ignored

    def named_parameters(self, *args, **kwargs):
        return iter(kept_named(self.module.named_parameters(*args, **kwargs), self.ignored))

    def named_buffers(self, *args, **kwargs):
        return iter(kept_named(self.module.named_buffers(*args, **kwargs), self.ignored))

    def parameters(self, *args, **kwargs):
        return iter(t for _, t in self.named_parameters(*args, **kwargs))

    def buffers(self, *args, **kwargs):
        return iter(t for _, t in self.named_buffers(*args, **kwargs))
