"""ZeRO-1 and ZeRO-2 across processes: each rank keeps the optimizer state of one shard.

The SPMD twin of `manualdp.zero`, and a drop-in for torch's `ZeroRedundancyOptimizer`: the
same constructor keywords, parameter groups and `add_param_group`, `step(closure)`,
`zero_grad`, learning-rate schedulers, `consolidate_state_dict` and a full `state_dict`, the
state of a plain optimizer loaded, and `Join([model, opt])` on uneven inputs
(`zero_torch_api.py`):

    model = DistributedDataParallel(net)                           # stage 1: DDP averages the gradients
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)

    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=2, lr=1e-3)
    with model.no_sync():                                          # stage 2: the optimizer reduce-scatters
        loss.backward()                                            # bucket by bucket, during backward

torch shards whole parameters (each rank owns some tensors); we shard the flat vector into
near-equal chunks, as the ring does, with the layout of `manualdp.shards.ShardPlan`: one flat
buffer per (parameter group, dtype), the parameters made views of it, and this rank's chunk
handed to its optimizer as one piece per parameter it overlaps. Elementwise optimizers give
the same numbers either way, and a parameter no rank has a gradient for is skipped.

At stage 2 the gradients never exist whole on a rank (`grad_shards.py`): during backward each
bucket is reduce-scattered as it fills and `.grad` freed, so after backward a rank holds 1/N
of the gradient (`gradient_bytes()`), summed over the backward passes since `zero_grad`; the
parameters' `.grad` stay None, so a clip or a check of them must be done on the shards.

One difference from torch's: `state_dict()` before any `consolidate_state_dict` is this
rank's shard (each rank saves its own: a sharded checkpoint), where torch's raises.
"""
from __future__ import annotations

import copy
import weakref

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable

from ...buckets import DEFAULT_BUCKET_CAP_MB
from ...validate import boolean, factory, one_of, positive_number, timeout_seconds
from ...shards import ShardPlan, check_shard_fits, options_of, param_groups_of
from ...zero import make_optimizer, state_bytes
from ..collectives import all_gather
from ..collectives import allreduce
from ..transport.agree import agree
from ..transport.peers import group_ranks
from .zero_torch_api import TorchCompat
from .grad_shards import GradientShards, plan_buckets

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer(torch.optim.Optimizer, TorchCompat):
    """Shard `params`' optimizer state (stage 1) and gradients (stage 2) over the ranks of `group`.

    Args:
        params: tensors, or parameter groups (dicts with "params"), as torch's optimizers take them.
        optimizer_class: e.g. `torch.optim.Adam`, or a factory `f(params, **defaults)`.
        stage: 1 expects averaged gradients (from the DDP wrapper); 2 expects this rank's own
            gradients (backward under `no_sync()`) and reduce-scatters them during backward.
        bucket_cap_mb: at stage 2, the size of the buckets reduce-scattered during backward (DDP's default).
        algorithm: of the reduce-scatter and the all-gather (`manualdp.schedule.COLLECTIVES`).
        group: the process group (default: all ranks); `process_group` is torch's name for it.
        parameters_as_bucket_view: accepted for torch's sake. We always make the parameters views
            of flat buffers (what torch does with True): the chunks we shard are slices of them.
            False (torch's default, where each `param.data` stays its own tensor) changes nothing.
        overlap_with_ddp: True is refused: torch's needs a DDP comm hook that steps the
            optimizer bucket by bucket; call `step()` after backward instead.

    Every rank must build it with the same stage and the same parameter shapes: the ranks
    compare them at construction and all raise, naming the ranks that differ.
    """

    def __init__(self, params, optimizer_class, *, stage: int = 1, algorithm: str = "ring", group=None,
                 process_group=None, parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, timeout: float | None = None, **defaults) -> None:
        groups = param_groups_of(params, keep_frozen=True)  # frozen ones too: torch's indices count them
        self.stage = one_of("stage", stage, (1, 2))
        factory("optimizer_class", optimizer_class)
        self.parameters_as_bucket_view = boolean("parameters_as_bucket_view", parameters_as_bucket_view)
        self.bucket_cap_mb = positive_number("bucket_cap_mb", bucket_cap_mb)
        if boolean("overlap_with_ddp", overlap_with_ddp):
            raise ValueError("overlap_with_ddp=True is not supported: torch's steps the optimizer inside a DDP comm "
                             "hook (ddp_zero_hook), bucket by bucket; pass overlap_with_ddp=False and call step() "
                             "after backward (stage=2 with no_sync() also shards the gradients)")
        if group is not None and process_group is not None:
            raise ValueError("pass group or process_group (torch's name for it), not both")
        group = process_group if process_group is not None else group
        self.algorithm, self.group, self.timeout = algorithm, group, timeout_seconds("timeout", timeout)
        self.process_group = group if group is not None else dist.group.WORLD  # torch's attribute
        self.rank, self.peers = group_ranks(group)
        self.world_size = len(self.peers)
        self._make = (optimizer_class, defaults)
        self._trainable = [[p for p in g["params"] if p.requires_grad] for g in groups]
        self.params = [p for ps in self._trainable for p in ps]
        self.plan = ShardPlan(self._trainable, self.world_size)
        buckets = self._buckets(self.plan, self.params)
        self._agree_on_setup(self.plan, len(self.params), len(buckets))
        # The parameters become views of flat buffers, so that the collectives and the
        # optimizer work in place and a checkpoint loaded into the model is what they see.
        self.flats = self.plan.bind(self.params)
        self._notified = False  # whether this step has told a Join that this rank trains
        self.grad_shards = self._gradient_shards(buckets) if self.stage == 2 else None
        self._find_pieces()
        inner = [{"params": self._pieces_of(g), **options_of(given)} for g, given in enumerate(groups)]
        # A rank whose chunks are empty (more ranks than elements) has nothing to step.
        self.optimizer = make_optimizer(optimizer_class, inner, **defaults) if self.pieces else None
        template = (self.optimizer if self.optimizer is not None
                    else make_optimizer(optimizer_class, [dict(g) for g in groups], **defaults))
        self._built = False  # torch's constructor calls add_param_group for each group
        super().__init__([{"params": g["params"], **options_of(t)} for g, t in zip(groups, template.param_groups)],
                         dict(getattr(template, "defaults", {})))
        self._built = True
        Joinable.__init__(self)
        self._divide_by_initial = True  # under Join at stage 2: average over all ranks, not the training ones
        self._consolidated_to: int | None = None
        self._full_state: dict | None = None

    def _buckets(self, plan: ShardPlan, params: list[torch.Tensor]) -> list:
        return plan_buckets(plan, params, self.bucket_cap_mb) if self.stage == 2 else []

    def _gradient_shards(self, buckets: list) -> GradientShards:
        notify = weakref.WeakMethod(self._notify_join)  # the hooks must not keep a dropped optimizer alive
        return GradientShards(self.plan, self.params, buckets, self.rank, self.group, self.timeout, notify)

    def _notify_join(self) -> None:
        """Tell a Join (if this optimizer is its first joinable) that this rank trains, once a step.

        At stage 2 the first gradient of backward does it, before the first bucket is sent:
        the joined ranks must start answering the reduce-scatters then.
        """
        if not self._notified:
            self._notified = True
            Join.notify_join_context(self)

    def _find_pieces(self) -> None:
        """This rank's pieces: (parameter, lo, hi, view of its flat buffer), in parameter order."""
        self.pieces = [(j, lo, hi, self.flats[self.plan.where[j][0]][lo:hi])
                       for j, lo, hi in self.plan.pieces(self.rank)]

    def _pieces_of(self, group: int) -> list[torch.Tensor]:
        return [v for j, _, _, v in self.pieces if self.plan.group_of[j] == group]

    def _agree_on_setup(self, plan: ShardPlan, parameters: int, buckets: int) -> None:
        """Every rank must shard alike (stage, buffers, elements, parameters, buckets); else all raise, naming them."""
        agree("ZeroRedundancyOptimizer", {"stage": self.stage, "algorithm": self.algorithm,
                                          "buffers to shard": len(plan.sizes), "elements to shard": sum(plan.sizes),
                                          "parameters to shard": parameters, "buckets": buckets},
              self.group, timeout=self.timeout, check=True)

    def _sum_over_ranks(self, tensor: torch.Tensor) -> None:
        allreduce(tensor, self.algorithm, group=self.group, timeout=self.timeout)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group, on every rank: its parameters get new flat buffers, of which this rank steps its chunk."""
        if not self._built:
            return super().add_param_group(param_group)
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = param_groups_of([param_group], "param_group", keep_frozen=True)[0]
        trainable = [p for p in group["params"] if p.requires_grad]
        super().add_param_group(group)  # torch's checks (a parameter in two groups) and defaults
        try:
            if self.grad_shards is not None:
                self.grad_shards.check_finished()
            plan = ShardPlan(self._trainable + [trainable], self.world_size)
            buckets = self._buckets(plan, self.params + trainable)
            self._agree_on_setup(plan, len(self.params) + len(trainable), len(buckets))
        except BaseException:
            self.param_groups.pop()
            raise
        kept = self.pieces  # the same pieces, and the very tensors the inner optimizer holds
        self.plan, self._trainable, self.params = plan, self._trainable + [trainable], self.params + trainable
        self.flats += ShardPlan([trainable], self.world_size).bind(trainable)  # the new group's buffers, as in `plan`
        self._find_pieces()
        self.pieces[:len(kept)] = kept
        if self.grad_shards is not None:  # new buckets and hooks; what is summed so far is kept
            old, self.grad_shards = self.grad_shards, self._gradient_shards(buckets)
            self.grad_shards.adopt(old)
        options = options_of(self.param_groups[-1])
        if self.optimizer is not None:
            self.optimizer.add_param_group({"params": [v for *_, v in self.pieces[len(kept):]], **options})
        elif self.pieces:
            cls, defaults = self._make
            self.optimizer = make_optimizer(cls, [{"params": self._pieces_of(g), **options_of(outer)}
                                                  for g, outer in enumerate(self.param_groups)], **defaults)

    @property
    def reduces_gradients(self) -> bool:
        """True at stage 2: DDP must not average the gradients (backward under `no_sync()`); we reduce-scatter them."""
        return self.stage == 2

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.grad_shards is not None:
            self.grad_shards.zero_grad(set_to_none)
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        """Step this rank's shard with its gradient (stage 2: reduce-scattered in backward), all-gather the parameters.

        `closure` (re-computes the loss and its gradients) is called first, and its loss returned.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._notify_join()  # a no-op unless this optimizer is the first of a Join's joinables
        try:
            self._step(own_gradients=True)
        finally:
            self._notified = False
        return loss

    def _step(self, own_gradients: bool) -> None:
        """One step; a rank out of data under Join (`own_gradients=False`) adds zeros at stage 2."""
        kw = {"algorithm": self.algorithm, "group": self.group, "timeout": self.timeout}
        if self.grad_shards is None:  # stage 1: DDP hands every rank the averages, also a rank out of data
            used = [p.grad is not None for p in self.params]
            grads, starts = self.plan.flat_grads(self.params), [0] * len(self.flats)
        else:
            grads, starts, used = self._reduced_grads(own_gradients)
        if self.optimizer is not None:
            for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
                inner.update(options_of(outer))  # a scheduler may have changed lr
            for j, lo, hi, piece in self.pieces:
                b = self.plan.where[j][0]
                piece.grad = grads[b][lo - starts[b]:hi - starts[b]] if used[j] else None
            self.optimizer.step()
            for *_, piece in self.pieces:
                piece.grad = None
        for flat in self.flats:
            all_gather(flat, **kw)

    def _reduced_grads(self, own_gradients: bool) -> tuple[list, list[int], list]:
        """Stage 2: this rank's shards of the averaged gradient, where they start in their buffers, which are used."""
        self.grad_shards.check_finished()
        if not own_gradients:
            self.grad_shards.reduce_zeros()  # the training ranks reduce-scatter their buckets now
        # Which parameters has any rank a gradient for (those no rank used are skipped), whether
        # this rank trains, and whether it holds a `.grad` that no backward handed over.
        loose = own_gradients and any(p.grad is not None for p in self.params)
        used = torch.tensor([own_gradients and u for u in self.grad_shards.used] + [own_gradients, loose],
                            dtype=torch.int32, device=self.flats[0].device)
        self._sum_over_ranks(used)
        used = used.tolist()
        if used[-1]:  # every rank sees it in the sum, so every rank raises
            raise RuntimeError(f"ZeroRedundancyOptimizer(stage=2): {used[-1]} rank(s) hold a .grad that no backward "
                               "pass handed over (set by hand, or averaged by a DDP whose backward ran outside "
                               "no_sync()); stage 2 reduce-scatters the gradients during backward: run it under "
                               "model.no_sync(), or use stage=1")
        divisor = self.world_size if self._divide_by_initial else used[-2]
        # Sums, divided as the DDP wrapper divides them: DDP hands the optimizer averages.
        grads = [s / divisor if s is not None else None for s in self.grad_shards.shards]
        return grads, [self.plan.bounds(b, self.rank)[0] for b in range(len(self.flats))], used

    def gradient_bytes(self) -> int:
        """Bytes of gradient this rank holds: the parameters' `.grad`, and at stage 2 its shards and bucket buffers."""
        held = [p.grad for p in self.params if p.grad is not None]
        if self.grad_shards is not None:
            held += self.grad_shards.held()
        return sum(t.numel() * t.element_size() for t in held)

    def state_bytes(self) -> int:
        """Optimizer-state bytes on this rank."""
        return state_bytes(self.optimizer)

    def state_dict(self) -> dict:
        """This rank's shard of the state (each rank saves its own, as a sharded checkpoint).

        After `consolidate_state_dict(to)`, as torch's: the full state on rank `to`, in a plain
        optimizer's format; the other ranks raise.
        """
        if self._consolidated_to is not None:
            return self._full_state_dict()
        return {"stage": self.stage, "rank": self.rank, "world_size": self.world_size,
                "param_groups": [options_of(g) for g in self.param_groups],
                "shard": self.optimizer.state_dict() if self.optimizer is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Load this rank's shard, or this rank's slices of a plain optimizer's full state (torch's format).

        Another rank's shard, stage's or world size's is refused, changing nothing.
        """
        if isinstance(state, dict) and "shard" not in state and {"state", "param_groups"} <= state.keys():
            return self._load_full_state_dict(state)
        if not isinstance(state, dict) or "shard" not in state:
            raise ValueError("state is neither a ZeroRedundancyOptimizer state_dict (it has no 'shard') nor an "
                             "optimizer's full state_dict (with 'state' and 'param_groups')")
        if (state.get("rank"), state.get("world_size")) != (self.rank, self.world_size):
            raise ValueError(f"state is rank {state.get('rank')} of {state.get('world_size')}; "
                             f"this is rank {self.rank} of {self.world_size}")
        if state.get("stage") != self.stage:
            raise ValueError(f"state is ZeRO-{state.get('stage')}; this is ZeRO-{self.stage}")
        check_shard_fits(state["shard"], self.optimizer, "state's shard", f"rank {self.rank}'s")
        if self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(state["shard"]))
        for outer, saved in zip(self.param_groups, state.get("param_groups", ())):
            outer.update(saved)
