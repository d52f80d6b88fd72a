"""ZeRO-3 in the engine: `fully_shard`, in the manner of torch's FSDP2, on the book's schedules.

    for layer in model.layers:
        fully_shard(layer)              # bottom-up: each layer is a unit,
    fully_shard(model)                  # then the root takes what is left (embedding, tied head)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)   # this rank's shards, nothing else
    loss_fn(model(X), y).backward()     # all-gather before each unit, reduce-scatter after it
    opt.step()
    full = full_state_dict(model)       # on every rank: the model's own keys, full tensors

`fully_shard(module)` takes every parameter of `module`'s subtree that no unit inside it holds
already, and keeps this rank's near-equal chunk of them as one flat `nn.Parameter` per dtype,
registered on `module` (`flat_shard_float32`; frozen ones apart, `flat_shard_float32_frozen`).
The original parameters leave the modules; their names become plain attributes, views of a
buffer that is filled (all-gathered) only while forward or backward needs it. What a unit does
in a step is `fsdp_unit.py`. Buffers stay whole. Every rank starts from rank 0's parameters
and buffers (a broadcast, as `DistributedDataParallel` does).

Where it differs from torch's FSDP2:
- flat shards, not one DTensor per parameter: `module.state_dict()` holds the shards (save it
  on every rank, load it into the same sharding: a sharded checkpoint); `full_state_dict` is
  the model's own;
- a weight tied across two units moves to the unit that encloses both (torch refuses it);
- in a unit with several parameters, one that a step leaves without gradient gets zeros in
  the shard's gradient, where a torch optimizer would skip it.
As with torch's, every rank must run the same units in the same order, and a module's output
is its only way into backward (a unit's weights are gathered again when backward reaches it).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...validate import boolean, initialized, nn_module, timeout_seconds
from ..transport.agree import agree, broadcast_from_rank0
from ..transport.peers import group_ranks
from .fsdp_unit import OWNER, SLOTS, Unit, shard_name

__all__ = ["fully_shard", "full_state_dict"]

UNIT = "_manualdp_fsdp"  # in a sharded module's __dict__: its Unit


def fully_shard(module: nn.Module, *, group=None, reshard_after_forward: bool = True, timeout: float | None = None,
                recorder=None) -> nn.Module:
    """Shard `module`'s parameters over the ranks of `group` (default: all), in place; returns `module`.

    Apply it to submodules first, then to their parents and the root, as torch's `fully_shard`.
    `reshard_after_forward`: free a unit's full parameters after its forward and gather them again
    for backward (the outermost unit keeps them). `timeout`: seconds to wait for a silent peer.
    `recorder`: a `manualdp.support.trace.Trace` that gets every all-gather and reduce-scatter.
    Every rank must call it alike; it compares the ranks' calls first.
    """
    nn_module("module", module)
    initialized("module", module)
    boolean("reshard_after_forward", reshard_after_forward)
    timeout = timeout_seconds("timeout", timeout)
    if dist.is_initialized() and group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives a non-member
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of it")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    group_ranks(group)  # torch.distributed is initialised, and this process belongs to `group`
    if UNIT in module.__dict__:
        raise ValueError(f"module ({type(module).__name__}) is already sharded by fully_shard: "
                         "apply it once per module")
    taken, slot_order, nested, buffers = _walk(module)
    if len({p.device for p, _, _ in taken.values()}) > 1:
        raise ValueError(f"module ({type(module).__name__}) has parameters on several devices: fully_shard needs one")
    names = sorted({shard_name(p.dtype, p.requires_grad) for p, _, _ in taken.values()})
    clash = [n for n in names if hasattr(module, n)]
    if clash:
        raise ValueError(f"module ({type(module).__name__}) already has an attribute {clash[0]!r}, the name "
                         "fully_shard gives its shard")
    _check_same_call(module, group, reshard_after_forward, taken, nested, buffers)
    # Checked: from here on every rank changes the module the same way.
    unit = Unit(module, group, reshard_after_forward, timeout, recorder)
    for path, child in nested:
        child.parent = unit
        unit.children.append(child)
        for u in child.tree():
            u.name = path + (f".{u.name}" if u.name else "")
    fresh = [p for p, _, _ in taken.values() if getattr(p, OWNER, None) is None]
    # every rank starts from rank 0's parameters and buffers; on the worker, in line with the units' collectives
    unit.worker.submit(broadcast_from_rank0, fresh + buffers, group, timeout).result()
    for sub, attr in slot_order:
        del sub._parameters[attr]
        sub.__dict__.setdefault(SLOTS, {})[attr] = unit
    laid = []
    for p, slots, _ in taken.values():
        owner = getattr(p, OWNER, None)
        if owner is None:
            laid.append((p, slots, p.detach()))
        else:  # a weight tied to a unit inside this one: it moves here, where both of its users are
            more, value = owner.give_up(p)
            laid.append((p, more + slots, value))
    unit.lay_out(laid)
    module.register_forward_pre_hook(unit.before_forward)
    module.register_forward_hook(unit.after_forward, always_call=True)
    module.__dict__[UNIT] = unit
    return module


def _walk(module: nn.Module):
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
        if sub.__dict__.get(SLOTS):
            attr, owner = next(iter(sub.__dict__[SLOTS].items()))
            raise ValueError(f"{path or 'module'} ({type(sub).__name__}) lies inside a module already sharded by "
                             f"fully_shard (its {attr!r} is held by the unit of {type(owner.module).__name__}): "
                             "apply fully_shard bottom-up, submodules first, then their parents")
        for attr, p in sub._parameters.items():
            if p is not None:
                taken.setdefault(id(p), (p, [], f"{path}.{attr}" if path else attr))[1].append((sub, attr))
                slot_order.append((sub, attr))
        buffers.update((id(b), b) for b in sub._buffers.values() if b is not None)
        for name, child in sub._modules.items():
            if child is not None:
                visit(child, f"{path}.{name}" if path else name)

    visit(module, "")
    inside = {id(u) for _, child in nested for u in child.tree()}
    for p, _, name in taken.values():
        owner = getattr(p, OWNER, None)
        if owner is not None and id(owner) not in inside:
            raise ValueError(f"{name} is tied to a parameter that the unit of {type(owner.module).__name__} holds, "
                             "and that unit is not inside this module: apply fully_shard to a module that holds "
                             "both users of the weight (their common ancestor), not to each of them")
    return taken, slot_order, nested, list(buffers.values())


def _check_same_call(module, group, reshard_after_forward, taken, nested, buffers) -> None:
    """Raise on every rank unless every rank shards the same parameters, buffers and units alike."""
    fields = {"reshard_after_forward": reshard_after_forward, "units inside": [path for path, _ in nested],
              "buffers": [f"{tuple(b.shape)} {b.dtype}" for b in buffers]}
    for p, _, name in taken.values():
        fields[f"parameter {name}"] = ("tied" if getattr(p, OWNER, None) else
                                       f"{tuple(p.shape)} {p.dtype}" + ("" if p.requires_grad else " frozen"))
    agree(f"fully_shard({type(module).__name__})", fields, group,
          hint="every rank must build the same model and shard it alike")


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state dict as if it had never been sharded: its own keys, full tensors, on every rank.

    A collective: every rank must call it. Buffers and anything unsharded come from `module.state_dict()`.
    """
    nn_module("module", module)
    subs = list(module.named_modules(remove_duplicate=False))
    units = list(dict.fromkeys(u for _, sub in subs for u in sub.__dict__.get(SLOTS, {}).values()))
    if not units:
        raise ValueError(f"module ({type(module).__name__}) holds nothing sharded by fully_shard: "
                         "use module.state_dict()")
    full = {}
    for u in units:  # the same order on every rank: the collectives pair up
        for value, slots in zip(u.full_values(), u.slots):
            for sub, attr in slots:
                full[id(sub), attr] = value
    by_module: dict[str, list] = {}
    for key, value in module.state_dict().items():
        path, _, name = key.rpartition(".")
        by_module.setdefault(path, []).append((key, name, value))
    out = {}
    for path, sub in subs:  # torch's order: a module's parameters, then its buffers, then its children
        prefix = f"{path}." if path else ""
        for attr in sub.__dict__.get(SLOTS, {}):
            out[prefix + attr] = full[id(sub), attr]
        shards = sub.__dict__[UNIT].shard_names if UNIT in sub.__dict__ else ()
        out.update((key, value) for key, name, value in by_module.get(path, ()) if name not in shards)
    return out
