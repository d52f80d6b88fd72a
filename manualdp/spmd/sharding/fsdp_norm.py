"""The infinity norm of a shard with no rows: the identity of its reduction, so `clip_grad_norm_(inf)` works.

A parameter with fewer rows than ranks leaves the last ranks an empty shard (as `torch.chunk` cuts).
`clip_grad_norm_(..., norm_type=inf)` asks DTensor for each gradient's norm: every rank computes its
local norm, then they take the maximum over the mesh. On an empty local tensor aten refuses (the
maximum of nothing has no value), so that rank raises while the others wait for it in the
all-reduce (torch's FSDP2 on CPU does the same). Yet the maximum of absolute values is never
below 0: an empty shard's infinity norm is 0 (and its -inf norm, a minimum, is +inf).

So `fully_shard` registers, once, a handler for the two norms in DTensor's dispatcher (the way
torch's own `loss_parallel` adds its handlers): where a DTensor's local tensor is empty and the
norm is +-inf, the local tensor is replaced by one row holding that identity, and the norm goes on
as DTensor computes it. Every other call is DTensor's own.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

__all__ = ["register_empty_shard_norms"]

_aten = torch.ops.aten
_NORMS = (_aten._foreach_norm.Scalar, _aten.linalg_vector_norm.default)


def register_empty_shard_norms() -> None:
    """Once per process: DTensor's +-inf norms of an empty local shard give the reduction's identity."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _NORMS:
        handlers.setdefault(op, _norm_with_empty_shards)


def _norm_with_empty_shards(op_call, args: tuple, kwargs: dict):
    """DTensor's own norm, with each empty local shard as one row of the identity when the norm is +-inf."""
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    if isinstance(ord_, (int, float)) and math.isinf(ord_):
        fill = 0.0 if ord_ > 0 else math.inf
        first = [_filled(t, fill) for t in args[0]] if isinstance(args[0], (list, tuple)) else _filled(args[0], fill)
        args = (first, *args[1:])
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers.pop(op_call, None)  # DTensor's own path for this call (torch's loss_parallel adds and removes its own)
    try:
        return op_call(*args, **kwargs)
    finally:
        handlers[op_call] = _norm_with_empty_shards


def _filled(t, fill: float):
    """`t`, or where `t` is a DTensor with an empty local tensor, the same DTensor over one row of `fill`."""
    if not isinstance(t, DTensor) or t.to_local().numel() > 0 or t.dim() == 0:
        return t
    local = t.to_local()
    dim = next((pl.dim for pl in t.placements if pl.is_shard()), 0)  # shard_placement_fn may cut along another dim
    one_row = torch.full(local.shape[:dim] + (1,) + local.shape[dim + 1:], fill, dtype=local.dtype,
                         device=local.device)
    return DTensor.from_local(one_row, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
