"""ZeRO-3 in the engine: `fully_shard`, in the manner of torch's FSDP2, on the book's schedules.

    for layer in model.layers:
        fully_shard(layer)              # bottom-up: each layer is a unit,
    fully_shard(model)                  # then the root takes what is left (embedding, tied head)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)   # this rank's shards, nothing else
    loss_fn(model(X), y).backward()     # all-gather before each unit, reduce-scatter after it
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # torch's own: the shards are DTensors
    opt.step()

It is a drop-in for `torch.distributed.fsdp.fully_shard`: the same keywords (`mesh`,
`reshard_after_forward`, `mp_policy`, `ignored_params`), the same per-parameter shards (a DTensor
per parameter, `Shard(0)` on a 1-D mesh, under the parameter's own name), and the methods of
torch's `FSDPModule` that training scripts call (`FSDPModule` below). So torch's utilities work on
the sharded model unchanged: `clip_grad_norm_`, `torch.distributed.checkpoint`, `model.state_dict()`,
`get_model_state_dict` / `set_model_state_dict` and their optimizer twins, full or sharded. What a
unit does in a step is `fsdp_unit.py`; its all-gathers and reduce-scatters are the book's schedules.

Where it differs from torch's FSDP2:
- every rank starts from rank 0's parameters and buffers (a broadcast, as `DistributedDataParallel`
  does); a model built on the meta device is not broadcast: initialise it after `to_empty`;
- a weight tied across two units moves to the unit that encloses both (torch's cannot gather it);
- `reshard_after_forward` as an int smaller than the group (torch's: keep a copy sharded over fewer
  ranks) reshards over all of them: the same numbers, less memory, one more all-gather's latency;
- ranks that run other units, or one unit more, or use a parameter on some ranks only, all raise
  naming the unit (torch's pairs the collectives up, or hangs).
Not supported (each refused in one line): a mesh of more than one dimension (HSDP),
`shard_placement_fn`, `offload_policy`, a list of modules, custom all-gather and reduce-scatter.

The book's ZeRO-3 (`manualdp.zero3.Zero3`) keeps one flat shard per unit instead: it teaches the idea
on one page. Per-parameter shards cost a copy in and out of the flat buffer each all-gather and
reduce-scatter, and buy every torch utility that takes parameters one by one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ...validate import boolean, initialized, nn_module, timeout_seconds
from ..transport.agree import agree, broadcast_from_rank0
from ..transport.peers import group_ranks
from .fsdp_unit import REPLACED, SLOTS, Param, Unit, owner_of, set_owner

__all__ = ["fully_shard", "full_state_dict", "FSDPModule", "UnshardHandle"]

UNIT = "_manualdp_fsdp"  # in a sharded module's __dict__: its Unit


class UnshardHandle:
    """What `FSDPModule.unshard(async_op=True)` returns: `wait()` until the full parameters are in place."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    def wait(self) -> None:
        self._unit.gather("unshard")


class FSDPModule:
    """The class a module sharded by `fully_shard` joins (as torch's `FSDPModule`): `isinstance(m, FSDPModule)`.

    `fully_shard(module)` changes `module`'s class to `FSDP<Class>`, a subclass of this and of the
    module's own class, so that these methods (torch's names, torch's meaning) are the module's.
    """

    def _unit(self) -> Unit:
        return self.__dict__[UNIT]

    def _fsdp_modules(self, recurse: bool) -> list["FSDPModule"]:
        return [m for m in self.modules() if isinstance(m, FSDPModule)] if recurse else [self]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather the full parameters now; with `async_op`, return a handle whose `wait()` waits for them."""
        boolean("async_op", async_op)
        unit = self._unit()
        unit.gather("unshard", wait=not async_op)
        return UnshardHandle(unit) if async_op else None

    def reshard(self) -> None:
        """Free the full parameters; the shards take their places again."""
        self._unit().free()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backward reduce-scatters the gradients; False accumulates them unsharded (gradient accumulation)."""
        boolean("requires_gradient_sync", requires_gradient_sync)
        for m in self._fsdp_modules(recurse):
            m._unit().requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP's all-reduce switch; a 1-D mesh has no all-reduce, so it changes nothing (as torch's)."""
        boolean("requires_all_reduce", requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether forward frees the full parameters (backward gathers them again)."""
        boolean("reshard_after_forward", reshard_after_forward)
        for m in self._fsdp_modules(recurse):
            m._unit().reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether backward frees the full parameters; False keeps them for the next forward (gradient
        accumulation without all-gathers): do not step the optimizer before they are freed."""
        boolean("reshard_after_backward", reshard_after_backward)
        for m in self._fsdp_modules(recurse):
            m._unit().reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Start these modules' all-gathers when this module's forward starts (instead of the last step's next)."""
        self._unit().forward_prefetch = _units("modules", modules)

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Start these modules' all-gathers when backward reaches this module (instead of the one before it)."""
        self._unit().backward_prefetch = _units("modules", modules)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of the step; every backward here waits for its reduce-scatters
        and clears its state, so it changes nothing (accepted for torch's scripts)."""
        boolean("is_last_backward", is_last_backward)
        self._unit().is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by `factor` instead of the number of ranks (1.0: sums)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0 or factor == float("inf"):
            raise ValueError(f"factor must be a positive finite number, got {factor!r}")
        for m in self._fsdp_modules(True):
            m._unit().divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """torch's older name for `set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Sum in the collectives and divide after: what this `fully_shard` always does, so it changes nothing."""
        boolean("enable", enable)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward gathers this module's parameters; only True is supported (backward needs them)."""
        boolean("unshard_in_backward", unshard_in_backward)
        if not unshard_in_backward:
            raise NotImplementedError("set_unshard_in_backward(False) is not supported by manualdp's fully_shard")

    def set_post_optim_event(self, event) -> None:
        """A GPU event the next all-gathers wait for; the collectives run on one ordered worker, so nothing to do."""

    def reset_iter_state(self) -> None:
        """After forward or backward raised: free every unit's full parameters and forget the step."""
        self._unit().top().end_step()

    def _apply(self, fn, recurse: bool = True):  # to_empty, to, float...: take the new tensors as the shards
        out = super()._apply(fn, recurse)
        self.__dict__[UNIT].adopt()
        return out

    def __deepcopy__(self, memo):
        raise TypeError(f"a module sharded by fully_shard ({type(self).__name__}) cannot be deep-copied: copy "
                        "full_state_dict(model) into a fresh model instead")

    def __reduce_ex__(self, protocol):
        raise TypeError(f"a module sharded by fully_shard ({type(self).__name__}) cannot be pickled: save "
                        "model.state_dict() with torch.distributed.checkpoint, or full_state_dict(model)")


for _name in ("set_custom_all_gather", "set_custom_reduce_scatter", "set_all_reduce_hook",
              "set_reduce_scatter_unused_params", "set_reduce_scatter_max_input_buffers",
              "set_separate_reduce_scatter_group", "set_allocate_memory_from_process_group_for_comm",
              "set_symm_mem_for_comm"):
    def _unsupported(self, *args, _name=_name, **kwargs):
        raise NotImplementedError(f"FSDPModule.{_name} is not supported by manualdp's fully_shard: its "
                                  "all-gathers and reduce-scatters are the book's schedules")
    _unsupported.__name__ = _name
    setattr(FSDPModule, _name, _unsupported)


def _units(name: str, modules) -> list[Unit]:
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, FSDPModule) for m in modules):
        raise TypeError(f"{name} must be a list of modules sharded by fully_shard, got {modules!r}")
    return [m._unit() for m in modules]


_classes: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    """`FSDP<cls>`: `cls` with `FSDPModule`'s methods first, made once per class (as torch's)."""
    if cls not in _classes:
        _classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _classes[cls]


def _mesh_and_group(mesh, group, device_type: str):
    if mesh is not None and group is not None:
        raise ValueError("pass mesh or group, not both")
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
        if mesh.ndim != 1:
            raise NotImplementedError(f"mesh has {mesh.ndim} dimensions: manualdp's fully_shard shards over a 1-D "
                                      "mesh (HSDP's 2-D mesh is not supported)")
        if mesh.device_type != device_type:
            raise ValueError(f"mesh is a {mesh.device_type!r} mesh, the parameters are on {device_type!r}")
        return mesh, mesh.get_group()
    if dist.is_initialized() and group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives a non-member
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of it")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    group_ranks(group)  # torch.distributed is initialised, and this process belongs to `group`
    pg = group if group is not None else dist.group.WORLD
    return DeviceMesh.from_group(pg, device_type), group


def _reshard_after_forward(value, world_size: int) -> bool | None:
    """torch's meanings: None (all but the outermost unit), a bool, or an int dividing the group size."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value < 1 or value > world_size or world_size % value:
            raise ValueError(f"reshard_after_forward as an int must divide the group size {world_size}, got {value}")
        return value != 1  # 1: keep the full parameters; any other: reshard (over all ranks here)
    raise TypeError(f"reshard_after_forward must be a bool, an int or None, got {value!r}")


def fully_shard(module: nn.Module, *, mesh: DeviceMesh | None = None, reshard_after_forward: bool | int | None = None,
                shard_placement_fn=None, mp_policy: MixedPrecisionPolicy | None = None, offload_policy=None,
                ignored_params: set[nn.Parameter] | None = None, group=None, timeout: float | None = None,
                recorder=None) -> nn.Module:
    """Shard `module`'s parameters over the ranks of `mesh` (or `group`; default: all), in place; returns `module`.

    Apply it to submodules first, then to their parents and the root, as torch's `fully_shard`.
    Keywords as torch's: `mesh` (a 1-D DeviceMesh), `reshard_after_forward` (free a unit's full
    parameters after its forward and gather them again for backward; None: every unit but the
    outermost), `mp_policy` (torch's `MixedPrecisionPolicy`: gather and compute in `param_dtype`,
    reduce in `reduce_dtype`, cast outputs to `output_dtype`), `ignored_params` (left whole, not
    sharded, not synchronised). Ours: `group` (instead of `mesh`), `timeout` (seconds to wait for a
    silent peer), `recorder` (a `manualdp.support.trace.Trace` that gets every collective).
    Every rank must call it alike; it compares the ranks' calls first.
    """
    if isinstance(module, (list, tuple)):
        raise NotImplementedError("module: manualdp's fully_shard takes one module at a time, not a list")
    nn_module("module", module)
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
        raise ValueError(f"module is a {type(module).__name__}, a container without a forward of its own: its "
                         "forward never runs, so neither would the unit's; shard each of its children instead")
    if shard_placement_fn is not None:
        raise NotImplementedError("shard_placement_fn is not supported by manualdp's fully_shard: it shards dim 0")
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise NotImplementedError(f"offload_policy={type(offload_policy).__name__} is not supported by manualdp's "
                                  "fully_shard")
    mp_policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
                        f"{type(mp_policy).__name__}")
    ignored = _ignored(ignored_params)
    timeout = timeout_seconds("timeout", timeout)
    if UNIT in module.__dict__:
        raise ValueError(f"module ({type(module).__name__}) is already sharded by fully_shard: "
                         "apply it once per module")
    taken, slot_order, nested, buffers = _walk(module, ignored)
    devices = {p.sharded.device if isinstance(p, Param) else p.device for p, _, _ in taken.values()}
    if len(devices) > 1:
        raise ValueError(f"module ({type(module).__name__}) has parameters on several devices: fully_shard needs one")
    meta = devices == {torch.device("meta")}
    if not meta:
        initialized("module", module)
    if meta:  # the device the model will be moved to (to_empty): the mesh's, or the backend's
        device_type = mesh.device_type if mesh is not None else ("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    else:
        device_type = next(iter(devices)).type if devices else "cpu"
    mesh, group = _mesh_and_group(mesh, group, device_type)
    world_size = mesh.size()
    reshard = _reshard_after_forward(reshard_after_forward, world_size)
    for p, _, name in taken.values():
        if not isinstance(p, Param) and p.dim() == 0:
            raise ValueError(f"{name} is a 0-dim parameter: fully_shard cuts dim 0, as torch's; pass it in "
                             "ignored_params, or make it shape (1,)")
    _check_same_call(module, group, reshard, mp_policy, taken, nested, buffers, ignored)
    # Checked: from here on every rank changes the module the same way.
    unit = Unit(module, group, mesh, reshard, mp_policy, timeout, recorder)
    for path, child in nested:
        child.parent = unit
        unit.children.append(child)
    fresh = [p for p, _, _ in taken.values() if not isinstance(p, Param)]
    if not meta:  # every rank starts from rank 0's parameters and buffers; on the worker, in line with the collectives
        unit.worker.submit(broadcast_from_rank0, fresh + buffers, group, timeout).result()
    laid, originals = [], []
    for p, slots, name in taken.values():
        if isinstance(p, Param):  # a weight tied to a unit inside this one: it moves here, where both users are
            inner = next(u for _, c in nested for u in c.tree() if p in u.params)
            more, value = inner.give_up(p)
            laid.append((more + slots, value, p.requires_grad, name))
            originals.append(p.original)
        else:
            laid.append((slots, p.detach(), p.requires_grad, name))
            originals.append(p)
    for param, original in zip(unit.lay_out(laid), originals):
        param.original = original  # what the user's model held: emptied, marked, pointing at its Param
        set_owner(original, param)
        setattr(original, REPLACED, True)
        original.data = torch.empty(0, dtype=original.dtype, device=original.device)  # its values are in the shards
    for number, u in enumerate(unit.tree(), 1):
        u.number = number
    for path, child in nested:
        for u in child.tree():
            u.name = path + (f".{u.name}" if u.name else "")
    module.register_forward_pre_hook(unit.before_forward, with_kwargs=True)
    module.register_forward_hook(unit.after_forward, always_call=True)
    module.__dict__[UNIT] = unit
    module.__class__ = _fsdp_class(type(module))
    _watch_optimizers()
    return module


def _ignored(ignored_params) -> set[int]:
    if ignored_params is None:
        return set()
    if not isinstance(ignored_params, (set, frozenset, list, tuple)) or not all(
            isinstance(p, nn.Parameter) for p in ignored_params):
        raise TypeError(f"ignored_params must be a set of nn.Parameter, got {type(ignored_params).__name__}")
    return {id(p) for p in ignored_params}


def _walk(module: nn.Module, ignored: set[int]):
    """What `fully_shard(module)` takes: the parameters of its subtree outside the units already in it
    (id -> (parameter, its slots, its name)), their slots in order, those units (the first met on each
    path, with their paths), and the buffers met. Raises, naming them, on parameters held elsewhere."""
    taken: dict[int, tuple[nn.Parameter, list, str]] = {}
    slot_order, nested, buffers, seen = [], [], {}, set()

    def visit(sub: nn.Module, path: str) -> None:
        if id(sub) in seen:
            return
        seen.add(id(sub))
        if sub is not module and UNIT in sub.__dict__:
            nested.append((path, sub.__dict__[UNIT]))
            return
        for attr, p in sub._parameters.items():
            if p is None or id(p) in ignored:
                continue
            owner = owner_of(p)  # a Param: a unit holds p, or p is what a unit replaced (a tied weight)
            if owner is None and isinstance(p, DTensor):
                raise ValueError(f"{path + '.' if path else ''}{attr} is a DTensor already (sharded by torch's "
                                 "fully_shard, or by tensor parallelism): manualdp's fully_shard shards plain "
                                 "parameters; use one fully_shard for the whole model")
            if owner is not None and p is owner.sharded:
                unit = sub.__dict__[SLOTS][attr]
                raise ValueError(f"{path or 'module'} ({type(sub).__name__}) lies inside a module already sharded "
                                 f"by fully_shard (its {attr!r} is held by the unit of {type(unit.module).__name__}): "
                                 "apply fully_shard bottom-up, submodules first, then their parents")
            entry = taken.setdefault(id(owner if owner is not None else p),
                                     (owner if owner is not None else p, [], f"{path}.{attr}" if path else attr))
            entry[1].append((sub, attr))
            slot_order.append((sub, attr))
        buffers.update((id(b), b) for b in sub._buffers.values() if b is not None)
        for name, child in sub._modules.items():
            if child is not None:
                visit(child, f"{path}.{name}" if path else name)

    visit(module, "")
    inside = {id(q) for _, child in nested for u in child.tree() for q in u.params}
    for p, _, name in taken.values():
        if isinstance(p, Param) and id(p) not in inside:
            raise ValueError(f"{name} is tied to a parameter that another unit holds, and that unit is not inside "
                             "this module: apply fully_shard to a module that holds both users of the weight "
                             "(their common ancestor), not to each of them")
    return taken, slot_order, nested, list(buffers.values())


def _check_same_call(module, group, reshard, mp_policy, taken, nested, buffers, ignored) -> None:
    """Raise on every rank unless every rank shards the same parameters, buffers and units alike."""
    fields = {"reshard_after_forward": reshard, "mp_policy": mp_policy, "ignored_params": len(ignored),
              "units inside": [path for path, _ in nested],
              "buffers": [f"{tuple(b.shape)} {b.dtype}" for b in buffers]}
    for p, _, name in taken.values():
        fields[f"parameter {name}"] = ("tied" if isinstance(p, Param) else
                                       f"{tuple(p.shape)} {p.dtype}" + ("" if p.requires_grad else " frozen"))
    agree(f"fully_shard({type(module).__name__})", fields, group,
          hint="every rank must build the same model and shard it alike")


_watching = False


def _watch_optimizers() -> None:
    """Once: make any optimizer step refuse a parameter that fully_shard replaced by its shard (built too early)."""
    global _watching
    if not _watching:
        register_optimizer_step_pre_hook(_refuse_replaced)
        _watching = True


def _refuse_replaced(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, REPLACED, False):
                raise ValueError(f"{type(optimizer).__name__} holds a parameter that fully_shard replaced by its "
                                 f"shard (shape {tuple(p.shape)}, emptied): build the optimizer after fully_shard, "
                                 "from model.parameters()")


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state dict as if it had never been sharded: its own keys, full tensors, on every rank.

    A collective: every rank must call it (each shard is gathered by DTensor's `full_tensor()`).
    """
    nn_module("module", module)
    state = module.state_dict()
    if not any(isinstance(v, DTensor) for v in state.values()):
        raise ValueError(f"module ({type(module).__name__}) holds nothing sharded by fully_shard: "
                         "use module.state_dict()")
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
