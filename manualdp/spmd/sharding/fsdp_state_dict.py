"""A sharded module's `state_dict()` and `load_state_dict()`: always the shards, and one line for a wrong state dict.

Each submodule that holds a sharded parameter gets three hooks, as torch's FSDP2 registers its own:
- before its `state_dict()`: the shards take the full parameters' places (between a forward and its backward,
  or with `set_reshard_after_backward(False)`, the full ones sit there); after it, the full ones come back.
  So the state dict holds the DTensor shards, which the optimizer steps in place, never a gathered copy that
  goes stale;
- before its `load_state_dict()`: a full tensor where the model holds a shard (a one-process state dict),
  a shard cut for another world size, or a DTensor on another mesh (whose step would meet the optimizer's state on
  the model's mesh), is refused in one line that says what loads it; a DTensor on the model's mesh with other
  placements (a state dict saved with another `shard_placement_fn`) is redistributed to the model's, as torch's
  loader does, after the ranks agree on what moves (each move is a collective); and a unit
  gathered now is freed, so that the values load into the shards and a backward still to come gathers
  them again (torch's FSDP2 does the same); `check_whole` makes the same checks, and torch's, for the whole
  tree before a sharded module's `load_state_dict` writes anything (or, under a plain module over sharded
  children, before the first of them loads: torch has loaded the plain module's own tensors and the plain
  children walked before it by then, and the refusal names them), so a refused load of a sharded root leaves the
  model as it was; a DTensor replicated on
  the model's mesh that holds the whole value is taken as torch's FSDP2 takes it: this rank's shard of it. What
  torch's loader refuses beyond these checks (a meta DTensor, a user's hook) changes nothing either: a sharded
  module's load runs inside `shards_kept`, which keeps a copy of every shard and buffer for the load's time and
  puts it back, bitwise, if the load raises (a plain root over sharded children loads by torch's own
  `load_state_dict`, which nothing wraps: there, only `check_whole`'s refusals leave the model as it was);
- after it: a DTensor that `load_state_dict(..., assign=True)` put in a parameter's place becomes its shard
  (pytorch/examples' FSDP2 script resumes a model built on the meta device that way), as torch's does.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..ladder.loading import check_loadable, unchanged_if_refused
from ..transport.agree import agree
from .fsdp_param import SLOTS
from .fsdp_unit import UNIT

__all__ = ["install_state_dict_hooks", "check_whole", "shards_kept"]

HOOKED = "_manualdp_fsdp_state_dict_hooks"  # in a submodule's __dict__: its hooks are registered
_CHECKED = "_manualdp_fsdp_checked"  # on torch's copy of a state dict under load: `check_whole` ran for this load
_LOAD_CODE = nn.Module.load_state_dict.__code__  # torch's `load_state_dict`, found on the stack by its code


def install_state_dict_hooks(unit) -> None:
    """Hook the `state_dict` and `load_state_dict` of every submodule that holds one of `unit`'s parameters, once."""
    for p in unit.params:
        for sub, _ in p.slots:
            if not sub.__dict__.get(HOOKED):
                sub.__dict__[HOOKED] = True
                sub.register_state_dict_pre_hook(_shards_in)
                sub.register_state_dict_post_hook(_fulls_back)
                sub.register_load_state_dict_pre_hook(_check_loaded)
                sub.register_load_state_dict_post_hook(_take_assigned)


def _held(sub: nn.Module):
    """(attribute, its `Param`) for each sharded parameter `sub` holds."""
    for attr, unit in sub.__dict__.get(SLOTS, {}).items():
        yield attr, next(p for p in unit.params if any(s is sub and a == attr for s, a in p.slots))


def _shards_in(sub: nn.Module, prefix: str, keep_vars: bool) -> None:
    swapped = []
    for attr, p in _held(sub):
        if p.full is not None and sub._parameters.get(attr) is p.full:
            sub._parameters[attr] = p.sharded
            swapped.append((attr, p.full))
    sub.__dict__["_manualdp_fsdp_swapped"] = swapped


def _fulls_back(sub: nn.Module, state_dict, prefix: str, local_metadata) -> None:
    for attr, full in sub.__dict__.pop("_manualdp_fsdp_swapped", []):
        sub._parameters[attr] = full


def check_whole(module: nn.Module, state_dict, strict: bool, assign: bool = False) -> None:
    """Every refusal of a load into `module` (the sharded ones below, torch's own: `ladder.loading`), before any
    submodule's tensors are written: a refused load leaves the model as it was. The ranks agree on the values
    that the load redistributes between them, first."""
    moves: dict = {}  # mesh -> key -> its placements and the model's
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr, p in _held(sub):
            key = f"{prefix}.{attr}" if prefix else attr
            value = state_dict.get(key) if isinstance(state_dict, Mapping) else None
            if isinstance(value, torch.Tensor):
                _refuse(key, value, p)
                if _moved(value, p):
                    moves.setdefault(p.sharded.device_mesh, {})[key] = f"{value.placements} -> {p.sharded.placements}"
    for mesh, moved in moves.items():
        _agree_on_moves(moved, mesh)
    check_loadable(module, state_dict, strict, type(module).__name__, sharded=lambda sub, name: name in
                   sub.__dict__.get(SLOTS, {}), assign=assign)


def shards_kept(module: nn.Module):
    """`unchanged_if_refused` for a sharded module: its shards kept (and put back, bitwise, if the load raises)."""
    return unchanged_if_refused(module, kept=_shard_of)


def _shard_of(sub: nn.Module, name: str, held: torch.Tensor) -> torch.Tensor:
    """The tensor that holds `name`'s value between steps: the shard, also while the full one sits in its place."""
    return next((p.sharded for attr, p in _held(sub) if attr == name), held)


def _on_mesh(value: torch.Tensor, p) -> bool:
    """A DTensor of `p`'s whole shape on `p`'s mesh, placed any way: torch's loader redistributes it to `p`'s placements
    (a replicated one: this rank's shard of it, cut here; one sharded otherwise: moved between the ranks)."""
    return (isinstance(value, DTensor) and value.device_mesh == p.sharded.device_mesh and value.shape == p.shape
            and tuple(value.to_local().shape) == _local_shape(value))


def _local_shape(value: DTensor) -> tuple[int, ...]:
    """This rank's piece of `value` as its placements cut it (torch.chunk's rows: ceil, the last ones short or
    empty); a piece of another shape was cut for another world size (`DTensor.from_local(..., run_check=False)`).
    DTensor's own reckoning: over tensor parallelism dp's `_StridedShard` cuts tp's pieces, not the whole."""
    return tuple(compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements,
                                                       skip_offset=True)[0])


def _moved(value: torch.Tensor, p) -> bool:
    """A DTensor on `p`'s mesh whose redistribution to `p`'s placements moves data between ranks (not only cuts)."""
    return _on_mesh(value, p) and any(theirs != mine and not theirs.is_replicate()
                                      for theirs, mine in zip(value.placements, p.sharded.placements))


def _agree_on_moves(moves: dict[str, str], mesh) -> None:
    """The ranks redistribute the same values the same way (each a collective over the mesh), or all raise alike."""
    for dim in range(mesh.ndim):  # check: a rank that moves nothing goes on to its next collective; both raise there
        agree("load_state_dict's redistribution", moves, mesh.get_group(dim), check=True,
              hint="every rank must load a state dict with the same placements")


def _refuse(key: str, value: torch.Tensor, p) -> None:
    """A full tensor, a shard of another world size, or a DTensor on another mesh or of another shape, where `p`'s
    shard sits."""
    if _on_mesh(value, p):
        return
    if not isinstance(value, DTensor):
        raise ValueError(f"load_state_dict: {key} is a full tensor of shape {tuple(value.shape)}, and the model "
                         "holds this rank's shard of it: load a full state dict with torch.distributed.checkpoint."
                         "state_dict.set_model_state_dict(model, state, options=StateDictOptions("
                         "full_state_dict=True))")
    same_mesh = value.device_mesh == p.sharded.device_mesh
    if same_mesh and value.shape != p.shape:
        raise ValueError(f"load_state_dict: {key} has shape {tuple(value.shape)}, and the model's parameter "
                         f"{tuple(p.shape)}: load a state dict saved from a model of the same shapes")
    mine, theirs = p.sharded.to_local().shape, value.to_local().shape
    other_cut = theirs != mine and value.placements == p.sharded.placements  # else named by its placements below
    if value.device_mesh.size() != p.sharded.device_mesh.size() or other_cut or same_mesh:
        raise ValueError(f"load_state_dict: {key} is a shard cut for another world size (here {tuple(theirs)} "
                         f"on a mesh of {value.device_mesh.size()}; this rank's is {tuple(mine)} on "
                         f"{p.sharded.device_mesh.size()}): save and load across world sizes with "
                         "torch.distributed.checkpoint (dcp.save, then dcp.load into model.state_dict()), "
                         "which reshards")
    raise ValueError(f"load_state_dict: {key} is a DTensor on {value.device_mesh} with {value.placements}, "
                     f"and the model shards it on {p.sharded.device_mesh} with {p.sharded.placements}: "
                     "build the state dict on the model's mesh (distribute_tensor(full, "
                     "model_param.device_mesh, model_param.placements)), or load with dcp.load")


def _outermost_load() -> tuple[nn.Module, Mapping, bool, bool] | None:
    """(module, its whole state dict, strict, assign) of the outermost `nn.Module.load_state_dict` under way here.

    A plain module over sharded children (`fully_shard` on the children only) loads with torch's `load_state_dict`,
    whose hooks on each child see that child's keys only: the whole is read from torch's frame, the one place it is.
    """
    frame, outer = sys._getframe(1), None
    while frame is not None:
        if frame.f_code is _LOAD_CODE:
            outer = frame
        frame = frame.f_back
    if outer is None:
        return None
    found = outer.f_locals
    module, state_dict = found.get("self"), found.get("state_dict")
    if not isinstance(module, nn.Module) or not isinstance(state_dict, Mapping):
        return None
    return module, state_dict, bool(found.get("strict", True)), bool(found.get("assign", False))


def _check_whole_once(state_dict, prefix: str) -> None:
    """Before the first sharded submodule of a load under a plain module loads: `check_whole` of the outermost
    module, once per load (a mark on torch's copy of the state dict), so that a refusal comes before any sharded
    child loaded. torch's loader has already loaded the plain module's own tensors and the plain children walked
    before this one (no hook of ours reaches a plain root before its load starts): a refusal names them."""
    outer = _outermost_load()
    if outer is None:
        return
    module, whole, strict, assign = outer
    if UNIT in module.__dict__ or getattr(whole, _CHECKED, False):  # a sharded module's own load checked it first
        return
    try:
        check_whole(module, whole, strict, assign)
    except (ValueError, RuntimeError, TypeError) as e:
        loaded = _loaded_before(module, whole, prefix)
        if not loaded:
            raise
        said = str(e).replace("; nothing was loaded", "")
        raise type(e)(f"{said}; but torch's load_state_dict had loaded {', '.join(loaded)} before it reached "
                      f"{prefix[:-1]}, the first sharded submodule (shard the root too, fully_shard(model) after "
                      f"its children, and a refused load changes nothing)") from None
    try:
        setattr(whole, _CHECKED, True)
    except AttributeError:  # a mapping that takes no attributes: checked again at the next sharded child, alike
        pass


def _loaded_before(module: nn.Module, state_dict: Mapping, prefix: str) -> list[str]:
    """The keys torch's loader copied into `module` before it reached the submodule at `prefix` (in its walk order)."""
    loaded = []
    for name, sub in module.named_modules(remove_duplicate=False):
        at = f"{name}." if name else ""
        if at == prefix:
            break
        persistent = [(n, b) for n, b in sub._buffers.items() if n not in sub._non_persistent_buffers_set]
        for attr, held in [*sub._parameters.items(), *persistent]:
            value = state_dict.get(at + attr)
            if held is not None and isinstance(value, torch.Tensor) and value.shape == held.shape:
                loaded.append(at + attr)
    return loaded


def _check_loaded(sub, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    _check_whole_once(state_dict, prefix)
    held = list(_held(sub))
    for attr, p in held:
        value = state_dict.get(prefix + attr)
        if isinstance(value, torch.Tensor):
            _refuse(prefix + attr, value, p)
        if isinstance(value, torch.Tensor) and _on_mesh(value, p) and value.placements != p.sharded.placements:
            # this rank's shard of it, cut as the model's is (`check_whole` had the ranks agree on the moves)
            state_dict[prefix + attr] = value.redistribute(p.sharded.device_mesh, p.sharded.placements)
    for attr, p in held:  # the values load into the shards; a backward still to come gathers them again (as torch's)
        if p.full is not None and sub._parameters.get(attr) is p.full:
            sub.__dict__[SLOTS][attr].free()


def _take_assigned(sub: nn.Module, incompatible_keys) -> None:
    """`assign=True` put new parameters in `sub`'s places: each becomes its `Param`'s shard, in every slot."""
    for attr, p in _held(sub):
        if sub._parameters.get(attr) is not p.sharded and sub._parameters.get(attr) is not p.full:
            sub.__dict__[SLOTS][attr].adopt(p, (sub, attr))
