"""One unit of `fully_shard`: its parameters kept as flat shards, gathered while forward or backward needs them.

`manualdp.spmd.sharding.fsdp` cuts the model into units (one per `fully_shard` call); this page is what
one unit does in a step. It is the book's ZeRO-3 (`manualdp.zero3`) with one process per rank:

1. before the unit's forward, an all-gather fills a full flat buffer per dtype from every rank's
   shard; the module's parameters are views of it. After the forward its memory is freed
   (`reshard_after_forward`; the outermost unit keeps it, backward starts there);
2. when backward reaches the unit's outputs (a hook on them), the buffer is filled again, in
   the same memory: the weights that forward saved for backward read the right values again;
3. once autograd has accumulated the gradient of each trainable parameter of the unit, a
   reduce-scatter of them (one flat buffer per dtype) leaves this rank the sum of its chunk,
   divided by the number of ranks, in the shard's `.grad`; the full buffer is freed (at the end
   of backward in a unit with frozen parameters: backward may still read those);
4. the optimizer steps the shards: they are what `module.parameters()` yields.

"Freed" is `untyped_storage().resize_(0)`: the views (and what autograd saved) keep their shape
and place, and hold no memory. The all-gather writes through `.data`, which leaves alone the
version counter that autograd checks on saved tensors (torch's FSDP2 does the same).

All the collectives of a process group run in order on its worker thread (`group_worker`),
so the all-gather of the next unit (prefetch) runs while this one computes: in forward, the
unit that came next in the last step's forward; in backward, the one before in this forward.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ...collectives import chunk
from ...shards import ShardPlan
from ..collectives import all_gather, reduce_scatter
from ..transport.group import group_worker
from ..transport.peers import group_ranks

__all__ = ["Unit", "shard_name", "OWNER", "SLOTS"]

SHARD_PREFIX = "flat_shard_"  # a unit registers its shards as `flat_shard_float32`, `flat_shard_float32_frozen`
OWNER = "_manualdp_fsdp_unit"  # attribute of an original parameter: the unit that holds it now
SLOTS = "_manualdp_fsdp_slots"  # in a submodule's __dict__: its parameter names, in order -> the unit holding each


def shard_name(dtype: torch.dtype, trainable: bool) -> str:
    """The name a unit registers its shard of one dtype under, e.g. `flat_shard_float32`."""
    return SHARD_PREFIX + str(dtype).removeprefix("torch.") + ("" if trainable else "_frozen")


class Unit:
    """The state of one `fully_shard(module)`: shards, gather buffers, and what the step under way has done.

    Args:
        module: the module sharded; its forward hooks call `before_forward` and `after_forward`.
        group, timeout: the process group of the collectives, and how long to wait for a peer.
        reshard_after_forward: free the full parameters after forward (gather them again for backward).
    """

    def __init__(self, module: nn.Module, group, reshard_after_forward: bool, timeout: float | None,
                 recorder=None) -> None:
        self.module, self.group, self.timeout, self.recorder = module, group, timeout, recorder
        self.rank, peers = group_ranks(group)
        self.world_size = len(peers)
        self.reshard_after_forward = reshard_after_forward
        self.worker = group_worker(group)
        self.name = ""                   # its path from the outermost unit ("" for that one)
        self.parent: Unit | None = None  # the unit whose module holds this one's, once it is sharded
        self.children: list[Unit] = []   # the units directly inside this one
        self.params: list[nn.Parameter] = []  # the original parameters (emptied), trainable first
        self.slots: list[list[tuple[nn.Module, str]]] = []  # where each sat: (submodule, attribute)
        self.plan, self.shards, self.fulls, self.leaves, self.shard_names = None, [], [], [], []
        # this step
        self.gathered = False   # the full buffers hold (or are being filled with) the parameters
        self.gathering = None   # the all-gather's future, until waited for
        self.reducing = None    # the reduce-scatter's future, until the end of backward
        self.ready = 0          # trainable parameters whose gradient autograd has accumulated
        self.reduced = False    # the gradients are sent: this backward is done with the unit
        self.seen = False       # backward has reached the unit's outputs
        self.entered = 0        # forwards of this unit under way
        # the outermost unit's: the forward and backward under way
        self.depth = 0          # forwards of any unit under way
        self.order: list[Unit] = []       # units in the order their forward began, this step
        self.last_order: list[Unit] = []  # the same, last step (forward prefetch follows it)
        self.in_backward = False

    # ---------------------------------------------------------------- layout

    @torch.no_grad()
    def lay_out(self, taken: list[tuple[nn.Parameter, list[tuple[nn.Module, str]], torch.Tensor]]) -> None:
        """Keep this rank's chunk of each (parameter, slots, full value) in `taken`, equal on every rank, as
        flat shards registered on the module; point every slot at a view of the (freed) gather buffers."""
        taken = sorted(taken, key=lambda t: not t[0].requires_grad)  # trainable first: ShardPlan's group 0
        self.params, self.slots = [p for p, _, _ in taken], [s for _, s, _ in taken]
        values = [v for _, _, v in taken]
        for name in self.shard_names:  # an earlier layout's (a tied weight moved out)
            delattr(self.module, name)
        trains = [p.requires_grad for p in self.params]
        self.plan = ShardPlan([[v for v, t in zip(values, trains) if t], [v for v, t in zip(values, trains) if not t]],
                              self.world_size)
        self.shards, self.fulls, self.leaves, self.shard_names = [], [], [None] * len(values), []
        for b, members in enumerate(self.plan.buffers):
            trainable = trains[members[0]]
            flat = torch.cat([values[j].reshape(-1) for j in members])
            name = shard_name(flat.dtype, trainable)
            self.module.register_parameter(name, nn.Parameter(chunk(flat, self.rank, self.world_size).clone(),
                                                              requires_grad=trainable))
            self.shards.append(getattr(self.module, name))
            self.shard_names.append(name)
            full = torch.empty_like(flat)
            for j in members:
                _, start, end = self.plan.where[j]
                leaf = full[start:end].view(values[j].shape).requires_grad_(trainable)
                if trainable:
                    leaf.register_post_accumulate_grad_hook(self._grad_ready)
                self.leaves[j] = leaf
                for sub, attr in self.slots[j]:
                    setattr(sub, attr, leaf)  # a plain attribute: no longer one of the module's parameters
                    sub.__dict__[SLOTS][attr] = self
            full.untyped_storage().resize_(0)
            self.fulls.append(full)
        for p in self.params:  # their values live in the shards now
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            setattr(p, OWNER, self)
        self.num_trainable = sum(trains)

    def give_up(self, p: nn.Parameter) -> tuple[list, torch.Tensor]:
        """Hand `p` (a weight tied outside this unit) to the unit that encloses both: its slots and full value."""
        values = self.full_values()
        j = next(i for i, q in enumerate(self.params) if q is p)
        given = (self.slots[j], values[j].clone())
        self.lay_out([t for i, t in enumerate(zip(self.params, self.slots, values)) if i != j])
        return given

    def full_values(self) -> list[torch.Tensor]:
        """Every parameter's full value (views of new flat buffers), gathered from the shards: a collective."""
        flats = [torch.empty(full.numel(), dtype=full.dtype, device=full.device) for full in self.fulls]
        self.worker.submit(self._all_gather, flats, "state dict").result()
        return [flats[b][start:end].view(leaf.shape) for (b, start, end), leaf in zip(self.plan.where, self.leaves)]

    def tree(self) -> list["Unit"]:
        """This unit and every unit inside it, outermost first."""
        return [self] + [u for child in self.children for u in child.tree()]

    def top(self) -> "Unit":
        unit = self
        while unit.parent is not None:
            unit = unit.parent
        return unit

    # ---------------------------------------------------------------- gather, free, reduce

    def gather(self, why: str, wait: bool = True) -> None:
        """Start filling the full buffers unless they are (being) filled; with `wait`, wait until they are."""
        if not self.fulls:  # a unit without parameters of its own
            return
        if not self.gathered:
            for full in self.fulls:
                full.untyped_storage().resize_(full.numel() * full.element_size())
            self.gathered, self.gathering = True, self.worker.submit(self._all_gather, self.fulls, why)
        if wait and self.gathering is not None:
            future, self.gathering = self.gathering, None
            with self._span(f"wait all_gather {self.name}", "compute", "wait"):
                future.result()

    def _all_gather(self, fulls: list[torch.Tensor], why: str) -> None:  # on the worker thread
        with self._span(f"all_gather {self.name} ({why})", "comm", "comm"):
            for full, own in zip(fulls, self.shards):
                data = full.data  # not `full`: writing here must not bump the counter autograd checks
                chunk(data, self.rank, self.world_size).copy_(own.detach())
                all_gather(data, group=self.group, timeout=self.timeout)

    def free(self) -> None:
        """Give the full buffers' memory back (after the all-gather filling them, if one is running)."""
        if self.gathering is not None:
            future, self.gathering = self.gathering, None
            future.result()
        if self.gathered:
            for full in self.fulls:
                full.untyped_storage().resize_(0)
            self.gathered = False

    @torch.no_grad()
    def reduce_scatter(self) -> None:
        """Start summing the unit's gradients over the ranks (zeros where one is missing); drop the full ones."""
        flats = [(b, torch.cat([(self.leaves[j].grad if self.leaves[j].grad is not None
                                 else torch.zeros_like(self.leaves[j])).reshape(-1) for j in members]))
                 for b, members in enumerate(self.plan.buffers) if self.shards[b].requires_grad]
        for leaf in self.leaves:
            leaf.grad = None
        self.reduced, self.reducing = True, self.worker.submit(self._reduce_scatter, flats)

    def _reduce_scatter(self, flats) -> list[tuple[int, torch.Tensor]]:  # on the worker thread
        with self._span(f"reduce_scatter {self.name}", "comm", "comm"):
            return [(b, reduce_scatter(flat, group=self.group, timeout=self.timeout) / self.world_size)
                    for b, flat in flats]  # the average over ranks, as torch's FSDP2 and DDP give

    @torch.no_grad()
    def take_gradients(self) -> None:
        """Wait for the reduce-scatter; its chunks go to the shards' `.grad` (added, as gradients accumulate)."""
        if self.reducing is not None:
            future, self.reducing = self.reducing, None
            for b, grad in future.result():
                own = self.shards[b]
                own.grad = grad if own.grad is None else own.grad.add_(grad)

    # ---------------------------------------------------------------- hooks

    def before_forward(self, module, args) -> None:
        top = self.top()
        if top.depth == 0 and not (top.in_backward and _inside_backward()):  # a new step, not a recomputation
            top.in_backward = False  # a backward that raised never reached `end_backward`
            top.end_step()           # a forward never followed by backward is dropped
        top.depth, self.entered = top.depth + 1, self.entered + 1
        top.order.append(self)
        self.gather("forward", wait=False)
        k = len(top.order) - 1  # forward prefetch: the unit that came next in the last step
        if k + 1 < len(top.last_order) and top.last_order[k] is self:
            top.last_order[k + 1].gather("prefetch", wait=False)
        self.gather("forward")

    def after_forward(self, module, args, output) -> None:
        if self.entered == 0:  # an earlier hook failed before `before_forward` ran
            return
        top = self.top()
        top.depth, self.entered = top.depth - 1, self.entered - 1
        grad = torch.is_grad_enabled()
        if grad:
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._before_backward)
        if not grad or (self.reshard_after_forward and top.depth > 0):  # the outermost one keeps them for backward
            self.free()
        if top.depth == 0 and not grad:
            top.end_step()

    def _before_backward(self, grad: torch.Tensor) -> None:
        top = self.top()
        top.backward_begins()
        self.gather("backward", wait=False)
        if not self.seen:  # backward prefetch: the unit whose forward began just before this one's
            self.seen = True
            k = max(i for i, u in enumerate(top.order) if u is self) if self in top.order else 0
            if k > 0 and not top.order[k - 1].reduced:
                top.order[k - 1].gather("prefetch", wait=False)
        self.gather("backward")

    def _grad_ready(self, leaf: torch.Tensor) -> None:
        self.top().backward_begins()
        self.ready += 1
        if self.ready == self.num_trainable:
            self.reduce_scatter()
            if self.num_trainable == len(self.params):  # else backward may still read a frozen weight
                self.free()

    def backward_begins(self) -> None:
        """(The outermost unit) queue `end_backward` for the end of this backward pass, once."""
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        """(The outermost unit) the units that still hold gradients send them; every shard gets its `.grad`."""
        units = self.tree()
        try:
            for u in reversed(units):  # the same order on every rank
                if not u.reduced and any(leaf.grad is not None for leaf in u.leaves):
                    u.reduce_scatter()
            for u in units:
                u.take_gradients()
        finally:
            self.in_backward = False
            self.end_step()

    def end_step(self) -> None:
        """(The outermost unit) every unit lets go of its full parameters; the next forward follows this order."""
        for u in self.tree():
            u.free()
            u.ready, u.reduced, u.seen, u.reducing = 0, False, False, None
            for leaf in u.leaves:  # left by a backward that raised
                leaf.grad = None
        if self.order:
            self.last_order, self.order = self.order, []

    def _span(self, name: str, track: str, cat: str):
        if self.recorder is None:
            return contextlib.nullcontext()
        return self.recorder.span(name, track, cat=cat)


def _inside_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (torch has no public way to ask)."""
    return torch._C._current_graph_task_id() != -1


def _tensors(obj):
    """The tensors in a module's output: a tensor, or tuples, lists and dicts of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)
