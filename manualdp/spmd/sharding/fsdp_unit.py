"""One unit of `fully_shard`: its parameters gathered while forward or backward needs them, freed after.

`fully_shard` (`fsdp.py`) cuts the model into units, one per call; this page is what one unit does in
a step, as torch's FSDP2's `FSDPParamGroup`. Each of its parameters is a shard between uses and a full
parameter while gathered (`fsdp_param.py`). A step, for one unit:
1. before the unit's forward, every rank copies its shards into its segment of one flat buffer
   (padded to ceil(rows / W) rows each, so all segments are equal), an all-gather fills the other
   segments, and each full parameter is copied out of them (copy-in, all-gather, copy-out:
   `fsdp_collectives.py`). The full parameters replace the shards in the modules; after the forward
   the shards come back and the full memory is freed (`reshard_after_forward`). A parameter whose shard defines
   torch's all-gather extensions is gathered by its hooks instead, as torch's (`fsdp_ext.py`);
2. when backward reaches the unit's outputs (a hook on them, `fsdp_hooks.py`), the full parameters
   are gathered again, into the same memory: what forward saved for backward reads the right values;
3. once autograd has accumulated every trainable parameter's gradient, their padded rows go into
   one flat buffer in the same layout, and a reduce-scatter leaves this rank the sum over ranks of
   its segment, divided by the number of ranks: the shards' gradients, as DTensors;
4. the optimizer steps the shards.

The hooks that call a unit's gather and free around forward and backward, and prefetch the next
unit's all-gather while this one computes, are in `fsdp_hooks.py`. What spans the units of a tree
(the order of their forwards, the end of backward, the first failure) is the outermost unit's `Step`
(`fsdp_step.py`).
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from ..transport.group import group_worker
from ..transport.peers import group_ranks
from .fsdp_collectives import all_gather_params, in_line, reduce_scatter_grads, segment
from .fsdp_ext import extension_code, finish_extensions, free_extensions, gather_inputs, start_extensions
from .fsdp_param import Param
from .fsdp_step import Step, inside_backward

__all__ = ["Unit", "UNIT"]

UNIT = "_manualdp_fsdp"  # in a sharded module's __dict__: its Unit


class Unit:
    """The state of one `fully_shard(module)`: its parameters, and what the step under way has done with them.

    Args:
        modules: the modules sharded (one, or a list's: torch's `fully_shard([norm, output])`); their forward hooks
            (`fsdp_hooks.py`) gather the unit before the first of them and free it after the last.
        group, mesh: the process group of the shards' collectives and the mesh of the shards (1-D, or HSDP's 2-D
            (replicate, shard) mesh, whose dim 1 is `group`).
        replicate: HSDP's group of this rank's replicas (mesh dim 0), across which gradients are all-reduced.
        reshard_after_forward: free the full parameters after forward (gather them again for backward);
            None: all but the outermost unit do (backward starts there).
        mp_policy: torch's `MixedPrecisionPolicy` (param_dtype, reduce_dtype, output_dtype, cast_forward_inputs).
        timeout: how long to wait for a peer; recorder: a `Trace` for the collectives.
    """

    def __init__(self, modules: list[nn.Module], group, mesh, reshard_after_forward: bool | None, mp_policy,
                 timeout: float | None, recorder=None, replicate=None) -> None:
        self.modules, self.group, self.mesh, self.timeout, self.recorder = modules, group, mesh, timeout, recorder
        self.replicate = replicate
        self.replicas = len(group_ranks(replicate)[1]) if replicate is not None else 1
        self.module = modules[0]  # the one that names the unit in messages
        self.rank, peers = group_ranks(group)
        self.world_size = len(peers)
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy, self.param_dtype = mp_policy, mp_policy.param_dtype
        self.reduce_dtype = mp_policy.reduce_dtype
        self.output_dtype = mp_policy.output_dtype
        self.cast_forward_inputs = mp_policy.cast_forward_inputs
        self.worker = group_worker(group)
        self.name = ""                   # its path from the outermost unit ("" for that one)
        self.number = 1                  # its place in the outermost unit's tree, from 1 (in every tail)
        self.children: list[Unit] = []   # the units directly inside this one
        self.step = Step(self)           # the outermost unit's, shared by its whole tree (`take_in`)
        self.params: list[Param] = []
        # settings the FSDPModule methods change
        self.requires_gradient_sync = True
        self.reshard_after_backward = True
        self.divide_factor: float | None = None  # None: the number of ranks (shards x replicas)
        self.requires_all_reduce = True  # HSDP: all-reduce across replicas (False: keep the sums in `partial`)
        self.partial: dict[torch.dtype, torch.Tensor] = {}  # HSDP: reduce-scatter sums kept while not all-reducing
        self.forward_prefetch: list[Unit] | None = None   # None: the last step's order
        self.backward_prefetch: list[Unit] | None = None  # None: the unit before in this forward
        self.is_last_backward = True
        self.extension: str | None = None  # a parameter holding torch's all-gather extensions (`check_params`)
        self.extension_code = 0  # which parameters hold them, in every all-gather's tail (`fsdp_ext.extension_code`)
        self.extension_error: Exception | None = None  # what a pre-hook raised at this gather (`fsdp_ext.RAISED`)
        self.extended: dict = {}  # Param -> its `fsdp_ext.Extended`: what a parameter with the pair keeps
        self.unshard_in_backward = True  # False: backward reads none of the parameters (an embedding's)
        # this step
        self.gathered = False   # the full parameters hold (or are being filled with) the values
        self.gathering = None   # the all-gather's future, until waited for
        self.reducing = None    # the reduce-scatter's future, until the end of backward
        self.gathers = 0        # all-gathers run so far (in every tail: ranks that ran one more disagree)
        self.reduces = 0        # reduce-scatters run so far
        self.all_reduces = 0    # HSDP: all-reduces across the replicas so far (replicas pair by it: their
        #                         reduce-scatters differ where they accumulate uneven numbers of micro-batches)
        self.accumulating = False  # the full parameters' .grad hold gradients kept with gradient sync off
        self.ready = 0          # trainable parameters whose gradient autograd has accumulated
        self.reduced = False    # the gradients are sent: this backward is done with the unit
        self.seen = False       # backward has reached the unit's outputs
        self.entered = 0        # forwards of this unit under way
        self.to_run: set[int] = set()  # a unit of several modules: those whose forward has not ended yet

    # ---------------------------------------------------------------- the tree and the layout

    def take_in(self, nested: list[tuple[str, "Unit"]]) -> None:
        """Make the units `nested` ((path, unit): the first met inside this one) its children, on its step."""
        for _, child in nested:
            self.children.append(child)
            self.step.tied_apart = self.step.tied_apart or child.step.tied_apart
            for u in child.tree():
                u.step = self.step

    def name_tree(self, nested: list[tuple[str, "Unit"]]) -> None:
        """Number the units of the tree, outermost first, and name each by its path from this one."""
        for number, u in enumerate(self.tree(), 1):
            u.number = number
        for path, child in nested:
            for u in child.tree():
                u.name = path + (f".{u.name}" if u.name else "")

    def tree(self) -> list["Unit"]:
        """This unit and every unit inside it, outermost first."""
        return [self] + [u for child in self.children for u in child.tree()]

    def lay_out(self, taken: list[tuple[list[tuple[nn.Module, str]], torch.Tensor, bool, str, int]]) -> list[Param]:
        """Shard each (slots, full value, trainable, name, shard dim) in `taken`: a `Param` whose shard takes its
        slots."""
        made = []
        for slots, value, trainable, name, dim in taken:
            p = Param(slots, value, trainable, self.mesh, self.rank, self.world_size, name, dim)
            self.params.append(p)
            made.append(p)
            p.occupy(self)
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
        # which parameters train, as a small integer that every dtype holds exactly (the all-gather's tail)
        self.trainable_code = sum(i + 1 for i, p in enumerate(self.params) if p.requires_grad) % 251

    def give_up(self, p: Param) -> tuple[list, torch.Tensor]:
        """Hand `p` (a weight tied outside this unit) to the unit that encloses both: its slots and full value."""
        value = p.sharded.full_tensor().detach()
        self.params.remove(p)
        self._group()
        p.vacate()
        return p.slots, value

    def adopt(self, param: Param | None = None, slot: tuple[nn.Module, str] | None = None) -> None:
        """Take as shards whatever the modules hold now (`to_empty`, `_apply`, `load_state_dict(assign=True)` may
        have put new parameters there): every parameter's first slot, or `param`'s `slot` alone."""
        for p in ([param] if param is not None else self.params):
            p.adopt(slot)
        self._group()

    def follow_requires_grad(self) -> None:
        """Take each shard's `requires_grad` as it is now: a user may freeze or unfreeze a parameter after
        `fully_shard`, and the next forward follows it (as torch's FSDP2 does at each all-gather); one set on a full
        parameter while gathered reached the shard when it was freed (`Param.carry_requires_grad`)."""
        changed = [p for p in self.params if p.sharded.requires_grad != p.requires_grad]
        for p in changed:
            p.set_trainable(p.sharded.requires_grad)
        if changed:
            self._group()

    def check_params(self) -> None:
        """Before the all-gather, on every rank alike (torch's FSDP2 does it at lazy init): take up a parameter the
        user replaced by a plain one of the same shape, and refuse parameters left on the meta device; note which
        parameters hold torch's all-gather extensions: the all-gather's tail compares them on every rank."""
        if any([p.take_up_replaced() for p in self.params]):
            self._group()
        path = f"{self.name}." if self.name else ""
        meta = [path + p.name for p in self.params if p.sharded.device.type == "meta"]
        if meta:
            raise RuntimeError("FSDP parameters should be materialized from meta device before training, but the "
                               f"following were still on meta device: {meta} (call model.to_empty(device=...) and "
                               "initialise them before the first forward)")
        # not raised here: set on some ranks only, the others would wait in the all-gather; its tail carries it
        self.extension = next((path + p.name for p in self.params if p.has_extension()), None)
        self.extension_code, self.extension_error = extension_code(self.params), None

    def use(self, full: bool) -> None:
        """Put the full parameters (`full`) or the shards in the modules' places."""
        for p in self.params:
            p.put(p.full if full else p.sharded)

    # ---------------------------------------------------------------- gather, free, reduce

    def gather(self, why: str, wait: bool = True) -> None:
        """Start filling the full parameters unless they are (being) filled; with `wait`, wait until they are."""
        if self.step.tied_apart:  # on every rank, before any data moves (`fsdp_init._walk`)
            raise ValueError(self.step.tied_apart)
        if not self.params:  # a unit without parameters of its own
            return
        if not self.gathered:
            if not (inside_backward() or self.step.in_backward):
                self.follow_requires_grad()
            self.check_params()
            # parameters with torch's all-gather extensions: their pre-hooks' inputs move after the flat all-gather
            ext = start_extensions(self) if self.extension_code else {}
            jobs = []
            for dtype, members in self.gather_groups.items():
                fulls = [None if p in ext else p.make_full(dtype, self.grad_ready) for p in members]
                for full in fulls:
                    if full is not None:
                        full.untyped_storage().resize_(full.numel() * full.element_size())
                jobs.append((dtype, members, [None if p in ext else p.as_rows(p.local()) for p in members], fulls))
            self.gathers += 1
            self.gathered = True
            # the tail's count: all-gathers so far (mod 64), and whether this one is for backward
            count = (self.gathers % 64) * 2 + (inside_backward() or self.step.in_backward)
            then = functools.partial(gather_inputs, self, ext, segment) if ext else None
            self.gathering = self.worker.submit(in_line, self, all_gather_params, jobs, count, why, then)
        if wait:
            if self.gathering is not None:
                future, self.gathering = self.gathering, None
                with self.span(f"wait all_gather {self.name}", "compute", "wait"):
                    future.result()
                finish_extensions(self)
            self.use(full=True)

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
        for p in self.params:
            p.carry_requires_grad()
        self.use(full=False)
        for p in self.params:
            if p.full is not None and p not in self.extended:
                p.full_local.untyped_storage().resize_(0)  # over tp, the DTensor's local tensor
        free_extensions(self)
        self.gathered = False

    def grad_ready(self, full: torch.Tensor) -> None:
        """(A parameter's post-accumulate-grad hook) once every trainable gradient is in, reduce-scatter them."""
        self.step.backward_begins()
        self.ready += 1
        if self.ready == self.num_trainable and self.requires_gradient_sync:
            self.reduce_scatter()
            if self.num_trainable == len(self.params) and self.reshard_after_backward:
                self.free()  # else backward may still read a frozen weight

    @torch.no_grad()
    def reduce_scatter(self) -> None:
        """Start summing the unit's gradients over the ranks (zeros where one is missing); drop the full ones."""
        jobs = []
        for dtype, members in self.reduce_groups.items():
            grads = []
            for p in members:
                grad = p.full_grad()  # over tp, the DTensor gradient's local tensor
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
        if self.requires_all_reduce:
            self.all_reduces += 1
            self.step.all_reduced = True
        across = self.all_reduces % 64 if self.requires_all_reduce else None
        self.reduced, self.reducing = True, self.worker.submit(in_line, self, reduce_scatter_grads, jobs,
                                                               (self.reduces % 64) * 2, across)

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
                p.add_grad(grad, self.mesh)

    def forget_step(self, keep_gradients: bool) -> None:
        """Forget what this step did with the unit (its full memory is the caller's to free); gradients too, unless
        `keep_gradients` (kept with gradient sync off for the step that syncs)."""
        self.ready, self.reduced, self.seen, self.reducing = 0, False, False, None
        self.to_run.clear()
        if not keep_gradients:
            for p in self.params:
                p.forget_gradients()

    def span(self, name: str, track: str, cat: str):
        """A span of the recorder's trace, if there is a recorder."""
        if self.recorder is None:
            return contextlib.nullcontext()
        return self.recorder.span(name, track, cat=cat)
