"""ZeRO-3's units: which submodules are sharded as one piece, and how every device gathers them.

A unit's parameters live on the devices as shards (`manualdp.zero3`). A device needs them
whole twice in a step, and only then:

- in the unit's forward: a forward pre-hook all-gathers them and points the parameters at
  the full buffer; a forward hook points them back at a placeholder, and the buffer is freed;
- in backward, for the ops that saved a weight (a matrix product saves it to compute the
  gradient of its input). While the forward runs, saved-tensor hooks keep, in place of such
  a weight, only where it lies in its unit; the first op of backward that asks for one
  all-gathers the unit again, and the device lets go of it once backward has read the last.

Every all-gather is a meeting of the devices' threads (`manualdp.lockstep`): the last one to
arrive runs the collective for all of them.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn

from .collectives import all_gather, chunk
from .lockstep import LockStep
from .memory import storage_bytes
from .shards import ShardPlan

__all__ = ["Collective", "Units", "choose_units"]
NO_FORWARD = (nn.ParameterList, nn.ParameterDict)


def choose_units(module: nn.Module, units=None) -> list[tuple[str, list[nn.Parameter]]]:
    """Every unit as (name, parameters): the submodules named in `units` (default: the root's children that
    have parameters), then the root unit "": the root's own parameters and those that two units share."""
    if units is None:  # a ModuleList or ModuleDict never runs a forward: its children are units in its place, as
        units, todo = [], list(module.named_children())  # torch's FSDP2 refuses a container and wraps its children
        while todo:
            name, child = todo.pop(0)
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                todo[:0] = [(f"{name}.{n}", c) for n, c in child.named_children()]
            elif next(child.parameters(), None) is not None and not isinstance(child, NO_FORWARD):
                units.append(name)  # (a ParameterList has no forward either: it stays in the root unit)
    if not isinstance(units, (list, tuple)) or not all(isinstance(u, str) and u for u in units):
        raise TypeError(f"units must be a list of submodule names such as ['0', 'layer1'], got {units!r:.80}")
    owners: dict[int, list[str]] = {}
    for k, name in enumerate(units):
        if any(f"{name}.".startswith(f"{other}.") or f"{other}.".startswith(f"{name}.") for other in units[:k]):
            raise ValueError(f"units: {name!r} is named twice, or lies inside another unit or holds one")
        try:
            params = list(module.get_submodule(name).parameters())
        except AttributeError:
            raise ValueError(f"units: {type(module).__name__} has no submodule {name!r}") from None
        if not params:
            raise ValueError(f"units: {name!r} has no parameters to shard")
        for p in params:
            owners.setdefault(id(p), []).append(name)
    chosen = [(name, [p for p in module.get_submodule(name).parameters() if owners[id(p)] == [name]]) for name in units]
    root = [p for p in module.parameters() if len(owners.get(id(p), ())) != 1]
    return [(name, ps) for name, ps in chosen + [("", root)] if ps]


class Collective(NamedTuple):
    kind: str                   # "all_gather" or "reduce_scatter"
    phase: str                  # "forward", "backward" or "step"
    unit: str                   # the unit's name; "" is the root unit
    numel: int                  # elements of the unit's flat buffer (a unit has one buffer per dtype)
    element_size: int           # bytes per element
    held: tuple[int, ...] = ()  # parameter bytes each device holds right after it (`Units.param_bytes`)


class Units:
    """Every device's units, gathered when its forward or backward needs them and let go of after.

    Args:
        replicas: one model per device; the units' forward hooks are registered on them.
        names, plans: each unit's name and layout (`manualdp.shards.ShardPlan`).
        params: `params[i][u]`, device i's parameters of unit u, in the plan's order.
        shards: `shards[i][u][b]`, device i's chunk of unit u's buffer b.
    """

    def __init__(self, replicas: list[nn.Module], names: list[str], plans: list[ShardPlan], params: list,
                 shards: list, algorithm: str) -> None:
        self.replicas, self.names, self.plans, self.params, self.shards = replicas, names, plans, params, shards
        self.algorithm, n = algorithm, len(replicas)
        self.held = [{} for _ in range(n)]     # device i's gathered units: unit -> its full flat buffers
        self.where = [{} for _ in range(n)]    # device i: address of a gathered buffer -> (unit, buffer)
        self.pending = [{} for _ in range(n)]  # device i: unit -> saved weights that backward has still to read
        self.nan = [{} for _ in range(n)]      # device i's one-element placeholders, by dtype
        self.collectives: list[Collective] = []  # what the last step ran
        self.lockstep: LockStep | None = None    # set while a step runs
        for i, r in enumerate(replicas):
            for u, name in enumerate(names):
                r.get_submodule(name).register_forward_pre_hook(functools.partial(self._before_forward, i, u))
                r.get_submodule(name).register_forward_hook(functools.partial(self._after_forward, i, u))
        self.reset()

    def run(self, work) -> list:
        """`work(device)` on every device side by side (`manualdp.lockstep`); afterwards every unit is let go of."""
        self.collectives, self.lockstep = [], LockStep(len(self.replicas))
        try:
            results = self.lockstep.run(work)
        finally:
            self.lockstep = None
            self.reset()
        gathered = {c.unit for c in self.collectives if c.phase == "forward"}  # a unit not gathered lent NaN
        lost = [name for u, name in enumerate(self.names) if name not in gathered
                and any(p.grad is not None for ps in self.params for p in ps[u])]
        if lost:
            raise RuntimeError(f"unit {lost[0]!r} has gradients, but its forward never ran, so they come from its NaN "
                               "placeholders: a unit must be a module that is called, not a container")
        return results

    def saved_tensors_hooks(self, i: int):
        """The context in which device i runs its forward: saved weights are kept as where they lie."""
        return torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, i),
                                                        functools.partial(self._unpack, i))

    def reset(self) -> None:
        """Let go of every gathered unit; every parameter points at its placeholder."""
        for i in range(len(self.replicas)):
            for u in range(len(self.plans)):
                self._put_away(i, u)
            self.held[i].clear()
            self.where[i].clear()
            self.pending[i].clear()

    def _before_forward(self, i: int, u: int, module, args) -> None:
        if self.lockstep is None:
            raise RuntimeError(f"replicas[{i}] holds only its shards between steps: train with Zero3.train_batch, "
                               "and evaluate a model loaded with Zero3.full_parameters()")
        self.lockstep.meet(i, ("all_gather", "forward", u), functools.partial(self._all_gather, u, "forward"))
        for p, (b, start, end) in zip(self.params[i][u], self.plans[u].where):
            p.data = self.held[i][u][b][start:end].view_as(p)

    def _after_forward(self, i: int, u: int, module, args, output) -> None:
        self._put_away(i, u)
        self._let_go(i, u)

    def _pack(self, i: int, t: torch.Tensor):
        key = self.where[i].get(t.untyped_storage().data_ptr()) if t.numel() else None
        if key is None or t.dtype != self.held[i][key[0]][key[1]].dtype:
            return t  # an activation, or a tensor of its own: saved as it is
        self.pending[i][key[0]] = self.pending[i].get(key[0], 0) + 1
        return key, t.size(), t.stride(), t.storage_offset()

    def _unpack(self, i: int, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        (u, b), size, stride, offset = packed
        if u not in self.held[i]:
            self.lockstep.meet(i, ("all_gather", "backward", u), functools.partial(self._all_gather, u, "backward"))
        view = self.held[i][u][b].as_strided(size, stride, offset)
        self.pending[i][u] -= 1
        if self.pending[i][u] == 0:
            self._let_go(i, u)  # the op reading `view` keeps the buffer alive until it is done
        return view

    def _all_gather(self, u: int, phase: str) -> None:
        """Every device's full buffers of unit `u` (run once, for all devices, by the last to arrive)."""
        for b, size in enumerate(self.plans[u].sizes):
            full = [torch.empty(size, dtype=s[u][b].dtype, device=s[u][b].device) for s in self.shards]
            for i, f in enumerate(full):
                chunk(f, i, len(full)).copy_(self.shards[i][u][b])
            all_gather(full, self.algorithm)
            for i, f in enumerate(full):
                self.held[i].setdefault(u, []).append(f)
                if size:
                    self.where[i][f.untyped_storage().data_ptr()] = (u, b)
            self.log("all_gather", phase, u, full[0])

    def _let_go(self, i: int, u: int) -> None:
        for f in self.held[i].pop(u, ()):
            self.where[i].pop(f.untyped_storage().data_ptr(), None)

    def _put_away(self, i: int, u: int) -> None:
        """Point unit u's parameters on device i at a one-element NaN: no memory, and no stale values to read."""
        for p in self.params[i][u]:
            if p.dtype not in self.nan[i]:
                self.nan[i][p.dtype] = torch.full((), float("nan") if p.is_floating_point() else 0, dtype=p.dtype,
                                                  device=p.device)
            p.data = self.nan[i][p.dtype].expand(p.shape)

    def log(self, kind: str, phase: str, u: int, buffer: torch.Tensor) -> None:
        """Record a collective on unit u's `buffer`, with what every device holds right after it."""
        self.collectives.append(Collective(kind, phase, self.names[u], buffer.numel(), buffer.element_size(),
                                           tuple(self.param_bytes())))

    def param_bytes(self) -> list[int]:
        """Parameter bytes each device holds, counted from its tensors: shards, gathered units, placeholders."""
        out = []
        for i, r in enumerate(self.replicas):
            tensors = [*r.parameters(), *(s for unit in self.shards[i] for s in unit),
                       *(f for fs in self.held[i].values() for f in fs)]
            out.append(storage_bytes(tensors))
        return out

