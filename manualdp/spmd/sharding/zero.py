"""ZeRO-1 and ZeRO-2 across processes: each rank keeps the optimizer state of one shard.

The SPMD twin of `manualdp.zero`, and a drop-in for torch's `ZeroRedundancyOptimizer`: the
same constructor keywords, parameter groups (also of frozen tensors only) and `add_param_group`,
`.optim` (the inner optimizer), `step(closure, **kwargs)`, `zero_grad`, learning-rate
schedulers, `consolidate_state_dict` and a full `state_dict` in torch's format (loadable into
torch's ZeRO or a plain optimizer, and theirs into ours), and `Join([model, opt])` on uneven
inputs (`zero_torch_api.py`):

    model = DistributedDataParallel(net)                           # stage 1: DDP averages the gradients
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)

    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=2, lr=1e-3)
    with model.no_sync():                                          # stage 2: the optimizer reduce-scatters
        loss.backward()                                            # bucket by bucket, during backward

A step is the ring allreduce with the optimizer moved between its two phases:
1. reduce-scatter: this rank's chunk of the averaged gradient. At stage 1 DDP has allreduced
   every gradient, and the chunk is a slice of `.grad`; at stage 2 backward reduce-scattered
   the gradients into this rank's shards (`zero_grad_shards.py`), and `step` divides them;
2. the inner optimizer steps this rank's chunk, the only one whose state it keeps;
3. all-gather: each flat buffer, so that every rank holds every parameter again.
Before it the ranks agree on what each brings to the step, and what changed under the
optimizer since the last one (a newer optimizer, rebound or unfrozen parameters, gradients on
some ranks only) is taken in or refused on every rank: `zero_guards.py`.

A rank's chunk is near-equal slices of flat buffers, not torch's whole parameters:
`zero_layout.py` holds the partition and says what it changes.

At stage 2 the gradients never exist whole on a rank: after backward a rank holds 1/N of the
gradient (`gradient_bytes()`), summed over the backward passes since `zero_grad`. The
parameters' `.grad` are then stand-ins that raise when used (`zero_grad_shards.ShardedAway`), so
torch's `clip_grad_norm_(model.parameters())` raises instead of returning 0; clip with
`opt.clip_grad_norm_(max_norm)`, which sums the shards' norms over the ranks (at stage 1 too).

Other differences from torch's: `shard_state_dict()` is this rank's shard (each rank saves its own:
a sharded checkpoint); `state_dict()` is torch's, the full state after `consolidate_state_dict`
and torch's error before it (on one rank alone, it could not tell a save of the full state from a
shard's); parameters of
several dtypes are refused at both stages, in torch's words (`add_param_group` takes them, as torch's); `step` calls the
closure itself, before the inner step (the gradients must exist to be cut into pieces), and hands one that
is not callable to the inner optimizer's `step`, as torch's does.

By design the partition is not torch's, so code that reads which rank holds what sees other
answers: a rank steps near-equal slices of the trainable elements, in the buckets' (backward)
order, where torch's deals whole parameters, frozen ones included, largest first (`.optim`'s
groups list other tensors, a frozen tensor is in no rank's until it is unfrozen, and a rank that steps
with its own unaveraged gradient moves other elements). Ranks built from other seeds (without DDP)
start from the group's rank 0's parameters, copied at construction as torch's DDP copies them,
where torch's steps a mix of the models; a rank that changes its parameters afterwards is named by
the drift check.
"""
from __future__ import annotations

import copy
import weakref

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable

from ...buckets import DEFAULT_BUCKET_CAP_MB
from ...validate import boolean, factory, non_negative_number, one_of, positive_number, timeout_seconds
from ...shards import ShardPlan, check_shard_fits, options_of, param_groups_of
from ...zero import make_optimizer, state_bytes
from ..collectives import all_gather, allreduce
from ..ladder.drift import DRIFT_CHECK_EVERY, DriftCheck
from ..transport.agree import broadcast_from_rank0
from ..transport.peers import group_ranks
from .zero_grad_shards import GradientShards, holders_of, plan_buckets, real_grad
from .zero_guards import ZeroGuards, refuse_mixed_types, refuse_sparse
from .zero_layout import ZeroLayout
from .zero_torch_api import TorchCompat

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer(torch.optim.Optimizer, ZeroLayout, ZeroGuards, TorchCompat):
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
        drift_check_every: compare the replicas' parameters (a digest each) at steps 0, 1, 2, 4, ... below
            it and every this many after; every rank raises naming the first that differs (`ladder/drift.py`); 0: never.

    Every rank must build it alike: the same stage, algorithm, optimizer class and defaults, and
    the same parameter groups (shapes, dtypes, frozen or not, options such as `lr`). The ranks
    compare them at construction and at `add_param_group`, and all raise, naming the field.

    The partition is not torch's (whole parameters, sorted and dealt greedily) but near-equal
    chunks of a flat buffer: see `zero_layout.py` for what that changes.
    """

    def __init__(self, params, optimizer_class, *, stage: int = 1, algorithm: str = "ring", group=None,
                 process_group=None, parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, timeout: float | None = None,
                 drift_check_every: int = DRIFT_CHECK_EVERY, **defaults) -> None:
        self._drift = DriftCheck(drift_check_every)  # the replicas compared at the first step and every N after
        # frozen ones too: torch's indices count them, and it takes a group of frozen tensors only
        groups = param_groups_of(params, keep_frozen=True, require_trainable=False)
        refuse_sparse(groups)
        self.stage = one_of("stage", stage, (1, 2))
        # torch's drop-in refuses several dtypes (not in add_param_group); stage 2 too, as torch's decides
        refuse_mixed_types([p for g in groups for p in g["params"]])
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
        self._device = next(p for g in groups for p in g["params"]).device  # where the ranks' flags are summed
        self._trainable = [[p for p in g["params"] if p.requires_grad] for g in groups]  # the plan's groups
        self._plan_groups = list(range(len(groups)))  # the parameter group of each of the plan's groups
        # frozen now: sharded once every rank unfreezes them (`_unfreeze`), as torch's would step them then
        self._frozen = [(g, p) for g, group in enumerate(groups) for p in group["params"] if not p.requires_grad]
        self.params = [p for ps in self._trainable for p in ps]
        self.plan = ShardPlan(self._trainable, self.world_size)
        buckets = self._buckets(self.plan, self.params)
        self._agree_on_setup(self.plan, len(self.params), len(buckets), groups)
        holders = holders_of([p for g in groups for p in g["params"]])  # older ZeRO-2s over these parameters
        # The parameters become views of flat buffers, so that the collectives and the
        # optimizer work in place and a checkpoint loaded into the model is what they see.
        self.flats = self.plan.bind(self.params)
        self._record_binding()
        # the group's rank 0's parameters on every rank, as torch's DDP copies them at construction: ranks seeded
        # apart (pytorch's test_nondefault_process_group) train one model, never a mix; the drift check then
        # watches what changes between steps
        broadcast_from_rank0([*self.flats, *(p for _, p in self._frozen)], group, self.timeout)
        self._notified = False  # whether this step has told a Join that this rank trains
        self.grad_shards = self._gradient_shards(buckets) if self.stage == 2 else None
        self._left_behind = self._take_over(holders)  # sums the older ones held that we could not carry over
        self.pieces: list = []
        self._find_pieces()
        # One inner group per group, as torch's; a group may be empty here (its chunks are on other
        # ranks, or it holds frozen tensors only), and so may all (more ranks than elements).
        inner = [{"params": self._pieces_of(g), **options_of(given)} for g, given in enumerate(groups)]
        self.optimizer = make_optimizer(optimizer_class, inner, **defaults)
        self._built = False  # torch's constructor calls add_param_group for each group
        outer = [{"params": g["params"], **options_of(t)} for g, t in zip(groups, self.optimizer.param_groups)]
        super().__init__(outer, dict(getattr(self.optimizer, "defaults", {})))
        self._built = True
        Joinable.__init__(self)
        self._divide_by_initial = True  # under Join at stage 2: average over all ranks, not the training ones
        self._consolidated_to: int | None = None
        self._full_state: dict | None = None

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """Step this rank's shard with its gradient (stage 2: reduce-scattered in backward), all-gather the parameters.

        `closure` (re-computes the loss and its gradients) is called first, and its loss returned;
        `kwargs` go to the inner optimizer's `step`, as torch's. A `closure` that is not callable goes
        there too, as torch's hands it over: a subclass whose `step` ignores it steps, one that calls it raises.
        """
        loss, handed = None, closure is not None and not callable(closure)
        if handed:
            kwargs["closure"] = closure
        elif closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._notify_join()  # a no-op unless this optimizer is the first of a Join's joinables
        try:
            inner = self._step(own_gradients=True, **kwargs)
        except TypeError as e:
            if not handed:
                raise
            raise TypeError(f"closure must be callable (it re-computes the loss and the gradients), got {closure!r}: "
                            f"the inner optimizer's step called it ({e}); pass keyword arguments for it by name") from e
        finally:
            self._notified = False
        return inner if handed else loss

    def _step(self, own_gradients: bool, **kwargs):
        """One step, returning the inner step's result; a rank out of data under Join adds zeros at stage 2."""
        self._refuse_if_taken_over()
        if self.grad_shards is not None:
            self.grad_shards.check_finished()
            if not own_gradients:
                self.grad_shards.reduce_zeros()  # the training ranks reduce-scatter their buckets now
        # the guards: every rank brings the same to this step, or all raise (`zero_guards.py`)
        used, training = self._agree_on_step(own_gradients, self._adopt_rebound())
        self._drift.tick(lambda: [(str(k), p) for k, p in enumerate(self._all_params)], self.group,
                         who="ZeroRedundancyOptimizer", timeout=self.timeout)
        # 1. reduce-scatter (by DDP's allreduce at stage 1, in backward at stage 2): this rank's chunk of the gradient
        lent = self._lend_gradients(used, training)
        # 2. step this rank's chunk
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update(options_of(outer))  # a scheduler or the user may have changed lr
        try:
            result = self.optimizer.step(**kwargs)
        finally:
            for piece in lent:
                piece.grad = None
            if self.grad_shards is not None and own_gradients:
                self.grad_shards.stand_in()
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            outer.update(options_of(inner))  # keys the inner optimizer added or changed, as torch copies them
        # 3. all-gather: every rank holds every parameter again
        for flat in self.flats:
            all_gather(flat, algorithm=self.algorithm, group=self.group, timeout=self.timeout)
        return result

    def _lend_gradients(self, used: list[int], training: int) -> list[torch.Tensor]:
        """Give each of this rank's pieces its slice of the averaged gradient; return the pieces given one.

        Stage 1: a slice of its parameter's `.grad`, which DDP averaged (a whole parameter steps with
        its own). Stage 2: a slice of the shards, divided as the DDP wrapper divides the sums; a
        parameter no rank used gets none, and the inner optimizer skips it.
        """
        grads = None
        if self.grad_shards is not None:
            divisor = self.world_size if self._divide_by_initial else training
            grads = [s / divisor if s is not None else None for s in self.grad_shards.shards]
            starts = [self.plan.bounds(b, self.rank)[0] for b in range(len(self.flats))]
        lent = []  # the pieces given a gradient for this step, which must not keep it
        for j, lo, hi, piece in self.pieces:
            p, (b, start, _) = self.params[j], self.plan.where[j]
            if grads is None:
                if piece is p or p.grad is None:
                    continue
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad  # nn.Embedding(sparse=True): its rows
                piece.grad = grad.reshape(-1)[lo - start:hi - start]
            else:
                piece.grad = grads[b][lo - starts[b]:hi - starts[b]].view_as(piece) if used[j] else None
            lent.append(piece)
        return lent

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._refuse_if_taken_over()
        if self.grad_shards is not None:
            self.grad_shards.zero_grad(set_to_none)
        self._left_behind = False
        for p in self.params + [p for _, p in self._frozen]:  # frozen ones too, as torch's
            if set_to_none:
                p.grad = None
            elif real_grad(p) is not None:
                p.grad.zero_()

    @property
    def reduces_gradients(self) -> bool:
        """True at stage 2: DDP must not average the gradients (backward under `no_sync()`); we reduce-scatter them."""
        return self.stage == 2

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
                        ) -> torch.Tensor:
        """Clip the averaged gradient to `max_norm` by its norm over all ranks; return that norm, as torch's function.

        At stage 1 every rank holds the whole averaged gradient: torch's `clip_grad_norm_` on the
        parameters. At stage 2 each rank holds its shard of the sum: each rank's `norm_type`-th
        power of its shards' norm is summed over the ranks (for `inf`, the largest entry is taken),
        divided by the world size as `step` divides the sums, and the shards are scaled in place.
        Call it between backward and `step`, on every rank.
        """
        max_norm, norm_type = non_negative_number("max_norm", max_norm), float(positive_number("norm_type", norm_type))
        self._refuse_if_taken_over()
        if self.grad_shards is None:
            return torch.nn.utils.clip_grad_norm_(self.params, max_norm, norm_type, error_if_nonfinite)
        self.grad_shards.check_finished()
        shards = [s for s in self.grad_shards.shards if s is not None]
        mine = [torch.linalg.vector_norm(s, norm_type).double() for s in shards if s.numel()]
        powers = torch.zeros(self.world_size, dtype=torch.float64, device=self._device)
        if norm_type == float("inf"):  # each rank's largest entry at its own place: the sum is the list of them
            powers[self.rank] = max(mine, default=torch.tensor(0.0, dtype=torch.float64))
            self._sum_over_ranks(powers)
            total = powers.max()
        else:
            powers[0] = sum((n ** norm_type for n in mine), torch.tensor(0.0, dtype=torch.float64))
            self._sum_over_ranks(powers)
            total = powers[0] ** (1.0 / norm_type)
        total = total / self.world_size  # the norm of the average, which step will hand the inner optimizer
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                               "so it cannot be clipped. To disable this error and scale the gradients by the "
                               "non-finite norm anyway, set `error_if_nonfinite=False`")
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for s in shards:
            s.mul_(coefficient.to(s.dtype))
        return total.to(shards[0].dtype if shards else torch.get_default_dtype())

    def add_param_group(self, param_group: dict) -> None:
        """Add a group, on every rank: its parameters get new flat buffers, of which this rank steps its chunk."""
        if not self._built:
            return super().add_param_group(param_group)
        self._refuse_if_taken_over()
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = param_groups_of([param_group], "param_group", keep_frozen=True, require_trainable=False)[0]
        refuse_sparse([group], "param_group")
        trainable = [p for p in group["params"] if p.requires_grad]
        super().add_param_group(group)  # torch's checks (a parameter in two groups) and defaults
        try:
            if self.grad_shards is not None:
                self.grad_shards.check_finished()
            plan = ShardPlan(self._trainable + [trainable], self.world_size)
            buckets = self._buckets(plan, self.params + trainable)
            self._agree_on_setup(plan, len(self.params) + len(trainable), len(buckets), self.param_groups)
        except BaseException:
            self.param_groups.pop()
            raise
        g = len(self.param_groups) - 1
        self._frozen += [(g, p) for p in group["params"] if not p.requires_grad]
        new = self._add_buffers([trainable], [g], plan, buckets)
        self.optimizer.add_param_group({"params": [v for _, v in new], **options_of(self.param_groups[-1])})

    def _sum_over_ranks(self, tensor: torch.Tensor) -> None:
        allreduce(tensor, self.algorithm, group=self.group, timeout=self.timeout)

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

    @property
    def optim(self) -> torch.optim.Optimizer:
        """The inner optimizer, which steps this rank's pieces (torch's attribute)."""
        return self.optimizer

    def gradient_bytes(self) -> int:
        """Bytes of gradient this rank holds: the parameters' `.grad`, and at stage 2 its shards and bucket buffers."""
        held = [real_grad(p) for p in self.params if real_grad(p) is not None]
        if self.grad_shards is not None:
            held += self.grad_shards.held()
        return sum(t.numel() * t.element_size() for t in held)

    def state_bytes(self) -> int:
        """Optimizer-state bytes on this rank."""
        return state_bytes(self.optimizer)

    def state_dict(self) -> dict:
        """The full state after `consolidate_state_dict(to)`, on rank `to`; torch's error elsewhere (`TorchCompat`)."""
        return self._full_state_dict()

    def shard_state_dict(self) -> dict:
        """This rank's shard of the state: a sharded checkpoint, each rank its own (`load_state_dict` takes it)."""
        return {"stage": self.stage, "rank": self.rank, "world_size": self.world_size,
                "param_groups": [options_of(g) for g in self.param_groups],
                "shard": self.optimizer.state_dict()}

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
        saved = state["shard"]  # None, or groups without pieces: a rank that had nothing to step
        if saved is not None and not any(g["params"] for g in saved.get("param_groups", ())):
            saved = None
        check_shard_fits(saved, self.optimizer if self.pieces else None, "state's shard", f"rank {self.rank}'s")
        if saved is not None:
            self.optimizer.load_state_dict(copy.deepcopy(saved))
        for outer, saved in zip(self.param_groups, state.get("param_groups", ())):
            outer.update(saved)
