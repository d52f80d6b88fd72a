"""What the drop-in's ranks compare and copy at construction (torch's `init_sync`), and which tensors those are.

At construction every rank must hold the same model and build the same buckets with the same
settings, or their messages would pair up wrong: the wrapper compares the model
(`transport.agree.check_same_model`, its first exchange a checked call, so that a rank in another
collective meanwhile, out of step, is named at once on every rank, not waited out) and its
communication layout (`comm_layout`, by `check_same_layout`), then
`transport.agree.broadcast_from_rank0` gives every rank rank 0's parameters and buffers
(`state_tensors`), leaving out those torch's private API ignores.
"""
from __future__ import annotations

import torch
from torch import nn

from ...validate import positive_int
from ..transport.agree import agree, broadcast_from_rank0, check_same_model

__all__ = ["compare_and_copy", "check_same_layout", "comm_layout", "kept_named", "state_tensors", "KeptModule"]


# torch's words when a wrapper on another group than the default one is copied (the copy would use the default group)
NOT_COPIED = ("DDP Pickling/Unpickling are only supported when using DDP with the default process group. That is, "
              "when you have called init_process_group and have not passed process_group argument to DDP constructor")


def compare_and_copy(ddp, module: nn.Module, ignored: set[str], buckets: list[list[torch.Tensor]], caps,
                     rebuild_buckets: bool, more: dict) -> None:
    """torch's `init_sync`: the same model and layout (`comm_layout`, and `more`) on every rank, then rank 0's
    parameters and buffers (those `more` says are copied) everywhere."""
    group = ddp.process_group
    check_same_model(KeptModule(module, ignored) if ignored else module, group,
                     what="DistributedDataParallel's model", timeout=ddp.timeout, check=True)
    # Before "auto" calibrates: a rank asking for another algorithm would not join that collective.
    check_same_layout(comm_layout(ddp, buckets, caps, rebuild_buckets) | more, group, ddp.world_size)
    copied = state_tensors(module, ignored, params=True, buffers=more["buffers copied at construction"])
    broadcast_from_rank0(copied, group, ddp.timeout)


def check_same_layout(layout: dict, group, world_size: int) -> None:
    """Raise on every rank unless every rank gives the same `layout` (field name -> value).

    The wrapper compares its communication layout at construction: buckets (count, element
    counts, dtypes), bucket_cap_mb, algorithm (then each bucket's resolved one), segment_bytes
    and the flags that change which messages are sent. Ranks that differ there would pair wrong
    messages from the first backward on.
    """
    if not isinstance(layout, dict) or not all(isinstance(k, str) for k in layout):
        raise TypeError(f"layout must be a dict from field names to values, got {layout!r}")
    positive_int("world_size", world_size)
    agree("DistributedDataParallel's layout", layout, group,
          hint="every rank must construct the wrapper with the same arguments and the same model")


def comm_layout(ddp, buckets: list[list[torch.Tensor]], caps, rebuild_buckets: bool) -> dict:
    """What every rank's wrapper `ddp` must agree on for their messages to pair up (see `check_same_layout`)."""
    return {"buckets": len(buckets),
            "bucket elements": [sum(p.numel() for p in b) for b in buckets],
            "bucket dtypes": [str(b[0].dtype).replace("torch.", "") for b in buckets],
            "bucket_cap_mb": ddp.bucket_cap_mb, "bucket caps (MiB)": caps, "algorithm": ddp.algorithm,
            "segment_bytes": ddp.segment_bytes, "rebuild_buckets": rebuild_buckets,
            "broadcast_buffers": ddp.forward_sync_buffers, "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
            "static_graph": ddp.static_graph, "find_unused_parameters": ddp.find_unused_parameters, "debug": ddp.debug,
            "drift_check_every": ddp.drift.every}


def kept_named(named, ignored: set[str]) -> list:
    """The (name, tensor) pairs of `named` whose name is not in `ignored`."""
    return [(n, t) for n, t in named if n not in ignored]


def state_tensors(module: nn.Module, ignored: set[str], params: bool = False,
                  buffers: bool = True) -> list[torch.Tensor]:
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
