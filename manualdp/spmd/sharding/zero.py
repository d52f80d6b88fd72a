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

The partition differs from torch's, by design. torch's gives each rank whole parameters, sorted
by size and dealt greedily to the rank with the fewest elements so far (so one rank may hold
much more than another). We shard the flat vector into near-equal chunks, as the ring does,
with the layout of `manualdp.shards.ShardPlan`: one flat buffer per (parameter group, dtype), the
parameters made views of it, and this rank's chunk handed to its optimizer as one piece per
parameter it overlaps: the parameter itself where the chunk holds all of it, else a slice of
the buffer. Elementwise optimizers (SGD, Adam, AdamW, ...) give the same numbers either way, on
averaged gradients. What differs: which tensors `.optim` holds on a rank (`optim.state[p]`
exists only on a rank that owns all of `p`), and a gradient that differs across ranks, which
torch's steps with its owner's and ours refuses at stage 1 (below). A parameter no rank has a
gradient for is skipped, as torch's optimizers skip it; one with a gradient on some ranks only
is refused at stage 1, on every rank: stepped by its owners' gradients only, it would be
stepped in part.

At stage 2 the gradients never exist whole on a rank (`grad_shards.py`): during backward each
bucket is reduce-scattered as it fills and `.grad` freed, so after backward a rank holds 1/N
of the gradient (`gradient_bytes()`), summed over the backward passes since `zero_grad`. The
parameters' `.grad` are then stand-ins that raise when used (`grad_shards.ShardedAway`), so
torch's `clip_grad_norm_(model.parameters())` raises instead of returning 0; clip with
`opt.clip_grad_norm_(max_norm)`, which sums the shards' norms over the ranks (at stage 1 too).

Parameters changed under it between steps end as torch's SGD would end, or every rank raises
in one line; nothing is stepped silently wrong:
- a second ZeroRedundancyOptimizer built over the same parameters takes them over (a new phase
  of training, while a scheduler still holds the first). At stage 2 the first one's gradient
  hooks are removed and its `step` raises from then on; what it summed since its `zero_grad`
  (torch's `.grad`, which a new torch optimizer steps with) is carried over where the layout is
  the same, else the new `step` raises until `zero_grad`. We hand over rather than refuse, as
  torch's optimizers and its ZeRO let a new one be built: the first is often out of the user's
  reach (a scheduler, a notebook's history), so "release the first" would be hard to follow.
  (A first one at stage 1 has no hooks to take gradients: stepped, it steps the parameters'
  current values, as a second torch optimizer would);
- a `param.data = t` (`vector_to_parameters`, a loaded vector) is seen at `step` by the
  parameters' data pointers, and the new values are copied into the flat buffers; a tensor of
  another shape, dtype or device (`model.float()`) is refused, naming the parameter;
- a parameter frozen when the optimizer was built and unfrozen later, on every rank, is sharded
  at the next `step` in flat buffers of its own, and stepped from then on as torch's optimizers
  step it once it has a gradient; unfrozen on some ranks only, it is refused, naming it.
The checks ride on the step's one allreduce of flags (a few more integers), and cost about
0.1 us per parameter a step.

Other differences from torch's: `state_dict()` before any `consolidate_state_dict` is this
rank's shard (each rank saves its own: a sharded checkpoint), where torch's raises; parameters
of several dtypes are taken (a buffer per dtype), where torch's refuses them; `step` calls the
closure itself, before the inner step (the gradients must exist to be cut into pieces), so a
closure that is not callable is refused where torch's hands it to the inner optimizer.
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
from ..collectives import all_gather
from ..collectives import allreduce
from ..transport.agree import agree
from ..transport.peers import group_ranks
from .zero_torch_api import TorchCompat
from .grad_shards import GradientShards, holders_of, plan_buckets, real_grad

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

    Every rank must build it alike: the same stage, algorithm, optimizer class and defaults, and
    the same parameter groups (shapes, dtypes, frozen or not, options such as `lr`). The ranks
    compare them at construction and at `add_param_group`, and all raise, naming the field.

    The partition is not torch's (whole parameters, sorted and dealt greedily) but near-equal
    chunks of a flat buffer: see the module's docstring for what that changes.
    """

    def __init__(self, params, optimizer_class, *, stage: int = 1, algorithm: str = "ring", group=None,
                 process_group=None, parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, timeout: float | None = None, **defaults) -> None:
        # frozen ones too: torch's indices count them, and it takes a group of frozen tensors only
        groups = param_groups_of(params, keep_frozen=True, require_trainable=False)
        _refuse_sparse(groups)
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

    @property
    def _all_params(self) -> list[torch.Tensor]:
        """Every parameter of every group, frozen ones too, in the order torch's state_dict numbers them."""
        return [p for g in self.param_groups for p in g["params"]]

    def _find_pieces(self) -> list[tuple[int, torch.Tensor]]:
        """This rank's pieces: (parameter, lo, hi, tensor), in the order the inner optimizer numbers them.

        The tensor is the parameter itself where this rank's chunk holds all of it (as torch's
        inner optimizer holds whole parameters: `optim.state[p]`), else a slice of its flat buffer.
        A piece found before keeps its tensor (the inner optimizer's state is keyed by it). Returns
        the new ones: (parameter group, tensor).
        """
        kept = {(j, lo, hi): v for j, lo, hi, v in self.pieces}
        self.pieces, new = [], []
        for j, lo, hi in self._pieces_in_order(self.rank):
            piece = kept.get((j, lo, hi))
            if piece is None:
                b, start, end = self.plan.where[j]
                piece = self.params[j] if (lo, hi) == (start, end) else self.flats[b][lo:hi]
                new.append((self._group_of(j), piece))
            self.pieces.append((j, lo, hi, piece))
        return new

    def _pieces_in_order(self, rank: int) -> list[tuple[int, int, int]]:
        """`rank`'s (parameter, lo, hi), by parameter group, then by parameter: as its inner optimizer numbers them."""
        return sorted(self.plan.pieces(rank), key=lambda piece: self._group_of(piece[0]))

    def _group_of(self, j: int) -> int:
        """The parameter group of parameter j (a parameter unfrozen later sits in a plan group of its own)."""
        return self._plan_groups[self.plan.group_of[j]]

    def _pieces_of(self, group: int) -> list[torch.Tensor]:
        return [v for j, _, _, v in self.pieces if self._group_of(j) == group]

    def _record_binding(self) -> None:
        """Where each parameter's data lives in its flat buffer, to see a later `param.data = ...`."""
        self._pointers, self._shapes = [p.data_ptr() for p in self.params], [p.shape for p in self.params]

    def _take_over(self, holders: list[GradientShards]) -> bool:
        """Take the parameters' gradients from older stage-2 optimizers still alive; say whether sums were lost.

        Each older one's hooks are removed and its `step` raises from now on. What it summed
        since its `zero_grad` (torch's `.grad`, which a new torch optimizer would step with) is
        carried over where the layout is the same (same parameters, groups and ranks); else it
        cannot be, and this optimizer's `step` raises until its `zero_grad`.
        """
        lost = False
        for old in holders:
            same = (self.grad_shards is not None and old.group is self.group and len(old.params) == len(self.params)
                    and all(a is b for a, b in zip(old.params, self.params))
                    and (old.plan.where, old.plan.sizes) == (self.plan.where, self.plan.sizes))
            if same:
                self.grad_shards.adopt(old)
            else:
                lost |= any(old.used)
                old.release()
        return lost

    def _agree_on_setup(self, plan: ShardPlan, parameters: int, buckets: int, groups: list[dict]) -> None:
        """Every rank must build alike: stage, optimizer, each group's tensors and options, the layout; else all raise.

        A group's options are compared as given (`groups`), beside the optimizer's `defaults`, so
        another `lr` on one rank is named; so are other groups of the same elements, which would
        otherwise cut other buffers and abort gloo at the first all-gather.
        """
        cls, defaults = self._make
        fields = {"stage": self.stage, "algorithm": self.algorithm, "optimizer_class": _name_of(cls),
                  "defaults": _options_text(defaults), "parameter groups": len(groups)}
        for g, group in enumerate(groups):
            fields[f"group {g} tensors"] = " ".join(
                f"{tuple(p.shape)}:{str(p.dtype).replace('torch.', '')}{'' if p.requires_grad else ':frozen'}"
                for p in group["params"])
            fields[f"group {g} options"] = _options_text(options_of(group))
        fields |= {"buffers to shard": len(plan.sizes), "elements to shard": sum(plan.sizes),
                   "parameters to shard": parameters, "buckets": buckets}
        agree("ZeroRedundancyOptimizer", fields, self.group, timeout=self.timeout, check=True,
              hint="every rank must build the optimizer with the same class, options and parameter groups")

    def _sum_over_ranks(self, tensor: torch.Tensor) -> None:
        allreduce(tensor, self.algorithm, group=self.group, timeout=self.timeout)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group, on every rank: its parameters get new flat buffers, of which this rank steps its chunk."""
        if not self._built:
            return super().add_param_group(param_group)
        self._refuse_if_taken_over()
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = param_groups_of([param_group], "param_group", keep_frozen=True, require_trainable=False)[0]
        _refuse_sparse([group], "param_group")
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
        self.plan, self._trainable, self.params = plan, self._trainable + [trainable], self.params + trainable
        self._plan_groups.append(len(self.param_groups) - 1)
        self._frozen += [(len(self.param_groups) - 1, p) for p in group["params"] if not p.requires_grad]
        self.flats += ShardPlan([trainable], self.world_size).bind(trainable)  # the new group's buffers, as in `plan`
        self._record_binding()
        new = self._find_pieces()
        if self.grad_shards is not None:  # new buckets and hooks; what is summed so far is kept
            old, self.grad_shards = self.grad_shards, self._gradient_shards(buckets)
            self.grad_shards.adopt(old)
        self.optimizer.add_param_group({"params": [v for _, v in new], **options_of(self.param_groups[-1])})

    @property
    def reduces_gradients(self) -> bool:
        """True at stage 2: DDP must not average the gradients (backward under `no_sync()`); we reduce-scatter them."""
        return self.stage == 2

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

    def _refuse_if_taken_over(self) -> None:
        if self.grad_shards is not None and self.grad_shards.released:
            raise RuntimeError("ZeroRedundancyOptimizer(stage=2): a newer ZeroRedundancyOptimizer was built over "
                               "this one's parameters and took their gradients over; step that one (or build this "
                               "one again to take them back)")

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """Step this rank's shard with its gradient (stage 2: reduce-scattered in backward), all-gather the parameters.

        `closure` (re-computes the loss and its gradients) is called first, and its loss returned;
        `kwargs` go to the inner optimizer's `step`, as torch's.
        """
        loss = None
        if closure is not None:
            if not callable(closure):
                raise TypeError(f"closure must be callable (it re-computes the loss and the gradients), got "
                                f"{closure!r}; pass keyword arguments for the inner optimizer's step by name")
            with torch.enable_grad():
                loss = closure()
        self._notify_join()  # a no-op unless this optimizer is the first of a Join's joinables
        try:
            self._step(own_gradients=True, **kwargs)
        finally:
            self._notified = False
        return loss

    def _step(self, own_gradients: bool, **kwargs) -> None:
        """One step; a rank out of data under Join (`own_gradients=False`) adds zeros at stage 2."""
        self._refuse_if_taken_over()
        if self.grad_shards is not None:
            self.grad_shards.check_finished()
            if not own_gradients:
                self.grad_shards.reduce_zeros()  # the training ranks reduce-scatter their buckets now
        used, training = self._agree_on_step(own_gradients, self._adopt_rebound())
        grads = None
        if self.grad_shards is not None:  # stage 2: the sums, divided as the DDP wrapper divides them
            divisor = self.world_size if self._divide_by_initial else training
            grads = [s / divisor if s is not None else None for s in self.grad_shards.shards]
            starts = [self.plan.bounds(b, self.rank)[0] for b in range(len(self.flats))]
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update(options_of(outer))  # a scheduler or the user may have changed lr
        lent = []  # the pieces given a gradient for this step, which must not keep it
        for j, lo, hi, piece in self.pieces:
            p, (b, start, _) = self.params[j], self.plan.where[j]
            if grads is None:  # stage 1: this rank's .grad (a whole parameter steps with its own)
                if piece is p or p.grad is None:
                    continue
                piece.grad = p.grad.reshape(-1)[lo - start:hi - start]
            else:
                piece.grad = grads[b][lo - starts[b]:hi - starts[b]].view_as(piece) if used[j] else None
            lent.append(piece)
        try:
            self.optimizer.step(**kwargs)
        finally:
            for piece in lent:
                piece.grad = None
            if self.grad_shards is not None and own_gradients:
                self.grad_shards.stand_in()
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            outer.update(options_of(inner))  # keys the inner optimizer added or changed, as torch copies them
        for flat in self.flats:
            all_gather(flat, algorithm=self.algorithm, group=self.group, timeout=self.timeout)

    @torch.no_grad()
    def _adopt_rebound(self) -> int | None:
        """Take back the parameters whose `.data` was rebound since they were bound (`vector_to_parameters`,
        `param.data = t`): their new values are copied into their places in the flat buffers, as
        torch's optimizers would step the new values. Returns the first (index in `params`) whose
        new tensor does not fit its place (another shape, dtype or device), or None.

        Costs one `data_ptr()` per parameter a step (about 0.1 us each), and a copy only when one was rebound.
        """
        if [p.data_ptr() for p in self.params] == self._pointers:
            return None
        unfit = None
        for j, (p, ptr, shape) in enumerate(zip(self.params, self._pointers, self._shapes)):
            if p.data_ptr() == ptr:
                continue
            b, start, end = self.plan.where[j]
            flat = self.flats[b]
            if (p.shape, p.dtype, p.device) != (shape, flat.dtype, flat.device):
                unfit = j if unfit is None else unfit
                continue
            flat[start:end].copy_(p.reshape(-1))
            p.data = flat[start:end].view(shape)
        return unfit

    def _agree_on_step(self, own_gradients: bool, unfit: int | None) -> tuple[list[int], int]:
        """What the ranks bring to this step, summed in one allreduce: every rank raises alike, or all go on.

        Per parameter, how many ranks have its gradient (stage 1: a `.grad`, which DDP averaged;
        stage 2: summed into the shards, whose parameters no rank used are skipped, as torch's
        optimizers skip a parameter without a gradient); then how many ranks train this step, hold
        a `.grad` that no backward handed over (stage 2), hold a parameter rebound to a tensor that
        does not fit its place, or lost the sums of an optimizer they took over; then, per
        parameter frozen when the optimizer was built, how many ranks unfroze it and have its
        gradient. A parameter unfrozen on every rank is sharded now (`_unfreeze`).
        Returns the per-parameter counts (unfrozen ones included) and how many ranks train.
        """
        stage2 = self.grad_shards is not None
        has = ([own_gradients and u for u in self.grad_shards.used] if stage2 else
               [p.grad is not None for p in self.params])
        loose = stage2 and own_gradients and any(real_grad(p) is not None for p in self.params)
        flags = [own_gradients or not stage2, loose, unfit is not None, self._left_behind]
        flags += [p.requires_grad for _, p in self._frozen]
        flags += [(own_gradients or not stage2) and p.grad is not None for _, p in self._frozen]
        counts = torch.tensor(has + flags, dtype=torch.int32, device=self._device)
        self._sum_over_ranks(counts)
        counts = counts.tolist()
        n, f = len(self.params), len(self._frozen)
        has, (training, loose, unfit_ranks, lost), thawed, had = (counts[:n], counts[n:n + 4], counts[n + 4:n + 4 + f],
                                                                  counts[n + 4 + f:])
        if unfit_ranks:
            if unfit is None:
                raise RuntimeError(f"ZeroRedundancyOptimizer: {unfit_ranks} other rank(s) hold a parameter whose "
                                   ".data was rebound to a tensor of another shape, dtype or device than its place "
                                   "in the flat buffers; build the optimizer after changing the model")
            p, shape = self.params[unfit], self._shapes[unfit]
            raise RuntimeError(f"ZeroRedundancyOptimizer: {self._name(p)} (shape {tuple(shape)}, "
                               f"{self.flats[self.plan.where[unfit][0]].dtype}) was rebound (param.data = ...) to "
                               f"a tensor of shape {tuple(p.shape)}, {p.dtype} on {p.device}, which does not fit "
                               "its place in the flat buffers; build the optimizer after changing the model")
        if lost:
            raise RuntimeError(f"ZeroRedundancyOptimizer: on {lost} rank(s) this optimizer took its parameters over "
                               "from an older one that held gradients summed since its zero_grad, in a layout that "
                               "cannot be carried over; call zero_grad() and run backward before step()")
        if loose:  # every rank sees it in the sum, so every rank raises
            raise RuntimeError(f"ZeroRedundancyOptimizer(stage=2): {loose} rank(s) hold a .grad that no backward "
                               "pass handed over (set by hand, or averaged by a DDP whose backward ran outside "
                               "no_sync()); stage 2 reduce-scatters the gradients during backward: run it under "
                               "model.no_sync(), or use stage=1")
        partly = [t for t, c in enumerate(thawed) if 0 < c < self.world_size]
        if partly:
            p = self._frozen[partly[0]][1]
            raise RuntimeError(f"ZeroRedundancyOptimizer: {self._name(p)} of shape {tuple(p.shape)}, frozen when "
                               f"the optimizer was built, requires grad on {thawed[partly[0]]} of {self.world_size} "
                               "ranks; unfreeze it on every rank or on none")
        if any(thawed):
            has += self._unfreeze([t for t, c in enumerate(thawed) if c], had, own_gradients)
        if not stage2:
            self._refuse_partial_gradients(has, training)
        return has, training

    def _name(self, p: torch.Tensor) -> str:
        """A parameter as torch's state_dict numbers it (frozen ones counted), with its group."""
        k = next(k for k, q in enumerate(self._all_params) if q is p)
        g = next(g for g, group in enumerate(self.param_groups) if any(q is p for q in group["params"]))
        return f"parameter {k} (group {g})"

    def _refuse_partial_gradients(self, has: list[int], ranks: int) -> None:
        """Stage 1: a parameter must have a `.grad` on every rank or on none; else every rank raises, naming it.

        Each rank steps its pieces with its own `.grad`, which DDP has averaged. A gradient on some
        ranks only (a parameter used on one rank, outside DDP) would step the parameter in part:
        torch's steps it whole or not at all, by which rank owns it, so neither is the answer.
        """
        partly = [j for j, c in enumerate(has) if 0 < c < ranks]
        if partly:
            j = partly[0]
            raise RuntimeError(f"ZeroRedundancyOptimizer(stage=1): parameter {j} of shape "
                               f"{tuple(self.params[j].shape)} has a .grad on {has[j]} of {ranks} "
                               f"ranks ({len(partly)} such parameter(s)); stage 1 steps each rank's shard with that "
                               "rank's .grad, which must be averaged over the ranks (DistributedDataParallel) "
                               "or None on every rank")

    def _unfreeze(self, thawed: list[int], had: list[int], own_gradients: bool) -> list[int]:
        """Shard the parameters frozen at construction that every rank has unfrozen since (`thawed`: places in
        `_frozen`), as torch's optimizers step a parameter of theirs once it has a gradient.

        They get flat buffers of their own after the others (whose layout, shards and state stay),
        and their pieces join their parameter groups in the inner optimizer. At stage 2 no hook took
        this step's gradients of them: each rank's whole `.grad` is summed over the ranks here, once;
        later backward passes reduce-scatter them with the rest. Returns, for each (in the order
        they join `params`), how many ranks have its gradient.
        """
        by_group: dict[int, list] = {}
        for t in thawed:
            g, p = self._frozen[t]
            by_group.setdefault(g, []).append((p, had[t]))
        added = [[p for p, _ in by_group[g]] for g in sorted(by_group)]
        counts = [c for g in sorted(by_group) for _, c in by_group[g]]
        first, params = len(self.params), [p for ps in added for p in ps]
        self._frozen = [f for t, f in enumerate(self._frozen) if t not in set(thawed)]
        self._trainable += added
        self._plan_groups += sorted(by_group)
        self.plan, self.params = ShardPlan(self._trainable, self.world_size), self.params + params
        buffers = len(self.flats)
        self.flats += ShardPlan(added, self.world_size).bind(params)  # the new buffers, as in `plan`
        self._record_binding()
        for g, piece in self._find_pieces():
            self.optimizer.param_groups[g]["params"].append(piece)
        if self.grad_shards is not None:
            old, self.grad_shards = self.grad_shards, self._gradient_shards(self._buckets(self.plan, self.params))
            self.grad_shards.adopt(old)
            for b in range(buffers, len(self.flats)):
                members = [self.params[j] for j in self.plan.buffers[b]]
                whole = torch.cat([(p.grad if own_gradients and p.grad is not None else torch.zeros_like(p))
                                   .reshape(-1) for p in members])
                self._sum_over_ranks(whole)
                lo, hi = self.plan.bounds(b, self.rank)
                self.grad_shards.shards[b] = whole[lo:hi].clone()
            for j, p in enumerate(params, first):
                self.grad_shards.used[j] = own_gradients and p.grad is not None
                p.grad = None
        return counts

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
        """This rank's shard of the state (each rank saves its own, as a sharded checkpoint).

        After `consolidate_state_dict(to)`, as torch's: the full state on rank `to`, in a plain
        optimizer's format; the other ranks raise.
        """
        if self._consolidated_to is not None:
            return self._full_state_dict()
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


def _refuse_sparse(groups: list[dict], name: str = "params") -> None:
    for g, group in enumerate(groups):
        for p in group["params"]:
            if p.layout != torch.strided:
                raise ValueError(f"{name}: group {g} holds a tensor of layout {p.layout}; ZeroRedundancyOptimizer "
                                 "shards dense tensors only (torch's refuses sparse ones too)")


def _name_of(optimizer_class) -> str:
    """The optimizer's class (or factory) as the ranks compare it: its module and qualified name."""
    name = getattr(optimizer_class, "__qualname__", type(optimizer_class).__name__)
    return f"{getattr(optimizer_class, '__module__', '')}.{name}"


def _options_text(options: dict) -> str:
    """A group's options (or the defaults), sorted by name, as the ranks compare them."""
    return ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
