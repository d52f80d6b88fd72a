"""`fully_shard` over tensor parallelism: a parameter that is a DTensor already (FSDP + TP, a 2-D (dp, tp) mesh).

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])

As torch's FSDP2: each DTensor parameter's *local* tensor (this rank's tensor-parallel piece) is cut
into rows over dp, as a plain parameter is; the shard the optimizer and `model.parameters()` see is a
DTensor on the 2-D mesh (dp, tp) with placements `(Shard(0), tp's placement)`, or `(_StridedShard(0,
split_factor=tp size), Shard(0))` when tp cuts dim 0 too (dp's rows are then rows of each tp piece, not
of the whole), of the parameter's global size and stride. While gathered, the modules see the gathered
local tensor as a DTensor on the tp mesh with tp's placements, which TP's parallel styles need; its
gradient, redistributed to those placements (a Partial one is summed over tp first), is what the unit
reduce-scatters over dp. Plain parameters of the same model stay on the dp mesh, `(Shard(0),)`, as torch's.

Not supported (refused in one line on every rank, a field of `fsdp_init`'s agreement): HSDP over tp (a 3-D
mesh), a tp mesh that is not a sibling of dp's in one root mesh (also no mesh given: the world's), a DTensor on the
dp mesh itself (sharded by torch's fully_shard), more than one tp dimension, a Partial or strided placement, a
shard dim other than 0, and an `mp_policy` of another dtype than the parameter's (one naming its own dtype
changes nothing and is taken).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["TPSpec", "tp_spec", "tp_refusal", "tp_piece", "local_of", "unsharded", "local_grad"]


@dataclass(frozen=True)
class TPSpec:
    """Where a tensor-parallel parameter lives: tp's mesh and placements, and its 2-D shard's."""

    tp_mesh: DeviceMesh
    tp_placements: tuple
    mesh: DeviceMesh       # (dp, tp), dp's mesh and tp's concatenated
    placements: tuple      # the shard's: (dp's, tp's)
    stride: tuple          # the parameter's global stride


def tp_spec(value: DTensor, dp_mesh: DeviceMesh) -> TPSpec:
    """The spec of `value` (a DTensor on a tp mesh) sharded over `dp_mesh` along dim 0 (checked by `tp_refusal`)."""
    tp_placements = tuple(value.placements)
    tp_shards = math.prod(value.device_mesh.size(i) for i, pl in enumerate(tp_placements)
                          if isinstance(pl, Shard) and pl.dim == 0)
    dp = _StridedShard(0, split_factor=tp_shards) if tp_shards > 1 else Shard(0)
    return TPSpec(value.device_mesh, tp_placements, DeviceMesh._concatenate([dp_mesh, value.device_mesh]),
                  (dp, *tp_placements), tuple(value.stride()))


def tp_refusal(p: DTensor, name: str, mesh: DeviceMesh, dim: int, mp_policy) -> Exception | None:
    """Why `fully_shard(mesh=mesh)` cannot shard `p`, a DTensor parameter over tensor parallelism, or None."""
    how = f"{name} is a DTensor on {p.device_mesh} placed {tuple(p.placements)} (tensor parallelism)"
    if mesh.ndim != 1:
        return NotImplementedError(f"{how}: HSDP over tensor parallelism (a {mesh.ndim}-D dp mesh) is not supported by "
                                   "manualdp's fully_shard; shard over a 1-D dp mesh")
    if p.device_mesh == mesh:
        return ValueError(f"{how}: it is sharded on the dp mesh itself already (by torch's fully_shard?): shard a "
                          "module once, with one fully_shard")
    if p.device_mesh.ndim != 1:
        return NotImplementedError(f"{how}: manualdp's fully_shard takes one tp dimension, not {p.device_mesh.ndim}")
    if p.device_mesh.device_type != mesh.device_type:
        return ValueError(f"{how}: its mesh is {p.device_mesh.device_type!r}, the dp mesh {mesh.device_type!r}")
    if any(type(pl) not in (Shard, Replicate) for pl in p.placements):
        return NotImplementedError(f"{how}: manualdp's fully_shard takes Shard or Replicate tp placements")
    if dim:
        return NotImplementedError(f"{how}: shard_placement_fn gave Shard({dim}); over tensor parallelism "
                                   "manualdp's fully_shard shards dim 0 (as torch's)")
    lower = [d for d in (mp_policy.param_dtype, mp_policy.reduce_dtype) if d is not None and d != p.dtype]
    if lower:  # a policy naming the parameter's own dtype changes nothing: taken, as torch's
        return NotImplementedError(f"{how}: mp_policy's param_dtype and reduce_dtype other than the parameter's "
                                   f"{p.dtype} ({lower[0]}) are not supported over tensor parallelism by manualdp's "
                                   "fully_shard; pass MixedPrecisionPolicy()")
    if p.dim() == 0 or not p._local_tensor.is_contiguous():
        return ValueError(f"{how}: its local tensor is 0-dim or not contiguous, which fully_shard cannot cut")
    try:
        DeviceMesh._concatenate([mesh, p.device_mesh])
    except Exception as e:  # noqa: BLE001 - torch's reasons vary (other roots, overlapping dims)
        return ValueError(f"{how}: its tp mesh and the dp mesh {mesh} are not sibling dimensions of one root mesh "
                          f"({str(e).splitlines()[0] if str(e) else type(e).__name__}): slice both from one "
                          "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))")
    return None


def tp_piece(full: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """This rank's tp piece of `full` (the whole parameter), as tp's placements cut it."""
    shape, offset = compute_local_shape_and_global_offset(full.shape, spec.tp_mesh, spec.tp_placements)
    for dim, (size, start) in enumerate(zip(shape, offset)):
        full = full.narrow(dim, start, size)
    return full


def local_of(t: torch.Tensor) -> torch.Tensor:
    """`t`'s local tensor if it is a DTensor, else `t`."""
    return t._local_tensor if isinstance(t, DTensor) else t


def unsharded(local: torch.Tensor, spec: TPSpec, shape: torch.Size, requires_grad: bool) -> nn.Parameter:
    """The parameter the modules see while gathered: `local` (tp's piece, whole over dp) as a DTensor on tp's mesh;
    its local tensor shares `local`'s storage."""
    whole = DTensor.from_local(local, spec.tp_mesh, spec.tp_placements, run_check=False, shape=shape,
                               stride=spec.stride)
    return nn.Parameter(whole, requires_grad=requires_grad)


def local_grad(grad: torch.Tensor | None, spec: TPSpec) -> torch.Tensor | None:
    """The local tensor of a gathered parameter's gradient, in tp's placements (a Partial one summed over tp)."""
    if grad is None or not isinstance(grad, DTensor):
        return grad
    if tuple(grad.placements) != spec.tp_placements:
        grad = grad.redistribute(spec.tp_mesh, spec.tp_placements)
    return grad._local_tensor
