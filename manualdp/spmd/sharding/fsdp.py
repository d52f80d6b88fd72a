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
per parameter, `Shard(0)` (or `shard_placement_fn`'s dim) on a 1-D mesh, under the parameter's own name), and
the methods of torch's `FSDPModule` that training scripts call (`FSDPModule` below). So torch's utilities work on
the sharded model unchanged: `clip_grad_norm_`, `torch.distributed.checkpoint`, `model.state_dict()`,
`get_model_state_dict` / `set_model_state_dict` and their optimizer twins, full or sharded.

One role a file, as FSDP2's `torch/distributed/fsdp/_fully_shard/`: this page is the API;
`fsdp_init.py` checks a call; `fsdp_param.py` holds one parameter's two forms (shard and full);
`fsdp_unit.py` gathers and frees a unit's parameters, and starts their reduce-scatter;
`fsdp_collectives.py` moves their bytes (the book's schedules); `fsdp_hooks.py` hooks a unit's
forward and backward; `fsdp_step.py` is the step under way of a tree of units; `fsdp_state_dict.py`
keeps `state_dict()` to the shards; `fsdp_norm.py` gives an empty shard its infinity norm;
`fsdp_meta.py` initialises a meta-device model as one process would (`init_full`); `fsdp_hsdp.py` all-reduces
across HSDP's replicas, and `fsdp_drift.py` checks that they still hold the same shards.

As torch's: a sharded module is torch's `FSDPModule` too (`isinstance`, `register_fsdp_forward_method`);
`requires_grad_` after sharding takes effect at the next forward; the hook that gathers a unit again for
backward follows its outputs through tuples, lists, dicts and dataclasses; composable activation
checkpointing recomputes a unit without resharding it; `set_gradient_divide_factor` sets one module's.

Where it differs from torch's FSDP2:
- every rank starts from rank 0's parameters and buffers (a broadcast, as `DistributedDataParallel`
  does; on HSDP's mesh, across the replicas and then within each); a model built on the meta device is
  not broadcast: initialise it after `to_empty`, with
  `init_full(model, init)` to start where one process would (torch's draws every rank's shard alike);
- `clip_grad_norm_(..., norm_type=inf)` where a rank's shard is empty (fewer rows than ranks) gives the
  norm (torch's raises there, and the other ranks wait);
- an optimizer built from the gathered parameters (after a forward, before its backward), a full state
  dict given to `load_state_dict`, or one cut for another world size, are refused in one line that says
  what to do instead;
- a weight tied across two units moves to the unit that encloses both (torch's cannot gather it);
- `reshard_after_forward` as an int smaller than the group (torch's: keep a copy sharded over fewer
  ranks) reshards over all of them: the same numbers, less memory, one more all-gather's latency;
- ranks that run other units, or one unit more, or use a parameter on some ranks only, all raise
  naming the unit (torch's pairs the collectives up, or hangs);
- HSDP's replicas of a shard that parted (a shard changed on one rank, a stale .grad stepped on one replica) are
  named on every rank at steps 0, 1, 2, 4, ... then every 100 (`drift_check_every`; torch's trains on).
HSDP, as torch's: on a 2-D mesh (replicate, shard) each parameter is sharded over dim 1 (a DTensor placed
`(Replicate(), Shard(0))`), and a unit's gradients are reduce-scattered there, then all-reduced across the
replicas over dim 0 (`fsdp_hsdp.py`); `set_requires_all_reduce(False)` keeps the sums for a later backward.
FSDP + TP, as torch's: after `parallelize_module(model, mesh["tp"], plan)`, `fully_shard(model, mesh=mesh["dp"])`
cuts each DTensor parameter's tp piece over dp: its shard is a DTensor on the (dp, tp) mesh placed `(Shard(0) or
_StridedShard(0), tp's)`, and the modules see the gathered piece as tp's DTensor (`fsdp_tp.py`).
`CPUOffloadPolicy(pin_memory=False)` is taken on cpu, where the shards live in host memory already.
`shard_placement_fn` (a parameter -> `Shard(dim)` or None) cuts a parameter along another dim
(`fsdp_placement.py`), also unevenly. A tensor-subclass parameter (torch's `TwoTensor`) is sharded as torch's,
and torch's all-gather extensions (`fsdp_pre_all_gather`/`fsdp_post_all_gather`) run as torch's (`fsdp_ext.py`).
Not supported (each refused in one line): a mesh of more than two dimensions, a 2-D mesh without
`mesh_dim_names`, a mesh per parameter, offloading off cpu, custom all-gather, reduce-scatter and all-reduce,
HSDP over tp, and over tp a shard dim other than 0 or a lower-precision `mp_policy`.

The book's ZeRO-3 (`manualdp.zero3.Zero3`) keeps one flat shard per unit instead: it teaches the idea
on one page. Per-parameter shards cost a copy in and out of the flat buffer each all-gather and
reduce-scatter, and buy every torch utility that takes parameters one by one.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from ...validate import boolean, nn_module
from ..ladder.drift import DRIFT_CHECK_EVERY, DriftCheck
from ..transport.agree import broadcast_from_rank0
from .fsdp_hooks import ForwardHooks, install_hooks
from .fsdp_init import Checked, checked_arguments
from .fsdp_meta import init_full
from .fsdp_norm import register_empty_shard_norms
from .fsdp_param import Param, watch_optimizers
from .fsdp_state_dict import check_whole, install_state_dict_hooks, shards_kept
from .fsdp_tp import local_of
from .fsdp_unit import UNIT, Unit

__all__ = ["fully_shard", "full_state_dict", "init_full", "FSDPModule", "UnshardHandle"]


class UnshardHandle:
    """What `FSDPModule.unshard(async_op=True)` returns: `wait()` until the full parameters are in place."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    def wait(self) -> None:
        self._unit.gather("unshard")


class FSDPModule(TorchFSDPModule):
    """The class a module sharded by `fully_shard` joins: `isinstance(m, FSDPModule)`, and torch's `FSDPModule` too.

    `fully_shard(module)` changes `module`'s class to `FSDP<Class>`, a subclass of this and of the
    module's own class, so that these methods (torch's names, torch's meaning) are the module's. It derives
    from torch's `FSDPModule` so that the checks users' code makes (torchtitan's gradient division, pytorch/
    examples' `inspect_model`) find it; every method of torch's is defined here again, on our units.
    """

    _orig_cls_mro_index = 3  # torch's `__new__` (slicing a sharded Sequential): [FSDP<Cls>, ours, torch's, Cls]

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
        """HSDP: whether backward all-reduces the gradients across replicas; False keeps the reduce-scatter's sums
        for the backward that does (the shards get no gradient until then). A 1-D mesh has no all-reduce."""
        boolean("requires_all_reduce", requires_all_reduce)
        for m in self._fsdp_modules(recurse):
            m._unit().requires_all_reduce = requires_all_reduce

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
        """Divide this module's own summed gradients by `factor` instead of the number of ranks (1.0: sums); the
        units inside it keep theirs (as torch's)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0 or factor == float("inf"):
            raise ValueError(f"factor must be a positive finite number, got {factor!r}")
        self._unit().divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """torch's older name for `set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Sum in the collectives and divide after: what this `fully_shard` always does, so it changes nothing."""
        boolean("enable", enable)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward gathers this module's own unit: False only where backward reads none of its parameters
        (an embedding's weight), as torch's."""
        boolean("unshard_in_backward", unshard_in_backward)
        self._unit().unshard_in_backward = unshard_in_backward

    def set_post_optim_event(self, event) -> None:
        """A GPU event the next all-gathers wait for; the collectives run on one ordered worker, so nothing to do."""

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Whether forward's all-gathers are asynchronous; they run on the group's worker already, so nothing."""
        boolean("async_op", async_op)

    def _get_fsdp_state(self) -> ForwardHooks:
        """What torch's `register_fsdp_forward_method` calls around another method: this unit's forward hooks."""
        return ForwardHooks(self._unit())

    def reset_iter_state(self) -> None:
        """After forward or backward raised: free every unit's full parameters and forget the step."""
        self._unit().step.end()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's, with the whole state dict checked before any tensor is written: a refused load changes nothing."""
        check_whole(self, state_dict, strict, assign)
        with shards_kept(self):  # what torch refuses that the check did not foresee: put back, bitwise
            return super().load_state_dict(state_dict, strict, assign)

    def _apply(self, fn, recurse: bool = True):  # to_empty, to, float...: take the new tensors as the shards
        out = super(TorchFSDPModule, self)._apply(fn, recurse)  # the module's own, not torch's FSDP state
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


def fully_shard(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int | None = None, shard_placement_fn=None,
                mp_policy: MixedPrecisionPolicy | None = None, offload_policy=None,
                ignored_params: set[nn.Parameter] | None = None, group=None, timeout: float | None = None,
                recorder=None, drift_check_every: int = DRIFT_CHECK_EVERY) -> nn.Module | list[nn.Module]:
    """Shard `module`'s parameters over the ranks of `mesh` (or `group`; default: all), in place; returns `module`.

    Apply it to submodules first, then to their parents and the root, as torch's `fully_shard`. A list of
    modules (torchtitan's `fully_shard([model.norm, model.output])`) is one unit, as torch's: one all-gather
    before the first of them runs forward, one reshard after the last, one reduce-scatter of all their gradients.
    Keywords as torch's: `mesh` (a 1-D DeviceMesh, or HSDP's 2-D (replicate, shard)), `reshard_after_forward`
    (free a unit's full parameters after its forward and gather them again for backward; None: every unit but the
    outermost), `mp_policy` (torch's `MixedPrecisionPolicy`: gather and compute in `param_dtype`,
    reduce in `reduce_dtype`, cast outputs to `output_dtype`), `ignored_params` (left whole, not
    sharded, not synchronised). Ours: `group` (instead of `mesh`), `timeout` (seconds to wait for a
    silent peer; default: the group's, or on a mesh the world group's), `recorder` (a
    `manualdp.support.trace.Trace` that gets every collective), `drift_check_every` (HSDP: compare the replicas'
    shards at steps 0, 1, 2, 4, ... below it, then at its multiples, `fsdp_drift.py`; 0: never; the outermost
    call's holds for the tree).
    Every rank must call it alike; it compares the ranks' calls first.
    """
    call = checked_arguments(module, mesh, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy,
                             ignored_params, group, timeout, drift_check_every)
    # Checked: from here on every rank changes the module the same way.
    unit = Unit(call.modules, call.group, call.mesh, call.reshard, call.mp_policy, call.timeout, recorder,
                call.replicate)
    unit.step.tied_apart = call.tied_apart
    unit.step.drift = DriftCheck(call.drift_check_every)
    unit.take_in(call.nested)  # the units already inside: one tree, one step
    fresh = [local_of(p) for p, _, _ in call.taken.values() if not isinstance(p, Param)]  # over tp: its piece
    if not call.meta:  # every rank starts from rank 0's values, sent on the worker in line with the collectives
        for group in ([call.replicate] if call.replicate is not None else []) + [call.group]:  # HSDP: replicas first
            unit.worker.submit(broadcast_from_rank0, fresh + call.buffers, group, call.timeout).result()
    values, originals = _values(call)
    for param, original in zip(unit.lay_out(values), originals):
        param.replaces(original)  # what the user's model held: emptied, its values are in the shards
    unit.name_tree(call.nested)
    install_hooks(unit)
    install_state_dict_hooks(unit)
    for m in call.modules:  # a list's modules share the unit: each is an FSDPModule, as torch's
        m.__dict__[UNIT] = unit
        m.__class__ = _fsdp_class(type(m))
    watch_optimizers()
    register_empty_shard_norms()
    return module


def _values(call: Checked) -> tuple[list, list[nn.Parameter]]:
    """What the unit lays out, (slots, full value, trainable, name, shard dim) per parameter, and the user's
    parameters."""
    values, originals = [], []
    for key, (p, slots, name) in call.taken.items():
        if isinstance(p, Param):  # a weight tied to a unit inside this one: it moves here, where both users are
            inner = next(u for _, c in call.nested for u in c.tree() if p in u.params)
            more, value = inner.give_up(p)
            values.append((more + slots, value, p.requires_grad, name, call.dims[key]))
            originals.append(p.original)
        else:
            values.append((slots, p.detach(), p.requires_grad, name, call.dims[key]))
            originals.append(p)
    return values, originals


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
