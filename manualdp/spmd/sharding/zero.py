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
from .grad_shards import GradientShards, plan_buckets, real_grad

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
        self._trainable = [[p for p in g["params"] if p.requires_grad] for g in groups]
        self.params = [p for ps in self._trainable for p in ps]
        self.plan = ShardPlan(self._trainable, self.world_size)
        buckets = self._buckets(self.plan, self.params)
        self._agree_on_setup(self.plan, len(self.params), len(buckets), groups)
        # The parameters become views of flat buffers, so that the collectives and the
        # optimizer work in place and a checkpoint loaded into the model is what they see.
        self.flats = self.plan.bind(self.params)
        self._notified = False  # whether this step has told a Join that this rank trains
        self.grad_shards = self._gradient_shards(buckets) if self.stage == 2 else None
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

    def _find_pieces(self) -> None:
        """This rank's pieces: (parameter, lo, hi, tensor), in parameter order.

        The tensor is the parameter itself where this rank's chunk holds all of it (as torch's
        inner optimizer holds whole parameters: `optim.state[p]`), else a slice of its flat buffer.
        """
        self.pieces = []
        for j, lo, hi in self.plan.pieces(self.rank):
            b, start, end = self.plan.where[j]
            whole = (lo, hi) == (start, end)
            self.pieces.append((j, lo, hi, self.params[j] if whole else self.flats[b][lo:hi]))

    def _pieces_of(self, group: int) -> list[torch.Tensor]:
        return [v for j, _, _, v in self.pieces if self.plan.group_of[j] == group]

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
        kept = self.pieces  # the same pieces, and the very tensors the inner optimizer holds
        self.plan, self._trainable, self.params = plan, self._trainable + [trainable], self.params + trainable
        self.flats += ShardPlan([trainable], self.world_size).bind(trainable)  # the new group's buffers, as in `plan`
        self._find_pieces()
        self.pieces[:len(kept)] = kept
        if self.grad_shards is not None:  # new buckets and hooks; what is summed so far is kept
            old, self.grad_shards = self.grad_shards, self._gradient_shards(buckets)
            self.grad_shards.adopt(old)
        self.optimizer.add_param_group({"params": [v for *_, v in self.pieces[len(kept):]],
                                        **options_of(self.param_groups[-1])})

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
            elif real_grad(p) is not None:
                p.grad.zero_()

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
        if self.grad_shards is None:  # stage 1: DDP hands every rank the averages, also a rank out of data
            self._check_gradients_alike()
            grads = None
        else:
            grads, starts, used = self._reduced_grads(own_gradients)
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

    def _check_gradients_alike(self) -> None:
        """Stage 1: a parameter must have a `.grad` on every rank or on none; else every rank raises, naming it.

        Each rank steps its pieces with its own `.grad`, which DDP has averaged. A gradient on some
        ranks only (a parameter used on one rank, outside DDP) would step the parameter in part:
        torch's steps it whole or not at all, by which rank owns it, so neither is the answer.
        """
        has = torch.tensor([p.grad is not None for p in self.params] + [1], dtype=torch.int32, device=self._device)
        self._sum_over_ranks(has)
        counts = has.tolist()
        partly = [j for j, c in enumerate(counts[:-1]) if 0 < c < counts[-1]]
        if partly:
            j = partly[0]
            raise RuntimeError(f"ZeroRedundancyOptimizer(stage=1): parameter {j} of shape "
                               f"{tuple(self.params[j].shape)} has a .grad on {counts[j]} of {counts[-1]} ranks "
                               f"({len(partly)} such parameter(s)); stage 1 steps each rank's shard with that "
                               "rank's .grad, which must be averaged over the ranks (DistributedDataParallel) "
                               "or None on every rank")

    def _reduced_grads(self, own_gradients: bool) -> tuple[list, list[int], list]:
        """Stage 2: this rank's shards of the averaged gradient, where they start in their buffers, which are used."""
        self.grad_shards.check_finished()
        if not own_gradients:
            self.grad_shards.reduce_zeros()  # the training ranks reduce-scatter their buckets now
        # Which parameters has any rank a gradient for (those no rank used are skipped), whether
        # this rank trains, and whether it holds a `.grad` that no backward handed over.
        loose = own_gradients and any(real_grad(p) is not None for p in self.params)
        used = torch.tensor([own_gradients and u for u in self.grad_shards.used] + [own_gradients, loose],
                            dtype=torch.int32, device=self._device)
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
