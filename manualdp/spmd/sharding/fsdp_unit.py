"""One unit of `fully_shard`: per-parameter shards, gathered while forward or backward needs them.

`manualdp.spmd.sharding.fsdp` cuts the model into units (one per `fully_shard` call); this page is what
one unit does in a step. Each parameter lives in two forms, as in torch's FSDP2:

- its *shard*: this rank's rows of it (dim 0, cut as `torch.chunk` cuts: ceil(rows / W) rows per rank,
  the last ranks may get fewer or none), an `nn.Parameter` holding a DTensor placed `Shard(0)` on a 1-D
  mesh of the group. That is what `module.parameters()` yields between steps and what the optimizer
  steps; torch's own utilities (`clip_grad_norm_`, `torch.distributed.checkpoint`, state dicts) see
  a sharded tensor and reduce or gather over the mesh themselves;
- its *full* form: a plain `nn.Parameter` of the whole shape, put in the module's place while
  forward and backward run, its memory given back between uses.

A step, for one unit:
1. before the unit's forward, every rank copies its shards into its segment of one flat buffer
   (padded to ceil(rows / W) rows each, so all segments are equal), an all-gather fills the other
   segments, and each full parameter is copied out of them (copy-in, all-gather, copy-out). The
   full parameters replace the shards in the modules; after the forward the shards come back and
   the full memory is freed (`reshard_after_forward`);
2. when backward reaches the unit's outputs (a hook on them), the full parameters are gathered
   again, into the same memory: what forward saved for backward reads the right values again;
3. once autograd has accumulated every trainable parameter's gradient, their padded rows go into
   one flat buffer in the same layout, and a reduce-scatter leaves this rank the sum over ranks of
   its segment, divided by the number of ranks: the shards' gradients, as DTensors;
4. the optimizer steps the shards.

"Freed" is `untyped_storage().resize_(0)`: the full parameter (and what autograd saved of it) keeps
its shape and place and holds no memory. The copy-out writes through `.data`, which leaves alone the
version counter that autograd checks on saved tensors (torch's FSDP2 does the same).

Every segment carries a short tail: the unit's number, how many all-gathers (or reduce-scatters) it has
run and whether for backward. Ranks that run other units, or one more, see each other's tails and raise, naming the
unit, instead of mixing two units' numbers. A reduce-scatter's tail also counts, per parameter, the
ranks that produced a gradient: a parameter no rank used in this step gets no gradient (the
optimizer skips it, as with torch's FSDP2). (One used on some ranks only makes those ranks send the
unit's gradients earlier than the others: the collectives' call check then raises on every rank.)

All the collectives of a process group run in order on its worker thread (`group_worker`),
so the all-gather of the next unit (prefetch) runs while this one computes: in forward, the
unit that came next in the last step's forward (or the modules named by
`set_modules_to_forward_prefetch`); in backward, the one before in this forward.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..collectives import all_gather, reduce_scatter
from ..transport.group import group_worker
from ..transport.peers import group_ranks, is_refused_alike, refused_alike

__all__ = ["Unit", "Param", "owner_of", "set_owner", "SLOTS", "REPLACED", "UnitMismatch"]

OWNER = "_manualdp_fsdp_owner"  # attribute of a shard, or of an original a shard replaced: its `_Owner`
SLOTS = "_manualdp_fsdp_slots"  # in a submodule's __dict__: its sharded parameter names -> the unit holding each
REPLACED = "_manualdp_fsdp_replaced"  # attribute of an original parameter that fully_shard replaced by a shard
GATHER_TAIL = 2  # each rank's segment of an all-gather ends with (unit number, all-gathers so far)


class _Owner:
    """Points a parameter at its `Param`; pickled or deep-copied, it becomes None: a copy of a shard is a plain
    DTensor parameter (pickling the `Param` would take its unit and module along)."""

    def __init__(self, param: "Param") -> None:
        self.param = param

    def __reduce__(self):
        return _nothing, ()

    def __deepcopy__(self, memo):
        return None


def _nothing() -> None:
    return None


def owner_of(t: torch.Tensor) -> "Param | None":
    """The `Param` that holds `t` (a shard), or that replaced it (an original parameter); None for others."""
    owner = getattr(t, OWNER, None)
    return owner.param if isinstance(owner, _Owner) else None


def set_owner(t: torch.Tensor, param: "Param") -> None:
    setattr(t, OWNER, _Owner(param))


class UnitMismatch(RuntimeError):
    """Ranks ran different units (or a different number of them) in the same collective."""


class Param:
    """One parameter of a unit: where it sits, its shard (a DTensor parameter) and its full form while gathered."""

    def __init__(self, slots: list[tuple[nn.Module, str]], value: torch.Tensor, requires_grad: bool, mesh,
                 rank: int, world_size: int, name: str) -> None:
        self.slots, self.name, self.requires_grad = slots, name, requires_grad
        self.shape, self.dtype, self.device = value.shape, value.dtype, value.device
        self.rows = value.shape[0]
        self.row_numel = math.prod(value.shape[1:])
        self.chunk_rows = -(-self.rows // world_size)  # ceil: torch.chunk's rows per rank (rank 0's, the padded size)
        start = min(rank * self.chunk_rows, self.rows)
        self.local_rows = min(self.chunk_rows, self.rows - start)
        self.padded = self.chunk_rows * self.row_numel  # this parameter's elements in every rank's segment
        with torch.no_grad():
            local = value[start:start + self.local_rows].detach().clone()
            self.sharded = nn.Parameter(_sharded(local, mesh, self.shape), requires_grad=requires_grad)
        set_owner(self.sharded, self)
        self.full: nn.Parameter | None = None  # made at the first gather (after `to_empty` on a meta model)
        self.original: nn.Parameter | None = None  # the parameter the user's model held before
        self.accumulated: torch.Tensor | None = None  # gradients kept with sync off, in the reduce dtype

    def local(self) -> torch.Tensor:
        """This rank's rows (the DTensor's local tensor), detached."""
        return self.sharded.to_local().detach()

    def make_full(self, dtype: torch.dtype, on_grad) -> nn.Parameter:
        """The full-shape parameter the modules use in forward (memory freed), made once per dtype and device;
        `on_grad(full)` runs once autograd has accumulated its gradient."""
        device = self.sharded.device
        if self.full is None or self.full.dtype != dtype or self.full.device != device:
            self.full = nn.Parameter(torch.empty(self.shape, dtype=dtype, device=device),
                                     requires_grad=self.requires_grad)
            self.full.untyped_storage().resize_(0)
            if self.requires_grad:
                self.full.register_post_accumulate_grad_hook(on_grad)
        return self.full


def _sharded(local: torch.Tensor, mesh, shape: torch.Size) -> DTensor:
    """`local` (this rank's rows) as a DTensor of global `shape`, placed `Shard(0)` on `mesh`."""
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


class Unit:
    """The state of one `fully_shard(module)`: its parameters, and what the step under way has done.

    Args:
        module: the module sharded; its forward hooks call `before_forward` and `after_forward`.
        group, mesh: the process group of the collectives and the 1-D mesh of the shards over it.
        reshard_after_forward: free the full parameters after forward (gather them again for backward);
            None: all but the outermost unit do (backward starts there).
        param_dtype, reduce_dtype, output_dtype, cast_forward_inputs: torch's `MixedPrecisionPolicy`.
        timeout: how long to wait for a peer; recorder: a `Trace` for the collectives.
    """

    def __init__(self, module: nn.Module, group, mesh, reshard_after_forward: bool | None, mp_policy,
                 timeout: float | None, recorder=None) -> None:
        self.module, self.group, self.mesh, self.timeout, self.recorder = module, group, mesh, timeout, recorder
        self.rank, peers = group_ranks(group)
        self.world_size = len(peers)
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = mp_policy.param_dtype
        self.reduce_dtype = mp_policy.reduce_dtype
        self.output_dtype = mp_policy.output_dtype
        self.cast_forward_inputs = mp_policy.cast_forward_inputs
        self.worker = group_worker(group)
        self.name = ""                   # its path from the outermost unit ("" for that one)
        self.number = 1                  # its place in the outermost unit's tree, from 1 (in every tail)
        self.parent: Unit | None = None  # the unit whose module holds this one's, once it is sharded
        self.children: list[Unit] = []   # the units directly inside this one
        self.params: list[Param] = []
        # settings the FSDPModule methods change
        self.requires_gradient_sync = True
        self.reshard_after_backward = True
        self.divide_factor: float | None = None  # None: the number of ranks
        self.forward_prefetch: list[Unit] | None = None   # None: the last step's order
        self.backward_prefetch: list[Unit] | None = None  # None: the unit before in this forward
        self.is_last_backward = True
        # this step
        self.gathered = False   # the full parameters hold (or are being filled with) the values
        self.gathering = None   # the all-gather's future, until waited for
        self.reducing = None    # the reduce-scatter's future, until the end of backward
        self.gathers = 0        # all-gathers run so far (in every tail: ranks that ran one more disagree)
        self.reduces = 0        # reduce-scatters run so far
        self.accumulating = False  # the full parameters' .grad hold gradients kept with gradient sync off
        self.ready = 0          # trainable parameters whose gradient autograd has accumulated
        self.reduced = False    # the gradients are sent: this backward is done with the unit
        self.seen = False       # backward has reached the unit's outputs
        self.entered = 0        # forwards of this unit under way
        # the outermost unit's: the forward and backward under way
        self.depth = 0          # forwards of any unit under way
        self.order: list[Unit] = []       # units in the order their forward began, this step
        self.last_order: list[Unit] = []  # the same, last step (forward prefetch follows it)
        self.in_backward = False
        self.failure: Exception | None = None  # a collective of the tree that raised: the later ones raise it too

    # ---------------------------------------------------------------- layout

    def lay_out(self, taken: list[tuple[list[tuple[nn.Module, str]], torch.Tensor, bool, str]]) -> list[Param]:
        """Shard each (slots, full value, trainable, name) in `taken`: a `Param` whose shard takes its slots."""
        made = []
        for slots, value, trainable, name in taken:
            p = Param(slots, value, trainable, self.mesh, self.rank, self.world_size, name)
            self.params.append(p)
            made.append(p)
            for sub, attr in slots:
                sub._parameters[attr] = p.sharded
                sub.__dict__.setdefault(SLOTS, {})[attr] = self
        self._group()
        return made

    def _group(self) -> None:
        """One all-gather per dtype (trainable and frozen together); one reduce-scatter per dtype of the trainable."""
        self.gather_groups: dict[torch.dtype, list[Param]] = {}
        self.reduce_groups: dict[torch.dtype, list[Param]] = {}
        for p in self.params:
            self.gather_groups.setdefault(self.param_dtype or p.dtype, []).append(p)
            if p.requires_grad:
                self.reduce_groups.setdefault(self.reduce_dtype or self.param_dtype or p.dtype, []).append(p)
        self.num_trainable = sum(p.requires_grad for p in self.params)

    def give_up(self, p: Param) -> tuple[list, torch.Tensor]:
        """Hand `p` (a weight tied outside this unit) to the unit that encloses both: its slots and full value."""
        value = p.sharded.full_tensor().detach()
        self.params.remove(p)
        self._group()
        for sub, attr in p.slots:
            del sub.__dict__[SLOTS][attr]
        return p.slots, value

    def adopt(self) -> None:
        """Take as shards whatever the modules hold now (`to_empty`, `_apply` may have put new parameters there)."""
        for p in self.params:
            sub, attr = p.slots[0]
            now = sub._parameters.get(attr)
            if now is p.full:
                continue
            if now is not p.sharded:
                if not isinstance(now, DTensor) or now.shape != p.shape:
                    raise TypeError(f"{p.name}: fully_shard expected its shard (a DTensor of shape {tuple(p.shape)}) "
                                    f"in the module, found {type(now).__name__}: replace a sharded parameter with "
                                    "one of the same kind (to_empty, load_state_dict) or shard the module after")
                if not isinstance(now, nn.Parameter):
                    now = nn.Parameter(now, requires_grad=p.requires_grad)
                p.sharded = now
                set_owner(now, p)
                for s, a in p.slots:
                    s._parameters[a] = now
            p.dtype, p.device = p.sharded.dtype, p.sharded.device  # `model.double()` changes them in place
        self._group()

    def tree(self) -> list["Unit"]:
        """This unit and every unit inside it, outermost first."""
        return [self] + [u for child in self.children for u in child.tree()]

    def top(self) -> "Unit":
        unit = self
        while unit.parent is not None:
            unit = unit.parent
        return unit

    def use(self, full: bool) -> None:
        """Put the full parameters (`full`) or the shards in the modules' places."""
        for p in self.params:
            t = p.full if full else p.sharded
            for sub, attr in p.slots:
                sub._parameters[attr] = t

    # ---------------------------------------------------------------- gather, free, reduce

    def gather(self, why: str, wait: bool = True) -> None:
        """Start filling the full parameters unless they are (being) filled; with `wait`, wait until they are."""
        if not self.params:  # a unit without parameters of its own
            return
        if not self.gathered:
            meta = [p.name for p in self.params if p.sharded.device.type == "meta"]
            if meta:
                raise RuntimeError(f"{meta[0]} is on the meta device: after fully_shard, call "
                                   "model.to_empty(device=...) and initialise the parameters before the first forward")
            jobs = []
            for dtype, members in self.gather_groups.items():
                fulls = [p.make_full(dtype, self._grad_ready) for p in members]
                for full in fulls:
                    full.untyped_storage().resize_(full.numel() * full.element_size())
                jobs.append((dtype, members, [p.local() for p in members], fulls))
            self.gathers += 1
            self.gathered = True
            # the tail's count: all-gathers so far (mod 64), and whether this one is for backward
            count = (self.gathers % 64) * 2 + (_inside_backward() or self.top().in_backward)
            self.gathering = self.worker.submit(self._in_line, self._all_gather, jobs, count, why)
        if wait:
            if self.gathering is not None:
                future, self.gathering = self.gathering, None
                with self._span(f"wait all_gather {self.name}", "compute", "wait"):
                    future.result()
            self.use(full=True)

    def _in_line(self, job, *args):  # on the worker thread
        """Run `job` unless a collective of this tree failed before: the ranks are out of step since, and the job
        would wait for peers in vain; it raises that failure instead, at once (and records its own)."""
        top = self.top()
        if top.failure is not None:
            raise top.failure
        try:
            return job(*args)
        except ValueError as e:  # the collectives' call check: the ranks called differently
            top.failure = UnitMismatch(
                f"rank {self.rank}: fully_shard's {'all-gather' if job == self._all_gather else 'reduce-scatter'} "
                f"of unit {self.number} ({type(self.module).__name__}{' ' + self.name if self.name else ''}) met "
                "another collective on other ranks: every rank must run the same units, and use the same "
                f"parameters in each, in the same order ({e})")
            if is_refused_alike(e):  # nothing in flight: the group's worker serves the next model's calls
                refused_alike(top.failure)
            raise top.failure from e
        except Exception as e:
            top.failure = e
            raise

    @torch.no_grad()
    def _all_gather(self, jobs, count: int, why: str) -> None:  # on the worker thread
        W = self.world_size
        with self._span(f"all_gather {self.name} ({why})", "comm", "comm"):
            for dtype, members, locals_, fulls in jobs:
                S = sum(p.padded for p in members) + GATHER_TAIL
                flat = torch.zeros(W * S, dtype=dtype, device=fulls[0].device)
                own = flat.view(W, S)[_segment(self.rank, W)]
                at = 0
                for p, local in zip(members, locals_):  # copy-in: this rank's rows, padded
                    own[at:at + local.numel()].copy_(local.reshape(-1))
                    at += p.padded
                own[S - 2], own[S - 1] = self.number, count
                all_gather(flat, group=self.group, timeout=self.timeout)
                segments = flat.view(W, S)
                tails = segments[:, S - 2:].tolist()
                self._check_tails([tails[_segment(r, W)] for r in range(W)], "all-gather", count)
                at = 0
                for p, full in zip(members, fulls):  # copy-out, through .data: no version bump
                    _copy_out(segments[:, at:at + p.padded], full.data, p)
                    at += p.padded

    def _check_tails(self, tails: list[list[float]], what: str, count: int) -> None:
        mine = [float(self.number), float(count)]
        if any(t != mine for t in tails):
            per_rank = "; ".join(f"rank {r}: unit {int(t[0])}, {what} {int(t[1]) // 2}"
                                 + (" (backward)" if int(t[1]) % 2 else "") for r, t in enumerate(tails))
            # every rank saw every tail, and the collective is complete: all raise alike, nothing in flight
            raise refused_alike(UnitMismatch(
                f"rank {self.rank}: fully_shard's {what} of unit {self.number} "
                f"({type(self.module).__name__}{' ' + self.name if self.name else ''}) met other units "
                f"or counts on other ranks ({per_rank} mod 64): every rank must run the same units in "
                "the same order, the same number of times"))

    def free(self) -> None:
        """Give the full parameters' memory back (after the all-gather filling them, if one is running)."""
        if self.gathering is not None:
            future, self.gathering = self.gathering, None
            try:
                future.result()
            finally:
                self._drop()
        elif self.gathered:
            self._drop()

    def _drop(self) -> None:
        self.use(full=False)
        for p in self.params:
            if p.full is not None:
                p.full.untyped_storage().resize_(0)
        self.gathered = False

    @torch.no_grad()
    def reduce_scatter(self) -> None:
        """Start summing the unit's gradients over the ranks (zeros where one is missing); drop the full ones."""
        jobs = []
        for dtype, members in self.reduce_groups.items():
            grads = []
            for p in members:
                grad = p.full.grad if p.full is not None else None
                if p.accumulated is not None:
                    grad = p.accumulated if grad is None else p.accumulated + grad
                    p.accumulated = None
                grads.append(grad)
            jobs.append((dtype, members, grads))
        for p in self.params:
            if p.full is not None:
                p.full.grad = None
        self.accumulating = False
        self.reduces += 1
        self.reduced, self.reducing = True, self.worker.submit(self._in_line, self._reduce_scatter, jobs,
                                                               (self.reduces % 64) * 2)

    @torch.no_grad()
    def _reduce_scatter(self, jobs, count: int) -> list:  # on the worker thread
        W, out = self.world_size, []
        with self._span(f"reduce_scatter {self.name}", "comm", "comm"):
            for dtype, members, grads in jobs:
                data = sum(p.padded for p in members)
                S = data + 2 * W + len(members)  # the tails: (unit, count) per rank, then a flag per parameter
                device = next((g.device for g in grads if g is not None), members[0].sharded.device)
                flat = torch.zeros(W * S, dtype=dtype, device=device)
                segments = flat.view(W, S)
                at = 0
                for p, grad in zip(members, grads):  # copy-in: each rank's rows into its segment, padded
                    if grad is not None:
                        _copy_in(segments[:, at:at + p.padded], grad, p)
                    at += p.padded
                segments[:, data + 2 * self.rank] = self.number
                segments[:, data + 2 * self.rank + 1] = count
                segments[:, data + 2 * W:] = torch.tensor([float(g is not None) for g in grads], dtype=dtype)
                mine = reduce_scatter(flat, group=self.group, timeout=self.timeout)
                self._check_tails(mine[data:data + 2 * W].view(W, 2).tolist(), "reduce-scatter", count)
                used = mine[data + 2 * W:].tolist()
                factor = self.divide_factor if self.divide_factor is not None else W
                at = 0
                for p, users in zip(members, used):
                    if users > 0:  # no rank produced a gradient: none, as torch's FSDP2 leaves it
                        grad = mine[at:at + p.local_rows * p.row_numel].view(p.local_rows, *p.shape[1:])
                        out.append((p, (grad / factor).to(p.dtype)))
                    at += p.padded
        return out

    @torch.no_grad()
    def keep_gradients(self) -> None:
        """Gradient sync is off: keep this backward's gradients for the one that syncs. In a lower-precision
        `param_dtype` they are added up in the reduce dtype (as torch's FSDP2 does), not in the parameters' own."""
        self.accumulating = True
        for dtype, members in self.reduce_groups.items():
            for p in members:
                if p.full is not None and p.full.grad is not None and p.full.grad.dtype != dtype:
                    grad, p.full.grad = p.full.grad, None
                    p.accumulated = grad.to(dtype) if p.accumulated is None else p.accumulated.add_(grad)

    @torch.no_grad()
    def take_gradients(self) -> None:
        """Wait for the reduce-scatter; its rows go to the shards' `.grad` (added, as gradients accumulate)."""
        if self.reducing is not None:
            future, self.reducing = self.reducing, None
            for p, grad in future.result():
                own = p.sharded
                if own.grad is None:
                    own.grad = _sharded(grad, self.mesh, p.shape)
                else:
                    own.grad.to_local().add_(grad)

    # ---------------------------------------------------------------- hooks

    def before_forward(self, module, args, kwargs):
        top = self.top()
        if top.depth == 0 and not (top.in_backward and _inside_backward()):  # a new step, not a recomputation
            top.in_backward = False  # a backward that raised never reached `end_backward`
            top.end_step()           # a forward never followed by backward is dropped
        top.depth, self.entered = top.depth + 1, self.entered + 1
        top.order.append(self)
        self.gather("forward", wait=False)
        if self.forward_prefetch is not None:
            for unit in self.forward_prefetch:
                unit.gather("prefetch", wait=False)
        else:  # the unit that came next in the last step
            k = len(top.order) - 1
            if k + 1 < len(top.last_order) and top.last_order[k] is self:
                top.last_order[k + 1].gather("prefetch", wait=False)
        self.gather("forward")
        if self.cast_forward_inputs and self.param_dtype is not None:
            return _cast(args, self.param_dtype), _cast(kwargs, self.param_dtype)
        return None

    def after_forward(self, module, args, output):
        if self.entered == 0:  # an earlier hook failed before `before_forward` ran
            return None
        top = self.top()
        top.depth, self.entered = top.depth - 1, self.entered - 1
        grad = torch.is_grad_enabled()
        if grad:
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._before_backward)
        reshard = self.reshard_after_forward if self.reshard_after_forward is not None else top.depth > 0
        if not grad or reshard:
            self.free()
        if top.depth == 0 and not grad:
            top.end_step()
        return _cast(output, self.output_dtype) if self.output_dtype is not None else None

    def _before_backward(self, grad: torch.Tensor) -> None:
        top = self.top()
        top.backward_begins()
        self.gather("backward", wait=False)
        if not self.seen:
            self.seen = True
            if self.backward_prefetch is not None:
                for unit in self.backward_prefetch:
                    unit.gather("prefetch", wait=False)
            else:  # the unit whose forward began just before this one's
                k = max(i for i, u in enumerate(top.order) if u is self) if self in top.order else 0
                if k > 0 and not top.order[k - 1].reduced:
                    top.order[k - 1].gather("prefetch", wait=False)
        self.gather("backward")

    def _grad_ready(self, full: torch.Tensor) -> None:
        self.top().backward_begins()
        self.ready += 1
        if self.ready == self.num_trainable and self.requires_gradient_sync:
            self.reduce_scatter()
            if self.num_trainable == len(self.params) and self.reshard_after_backward:
                self.free()  # else backward may still read a frozen weight

    def backward_begins(self) -> None:
        """(The outermost unit) queue `end_backward` for the end of this backward pass, once."""
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        """(The outermost unit) the units that have not sent their gradients send them; every shard gets its `.grad`.

        Every unit of the tree sends once per backward (zeros where it has none) unless its gradient
        sync is off: the ranks' collectives pair up even where a step ran a unit on one rank only.
        """
        units = self.tree()
        try:
            for u in reversed(units):  # the same order on every rank
                if not u.reduced and u.requires_gradient_sync and u.reduce_groups:
                    u.reduce_scatter()
                elif not u.requires_gradient_sync:
                    u.keep_gradients()
            for u in units:
                u.take_gradients()
        except BaseException:
            self.in_backward = False
            self.abandon()  # raise what went wrong first, not what the collectives queued behind it run into
            raise
        self.in_backward = False
        self.end_step(after_backward=True)

    def abandon(self) -> None:
        """(The outermost unit) forget a step that raised, without waiting for the collectives queued behind the
        failed one: after a refused call the ranks are out of step, and those would wait for a peer in vain.
        A unit whose all-gather is still queued keeps its full memory until that all-gather ends (the next
        forward waits for it: it writes there)."""
        for u in self.tree():
            if u.gathering is None:
                u.free()
            u.ready, u.reduced, u.seen, u.reducing, u.accumulating = 0, False, False, None, False
            for p in u.params:
                if p.full is not None:
                    p.full.grad = None
                p.accumulated = None
        if self.order:
            self.last_order, self.order = self.order, []

    def end_step(self, after_backward: bool = False) -> None:
        """(The outermost unit) every unit lets go of its full parameters; the next forward follows this order."""
        for u in self.tree():
            if u.reshard_after_backward or not after_backward:
                u.free()
            u.ready, u.reduced, u.seen, u.reducing = 0, False, False, None
            if not u.accumulating:
                for p in u.params:  # left by a backward that raised
                    if p.full is not None:
                        p.full.grad = None
                    p.accumulated = None
        if self.order:
            self.last_order, self.order = self.order, []

    def _span(self, name: str, track: str, cat: str):
        if self.recorder is None:
            return contextlib.nullcontext()
        return self.recorder.span(name, track, cat=cat)


def _segment(rank: int, world_size: int) -> int:
    """Which segment of a flat buffer is `rank`'s own: the chunk the ring schedules leave it (`owned_chunk`)."""
    return (rank + 1) % world_size


def _by_rank(segments: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """`segments` (W, padded) as blocks of consecutive ranks: (first rank, its rows). Rank r's is segment r + 1."""
    W = segments.shape[0]
    return [(0, segments[1:]), (W - 1, segments[:1])] if W > 1 else [(0, segments)]


def _row_blocks(p: Param, segments: torch.Tensor):
    """Pairs (rows of the full parameter, the matching part of `segments`) that cover the parameter once."""
    if p.chunk_rows == 0 or p.row_numel == 0:
        return
    for first, block in _by_rank(segments):
        start = first * p.chunk_rows
        whole = max(0, min(block.shape[0], (p.rows - start) // p.chunk_rows))  # ranks with all rows real
        if whole:
            yield (start, start + whole * p.chunk_rows), block[:whole]
        rest = p.rows - start - whole * p.chunk_rows
        if whole < block.shape[0] and rest > 0:
            yield (start + whole * p.chunk_rows, p.rows), block[whole, :rest * p.row_numel]


def _copy_out(segments: torch.Tensor, full: torch.Tensor, p: Param) -> None:
    """Each rank's rows from its segment of `segments` (W, padded) into `full`, in rank order."""
    dest = full.view(p.rows, p.row_numel) if p.row_numel else None
    for (lo, hi), part in _row_blocks(p, segments):
        dest[lo:hi].view(part.shape).copy_(part)


def _copy_in(segments: torch.Tensor, grad: torch.Tensor, p: Param) -> None:
    """`grad`'s rows into each rank's segment of `segments` (W, padded): the inverse of `_copy_out`."""
    src = grad.reshape(p.rows, p.row_numel) if p.row_numel else None
    for (lo, hi), part in _row_blocks(p, segments):
        part.copy_(src[lo:hi].reshape(part.shape))


def _inside_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (torch has no public way to ask)."""
    return torch._C._current_graph_task_id() != -1


def _cast(obj, dtype: torch.dtype):
    """`obj` (tensors, or tuples, lists and dicts of them) with floating-point tensors cast to `dtype`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_cast(x, dtype) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(x, dtype) for x in obj)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj


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
