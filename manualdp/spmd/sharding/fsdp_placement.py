"""`fully_shard`'s `shard_placement_fn`, as torch's FSDP2 takes it: which dim each parameter is cut along.

The callable gets each parameter the call shards and returns `Shard(dim)` (torch's
`torch.distributed.tensor.Shard`; a negative dim counts from the end) or None (dim 0). Anything else is
refused in one line naming the parameter and the value; torch's per-parameter meshes (`ShardPlacementResult`)
and strided shards are refused as not supported. The refusal is returned, not raised: `fsdp_init.py` makes
every rank agree on it first, so that a callable that answers differently on one rank cannot leave the others
waiting. A weight tied to a unit inside keeps the dim its unit cut it along.
"""
from __future__ import annotations

from torch.distributed.tensor import Shard

from .fsdp_param import Param

__all__ = ["shard_dims"]


def shard_dims(taken: dict, shard_placement_fn) -> tuple[dict[int, int], Exception | None]:
    """(id -> dim, the first refusal or None) for each parameter of `taken` (as `fsdp_init._walk` returns it)."""
    dims: dict[int, int] = {}
    for key, (p, _, name) in taken.items():
        if isinstance(p, Param):
            dims[key] = p.dim
            continue
        if shard_placement_fn is None or p.dim() == 0:  # a 0-dim parameter is refused on its own (`_refusal`)
            dims[key] = 0
            continue
        try:
            result = shard_placement_fn(p)
        except Exception as e:  # noqa: BLE001 - the user's code: its failure becomes the agreed refusal
            return dims, ValueError(f"shard_placement_fn raised on {name}: {type(e).__name__}: {e}")
        dim, refused = _dim(result, p.dim(), name)
        if refused is not None:
            return dims, refused
        dims[key] = dim
    return dims, None


def _dim(result, ndim: int, name: str) -> tuple[int, Exception | None]:
    """The dim `result` (what shard_placement_fn returned for `name`, of `ndim` dims) shards along, or a refusal."""
    if result is None:
        return 0, None
    if type(result).__name__ == "ShardPlacementResult":  # torch's: a placement on a mesh of its own
        return 0, NotImplementedError(f"shard_placement_fn returned a ShardPlacementResult for {name} (a mesh per "
                                      "parameter): manualdp's fully_shard shards every parameter on the call's mesh; "
                                      "return Shard(dim) or None")
    if not isinstance(result, Shard) or type(result) is not Shard:
        return 0, ValueError(f"shard_placement_fn returned {result!r} for {name}: expected Shard(dim) "
                             "(torch.distributed.tensor.Shard) or None")
    if not -ndim <= result.dim < ndim:
        return 0, ValueError(f"shard_placement_fn returned Shard({result.dim}) for {name}, which has {ndim} dims: "
                             f"the dim must lie in [{-ndim}, {ndim})")
    return result.dim % ndim, None
