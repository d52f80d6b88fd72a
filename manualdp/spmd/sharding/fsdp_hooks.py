"""The hooks around a `fully_shard` unit's forward and backward: when it gathers, frees, and prefetches.

- before the module's forward: gather the unit (a new step starts when no forward is under way and no
  backward recomputes one), start the next unit's all-gather, cast the inputs (`mp_policy`);
- after it: hook every output that needs a gradient, free the full parameters (`reshard_after_forward`;
  None: all but the outermost unit, whose backward comes first), cast the outputs;
- when backward reaches the unit's outputs: gather the unit again, and start the all-gather of the unit
  whose forward came before.
The gradients' own hook, which reduce-scatters a unit once all are in, is the unit's (`fsdp_unit.py`).

Prefetch: all the collectives of a group run in order on its worker thread, so the next unit's
all-gather runs while this one computes. The next unit is, in forward, the one that came next in the
last step's forward (or the modules named by `set_modules_to_forward_prefetch`); in backward, the one
before in this forward (or those of `set_modules_to_backward_prefetch`).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .fsdp_drift import tick as drift_tick
from .fsdp_step import inside_backward

__all__ = ["install_hooks", "ForwardHooks"]


def install_hooks(unit) -> None:
    """Hook the unit's modules' forwards: the unit is gathered before the first and freed after the last."""
    if len(unit.modules) == 1:
        unit.module.register_forward_pre_hook(functools.partial(_before_forward, unit), with_kwargs=True)
        unit.module.register_forward_hook(functools.partial(_after_forward, unit), always_call=True)
        return
    for m in unit.modules:  # one unit of several modules: torch's group hooks
        m.register_forward_pre_hook(functools.partial(_before_group, unit), with_kwargs=True)
        m.register_forward_hook(functools.partial(_after_group, unit), always_call=True)


def _before_group(unit, module, args, kwargs):
    """The first of the unit's modules to run gathers it; the others find it gathered. Each casts its inputs."""
    if unit.to_run:
        return _cast_inputs(unit, args, kwargs)
    out = _before_forward(unit, module, args, kwargs)  # may start a new step, which forgets `to_run`
    unit.to_run.update(id(m) for m in unit.modules)
    return out


def _after_group(unit, module, args, output):
    """The last of the unit's modules to end its forward frees the unit (and hooks and casts its outputs)."""
    unit.to_run.discard(id(module))
    return None if unit.to_run else _after_forward(unit, module, args, output)


class ForwardHooks:
    """A unit's forward hooks under the names torch's `register_fsdp_forward_method` calls (`_get_fsdp_state()`)."""

    def __init__(self, unit) -> None:
        self.unit = unit

    def _pre_forward(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _before_forward(self.unit, module, args, kwargs) or (args, kwargs)

    def _post_forward(self, module, args, output):
        cast = _after_forward(self.unit, module, args, output)
        return output if cast is None else cast


def _before_forward(unit, module, args, kwargs):
    with torch._C._DisableFuncTorch():  # plain full parameters, also under torch.func.jvp (torch's FSDP2 works there)
        _gather_for_forward(unit)
    return _cast_inputs(unit, args, kwargs)


def _gather_for_forward(unit) -> None:
    step = unit.step
    if _recomputing(unit):  # activation checkpointing runs the forward again in backward: gather, nothing more
        step.depth, unit.entered = step.depth + 1, unit.entered + 1
        unit.gather("backward")
        return
    if step.depth == 0:  # a new step
        step.in_backward = False  # a backward that raised never reached `end_backward`
        step.end()                # a forward never followed by backward is dropped
        if torch.is_grad_enabled():
            drift_tick(unit)      # HSDP: the replicas' shards compared, at due steps
    step.depth, unit.entered = step.depth + 1, unit.entered + 1
    step.order.append(unit)
    unit.gather("forward", wait=False)
    if unit.forward_prefetch is not None:
        for other in unit.forward_prefetch:
            other.gather("prefetch", wait=False)
    else:  # the unit that came next in the last step
        k = len(step.order) - 1
        if k + 1 < len(step.last_order) and step.last_order[k] is unit:
            step.last_order[k + 1].gather("prefetch", wait=False)
    unit.gather("forward")


def _recomputing(unit) -> bool:
    """Whether this forward is a recomputation in backward (activation checkpointing): any forward that autograd's
    backward runs, also one that comes before the first of this backward's hooks."""
    return inside_backward()


def _cast_inputs(unit, args, kwargs):
    if unit.cast_forward_inputs and unit.param_dtype is not None:
        return _cast(args, unit.param_dtype), _cast(kwargs, unit.param_dtype)
    return None


def _after_forward(unit, module, args, output):
    if unit.entered == 0:  # an earlier hook failed before `_before_forward` ran
        return None
    step = unit.step
    step.depth, unit.entered = step.depth - 1, unit.entered - 1
    if _recomputing(unit):  # backward still needs the full parameters; the gradients' hook frees them
        return _cast(output, unit.output_dtype) if unit.output_dtype is not None else None
    grad = torch.is_grad_enabled()
    if grad:
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(functools.partial(_before_backward, unit))
    reshard = unit.reshard_after_forward if unit.reshard_after_forward is not None else step.depth > 0
    if not grad or reshard:
        unit.free()
    if step.depth == 0 and not grad:
        step.end()
    return _cast(output, unit.output_dtype) if unit.output_dtype is not None else None


def _before_backward(unit, grad: torch.Tensor) -> None:
    step = unit.step
    step.backward_begins()
    if not unit.unshard_in_backward:  # the gradients come without the parameters (set_unshard_in_backward)
        unit.seen = True
        return
    unit.gather("backward", wait=False)
    if not unit.seen:
        unit.seen = True
        if unit.backward_prefetch is not None:
            for other in unit.backward_prefetch:
                other.gather("prefetch", wait=False)
        else:  # the unit whose forward began just before this one's
            k = max(i for i, u in enumerate(step.order) if u is unit) if unit in step.order else 0
            if k > 0 and not step.order[k - 1].reduced and step.order[k - 1].unshard_in_backward:
                step.order[k - 1].gather("prefetch", wait=False)
    unit.gather("backward")


def _cast(obj, dtype: torch.dtype):
    """`obj` with its floating-point tensors cast to `dtype`, in the containers torch's FSDP2 follows (`_tensors`)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _cast(getattr(obj, f.name), dtype)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_cast(x, dtype) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(x, dtype) for x in obj)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj


def _tensors(obj):
    """The tensors in a module's output, in the containers torch's FSDP2 follows: tuples (named ones too), lists,
    dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)
