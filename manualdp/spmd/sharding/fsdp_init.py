"""`fully_shard`'s checks, all in one place: `checked_arguments` returns what a call shards, and how.

Each argument is checked where the user hands it in, once; then the module is walked (its parameters
outside the units already inside it, those units, its buffers), refused where it cannot be sharded
(a module inside a sharded one, a weight tied to a unit outside it, a 0-dim parameter, parameters on
several devices, a DTensor that `fsdp_tp.py` cannot take over tensor parallelism), and every rank's call is
compared with the others' before anything changes (`agree`), so that all ranks raise alike, naming the field.
`fsdp.py` then shards.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

from ...validate import initialized, nn_module, non_negative_int, timeout_seconds
from ..ladder.drift import DRIFT_CHECK_EVERY
from ..transport.agree import agree
from ..transport.peers import group_ranks, group_timeout
from .fsdp_param import SLOTS, Param, owner_of
from .fsdp_placement import shard_dims
from .fsdp_tp import tp_refusal
from .fsdp_unit import UNIT

__all__ = ["checked_arguments", "Checked"]


@dataclass
class Checked:
    """A `fully_shard` call, checked and agreed on by every rank: what it shards, over which group, how."""

    group: object        # the process group of the shards' collectives (None: the default group)
    mesh: DeviceMesh     # the mesh of the shards: 1-D, or HSDP's 2-D (replicate, shard)
    reshard: bool | None  # reshard_after_forward, in torch's meanings
    mp_policy: MixedPrecisionPolicy
    timeout: float | None
    taken: dict          # id -> (a parameter, or the `Param` of a weight tied inside, its slots, its name)
    nested: list         # (path, unit): the units already inside the module, the first met on each path
    buffers: list        # the buffers met, each once
    meta: bool           # the module is on the meta device: nothing to broadcast yet
    modules: list        # the modules of the unit: one, or the roots of a list (torch's `fully_shard([a, b])`)
    replicate: object = None  # HSDP: the group of this rank's replicas (mesh dim 0); None on a 1-D mesh
    tied_apart: str | None = None  # a weight tied to another unit's, not inside: left out, the forward raises this
    drift_check_every: int = DRIFT_CHECK_EVERY  # HSDP: the replicas' shards compared at `drift.due` steps
    dims: dict = field(default_factory=dict)  # id (as `taken`) -> the dim `shard_placement_fn` shards it on


def checked_arguments(module, mesh, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy,
                      ignored_params, group, timeout, drift_check_every=DRIFT_CHECK_EVERY) -> Checked:
    """Check `fully_shard`'s arguments and module, then that every rank calls it alike; raise before any change."""
    modules = _modules(module)
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"shard_placement_fn must be a callable from a parameter to Shard(dim) or None, got "
                        f"{type(shard_placement_fn).__name__}")
    mp_policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
                        f"{type(mp_policy).__name__}")
    ignored = _ignored(ignored_params)
    timeout = timeout_seconds("timeout", timeout)
    non_negative_int("drift_check_every", drift_check_every)
    for m in modules:
        if UNIT in m.__dict__:
            raise ValueError(f"module ({type(m).__name__}) is already sharded by fully_shard: "
                             "apply it once per module")
    taken, nested, buffers, tied_apart = _walk(modules, ignored)
    meta, device_type = _device(modules, taken, mesh, group)
    _offload(offload_policy, device_type)
    if timeout is None and mesh is not None:  # a mesh's sub-groups get torch's default timeout, not the world's
        timeout = group_timeout()
    mesh, group, replicate = _mesh_and_group(mesh, group, device_type)
    reshard = _reshard_after_forward(reshard_after_forward, mesh.size(mesh.ndim - 1))
    # a parameter refused on one rank only (a tensor subclass with torch's all-gather extensions, say) must not
    # leave its peers waiting in the agreement: the refusal is one of the fields, then raised on every rank
    refused = next((e for p, _, name in taken.values() if not isinstance(p, (Param, DTensor))
                    for e in (_refusal(p, name),) if e is not None), None)
    dims, placement_refused = shard_dims(taken, shard_placement_fn)
    # a DTensor parameter (tensor parallelism): its tp piece is sharded over dp, where `fsdp_tp.py` supports it
    tp_refused = next((e for key, (p, _, name) in taken.items() if isinstance(p, DTensor)
                       for e in (tp_refusal(p, name, mesh, dims.get(key, 0), mp_policy),) if e is not None), None)
    refused = refused or placement_refused or tp_refused
    # HSDP: the replicas agree too, told whether the shard group did: a difference inside one shard group must not
    # leave the other groups' ranks waiting for it in the replicas' agreement
    failed = None
    for g in (group, replicate) if replicate is not None else (group,):
        try:
            _check_same_call(modules, g, reshard, mp_policy, taken, dims, nested, buffers, ignored,
                             f"{type(refused).__name__}: {refused}" if refused is not None else "nothing",
                             drift_check_every, "no" if failed is not None else "yes")
        except ValueError as e:
            failed = failed or e
    if failed is not None:
        raise failed
    if refused is not None:
        raise refused
    return Checked(group, mesh, reshard, mp_policy, timeout, taken, nested, buffers, meta, modules, replicate,
                   tied_apart, drift_check_every, dims)


def _refusal(p: nn.Parameter, name: str) -> Exception | None:
    """Why fully_shard cannot cut `p` into rows (0-dim, not contiguous), or None. A tensor subclass is cut as torch's
    chunks it (its shard is of the subclass), and all-gathered by its extensions if it has them (`fsdp_ext.py`)."""
    if p.dim() == 0:
        return ValueError(f"{name} is a 0-dim parameter, which fully_shard cannot cut (as torch's). Change {name} to "
                          "a 1D tensor with numel equal to 1 (shape (1,)), or pass it in ignored_params")
    if not p.is_contiguous():
        return NotImplementedError(f"{name} is not contiguous (stride {p.stride()}, e.g. channels_last): FSDP does not "
                                   "support non-contiguous parameters (torch's neither); call module.to(memory_format="
                                   "torch.contiguous_format) first")
    return None


def _modules(module) -> list[nn.Module]:
    """The unit's modules: `module`, or those of a list that lie inside no other of it (as torch's)."""
    if isinstance(module, (list, tuple)):
        if not module or not all(isinstance(m, nn.Module) for m in module):
            raise TypeError(f"module must be an nn.Module or a non-empty list of them, got "
                            f"[{', '.join(type(m).__name__ for m in module)}]")
        inner = {id(sub) for m in module for sub in m.modules() if sub is not m}
        roots = {id(m): m for m in module if id(m) not in inner}
        modules = list(roots.values())
    else:
        modules = [nn_module("module", module)]
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(f"module is a {type(m).__name__}, a container without a forward of its own: its "
                             "forward never runs, so neither would the unit's; shard each of its children instead")
    return modules


def label(modules: list[nn.Module]) -> str:
    """'Linear', or '[LayerNorm, Linear]' for a unit of several modules."""
    names = [type(m).__name__ for m in modules]
    return names[0] if len(names) == 1 else f"[{', '.join(names)}]"


def _ignored(ignored_params) -> set[int]:
    if ignored_params is None:
        return set()
    if not isinstance(ignored_params, (set, frozenset, list, tuple)) or not all(
            isinstance(p, nn.Parameter) for p in ignored_params):
        raise TypeError(f"ignored_params must be a set of nn.Parameter, got {type(ignored_params).__name__}")
    return {id(p) for p in ignored_params}


def _device(modules: list[nn.Module], taken: dict, mesh, group) -> tuple[bool, str]:
    """(Whether the module is on the meta device, the device type its shards will live on)."""
    devices = {p.sharded.device if isinstance(p, Param) else p.device for p, _, _ in taken.values()}
    if len(devices) > 1:
        raise ValueError(f"module ({label(modules)}) has parameters on several devices: fully_shard needs one")
    if devices != {torch.device("meta")}:
        for m in modules:
            initialized("module", m)
        return False, next(iter(devices)).type if devices else "cpu"
    if mesh is not None:  # the device the model will be moved to (to_empty): the mesh's, or the backend's
        return True, mesh.device_type
    return True, "cuda" if dist.get_backend(group) == "nccl" else "cpu"


def _offload(offload_policy, device_type: str) -> None:
    """Take no offload, or torch's CPUOffloadPolicy where the shards live in host memory already (cpu)."""
    if offload_policy is None or type(offload_policy) is OffloadPolicy:
        return
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be a torch.distributed.fsdp.OffloadPolicy, got "
                        f"{type(offload_policy).__name__}")
    if not isinstance(offload_policy, CPUOffloadPolicy) or device_type != "cpu":
        raise NotImplementedError(f"offload_policy={type(offload_policy).__name__} on {device_type!r} is not "
                                  "supported by manualdp's fully_shard (CPUOffloadPolicy is, on cpu)")
    # on cpu the shards, their gradients and the optimizer step already live where torch's offload puts them
    if offload_policy.pin_memory:
        raise ValueError("offload_policy=CPUOffloadPolicy(pin_memory=True) pins host memory for an accelerator, "
                         "and the parameters are on cpu: pass CPUOffloadPolicy(pin_memory=False)")


class UnnamedMeshError(ValueError, AssertionError):
    """A 2-D mesh without names: torch's raises an AssertionError, ours is a ValueError too."""


def _mesh_and_group(mesh, group, device_type: str):
    if mesh is not None and group is not None:
        raise ValueError("pass mesh or group, not both")
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
        if mesh.ndim not in (1, 2):  # torch's words first: pytorch's tests match them
            raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: mesh has {mesh.ndim} "
                             "dimensions; pass a 1-D mesh, or HSDP's 2-D (replicate, shard) mesh")
        if mesh.device_type != device_type:
            raise ValueError(f"mesh is a {mesh.device_type!r} mesh, the parameters are on {device_type!r}")
        if mesh.ndim == 2 and mesh.mesh_dim_names is None:
            raise UnnamedMeshError("Please init the 2D mesh for HSDP with mesh_dim_names specified: mesh is 2-D "
                                   "without mesh_dim_names; pass mesh_dim_names=('replicate', 'shard')")
        if mesh.ndim == 2:  # HSDP, as torch's: shard over dim 1, replicate over dim 0
            return mesh, mesh.get_group(1), mesh.get_group(0)
        return mesh, mesh.get_group(), None
    if dist.is_initialized() and group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives a non-member
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of it")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    group_ranks(group)  # torch.distributed is initialised, and this process belongs to `group`
    pg = group if group is not None else dist.group.WORLD
    return DeviceMesh.from_group(pg, device_type), group, None


def _reshard_after_forward(value, world_size: int) -> bool | None:
    """torch's meanings: None (all but the outermost unit), a bool, or an int dividing the group size."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value < 1 or value > world_size or world_size % value:
            raise ValueError(f"reshard_after_forward as an int must divide the group size {world_size}, got {value}")
        return value != 1  # 1: keep the full parameters; any other: reshard (over all ranks here)
    raise TypeError(f"reshard_after_forward must be a bool, an int or None, got {value!r}")


def _walk(modules: list[nn.Module], ignored: set[int]):
    """What `fully_shard(modules)` takes: the parameters of their subtrees outside the units already in them
    (id -> (parameter, its slots, its name)), those units (the first met on each path, with their paths),
    and the buffers met. Raises, naming them, on parameters held elsewhere."""
    taken: dict[int, tuple[nn.Parameter, list, str]] = {}
    nested, buffers, seen = [], {}, set()

    def visit(sub: nn.Module, path: str) -> None:
        if id(sub) in seen:
            return
        seen.add(id(sub))
        if UNIT in sub.__dict__ and not any(sub is m for m in modules):
            if all(u is not sub.__dict__[UNIT] for _, u in nested):  # a unit of several modules: met once
                nested.append((path, sub.__dict__[UNIT]))
            return
        for attr, p in sub._parameters.items():
            if p is None or id(p) in ignored:
                continue
            owner = owner_of(p)  # a Param: a unit holds p, or p is what a unit replaced (a tied weight)
            if owner is not None and p is owner.sharded:
                unit = sub.__dict__[SLOTS][attr]
                raise ValueError(f"{path or 'module'} ({type(sub).__name__}) lies inside a module already sharded "
                                 f"by fully_shard (its {attr!r} is held by the unit of {type(unit.module).__name__}): "
                                 "apply fully_shard bottom-up, submodules first, then their parents")
            entry = taken.setdefault(id(owner if owner is not None else p),
                                     (owner if owner is not None else p, [], f"{path}.{attr}" if path else attr))
            entry[1].append((sub, attr))
        buffers.update((id(b), b) for b in sub._buffers.values() if b is not None)
        for name, child in sub._modules.items():
            if child is not None:
                visit(child, f"{path}.{name}" if path else name)

    for i, m in enumerate(modules):  # the modules of a list are named by their place in it
        visit(m, "" if len(modules) == 1 else f"modules[{i}]")
    # a weight tied to a unit outside: as torch's, the unit leaves it out and its first forward raises
    inside = {id(q) for _, child in nested for u in child.tree() for q in u.params}
    apart = [key for key, (p, _, _) in taken.items() if isinstance(p, Param) and id(p) not in inside]
    tied_apart = None if not apart else (
        f"{taken[apart[0]][2]} is already managed by another fully_shard unit (a weight tied to a parameter that "
        "unit holds, and that unit is not inside this module): apply fully_shard to a module that holds both users "
        "of the weight (their common ancestor), or shard them together as a list, not each on its own")
    for key in apart:
        del taken[key]
    return taken, nested, list(buffers.values()), tied_apart


def _check_same_call(modules, group, reshard, mp_policy, taken, dims, nested, buffers, ignored, refused: str,
                     drift_check_every: int, shard_group: str) -> None:
    """Raise on every rank unless every rank shards the same parameters, buffers and units alike, and refuses alike
    (and checks HSDP's replicas at the same steps: a rank that skipped a check would leave its peers waiting)."""
    fields = {"refused": refused, "reshard_after_forward": reshard, "mp_policy": mp_policy,
              "drift_check_every": drift_check_every, "shard group (mesh dim 1) agreed": shard_group,
              "ignored_params": len(ignored), "units inside": [path for path, _ in nested],
              "buffers": [f"{tuple(b.shape)} {b.dtype}" for b in buffers]}
    for key, (p, _, name) in taken.items():
        fields[f"parameter {name}"] = ("tied" if isinstance(p, Param) else
                                       f"{tuple(p.shape)} {p.dtype}" + ("" if p.requires_grad else " frozen")
                                       + (f" {tuple(p.placements)}" if isinstance(p, DTensor) else "")) + (
                                       f" Shard({dims[key]})" if dims.get(key) else "")
    agree(f"fully_shard({label(modules)})", fields, group,
          hint="every rank must build the same model and shard it alike")
