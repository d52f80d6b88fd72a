"""The guards of `ZeroRedundancyOptimizer` (`zero.py`): the ranks agree, and what changed under it is caught.

Every rank must build the optimizer alike; the ranks compare what each built, at construction
and at `add_param_group` (`_agree_on_setup`), and all raise, naming the field.

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

A gradient that differs across ranks (not averaged) is not compared: each element steps with its
owner's, as torch's steps each parameter with its owner's (`zero_layout.py`). A parameter no rank has a gradient
for is skipped, as torch's optimizers skip it; one with a gradient on some ranks only is refused
at stage 1, on every rank: stepped by its owners' gradients only, it would be stepped in part.
"""
from __future__ import annotations

import torch

from ...shards import ShardPlan, options_of
from ..transport.agree import agree
from .zero_grad_shards import GradientShards, real_grad

__all__ = ["ZeroGuards", "refuse_sparse", "refuse_mixed_types"]


class ZeroGuards:
    """The checks and repairs of `ZeroRedundancyOptimizer` (a mixin: it uses the optimizer's plan, params, flats)."""

    def _agree_on_setup(self, plan: ShardPlan, parameters: int, buckets: int, groups: list[dict]) -> None:
        """Every rank must build alike: stage, optimizer, each group's tensors and options, the layout; else all raise.

        A group's options are compared as given (`groups`), beside the optimizer's `defaults`, so
        another `lr` on one rank is named; so are other groups of the same elements, which would
        otherwise cut other buffers and abort gloo at the first all-gather.
        """
        cls, defaults = self._make
        fields = {"stage": self.stage, "algorithm": self.algorithm, "optimizer_class": _name_of(cls),
                  "defaults": _options_text(defaults), "parameter groups": len(groups),
                  "drift_check_every": self._drift.every}
        for g, group in enumerate(groups):
            fields[f"group {g} tensors"] = " ".join(
                f"{tuple(p.shape)}:{str(p.dtype).replace('torch.', '')}{'' if p.requires_grad else ':frozen'}"
                for p in group["params"])
            fields[f"group {g} options"] = _options_text(options_of(group))
        fields |= {"buffers to shard": len(plan.sizes), "elements to shard": sum(plan.sizes),
                   "parameters to shard": parameters, "buckets": buckets}
        agree("ZeroRedundancyOptimizer", fields, self.group, timeout=self.timeout, check=True,
              hint="every rank must build the optimizer with the same class, options and parameter groups")

    # -- takeover: a newer optimizer over the same parameters

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

    def _refuse_if_taken_over(self) -> None:
        if self.grad_shards is not None and self.grad_shards.released:
            raise RuntimeError("ZeroRedundancyOptimizer(stage=2): a newer ZeroRedundancyOptimizer was built over "
                               "this one's parameters and took their gradients over; step that one (or build this "
                               "one again to take them back)")

    # -- rebound parameters: `param.data = t` since they were bound

    def _record_binding(self) -> None:
        """Where each parameter's data lives in its flat buffer, to see a later `param.data = ...`."""
        self._pointers, self._shapes = [p.data_ptr() for p in self.params], [p.shape for p in self.params]

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

    # -- agreement on the step: one allreduce of flags, then every rank raises alike or all go on

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
            self._refuse_rebound(unfit, unfit_ranks)
        if lost:
            raise RuntimeError(f"ZeroRedundancyOptimizer: on {lost} rank(s) this optimizer took its parameters over "
                               "from an older one that held gradients summed since its zero_grad, in a layout that "
                               "cannot be carried over; call zero_grad() and run backward before step()")
        if loose:  # every rank sees it in the sum, so every rank raises
            raise RuntimeError(f"ZeroRedundancyOptimizer(stage=2): {loose} rank(s) hold a .grad that no backward "
                               "pass handed over (set by hand, or averaged by a DDP whose backward ran outside "
                               "no_sync()); stage 2 reduce-scatters the gradients during backward: run it under "
                               "model.no_sync(), or use stage=1")
        if any(thawed):
            self._refuse_partly_unfrozen(thawed)
            has += self._unfreeze([t for t, c in enumerate(thawed) if c], had, own_gradients)
        if not stage2:
            self._refuse_partial_gradients(has, training)
        return has, training

    def _refuse_rebound(self, unfit: int | None, ranks: int) -> None:
        """A parameter rebound to a tensor that does not fit its place, on `ranks` ranks: this one names it."""
        if unfit is None:
            raise RuntimeError(f"ZeroRedundancyOptimizer: {ranks} other rank(s) hold a parameter whose "
                               ".data was rebound to a tensor of another shape, dtype or device than its place "
                               "in the flat buffers; build the optimizer after changing the model")
        p, shape = self.params[unfit], self._shapes[unfit]
        raise RuntimeError(f"ZeroRedundancyOptimizer: {self._name(p)} (shape {tuple(shape)}, "
                           f"{self.flats[self.plan.where[unfit][0]].dtype}) was rebound (param.data = ...) to "
                           f"a tensor of shape {tuple(p.shape)}, {p.dtype} on {p.device}, which does not fit "
                           "its place in the flat buffers; build the optimizer after changing the model")

    def _name(self, p: torch.Tensor) -> str:
        """A parameter as torch's state_dict numbers it (frozen ones counted), with its group."""
        k = next(k for k, q in enumerate(self._all_params) if q is p)
        g = next(g for g, group in enumerate(self.param_groups) if any(q is p for q in group["params"]))
        return f"parameter {k} (group {g})"

    # -- partial gradients: stage 1 steps each rank's chunk with that rank's .grad

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

    # -- unfreezing: a parameter frozen at construction, unfrozen since

    def _refuse_partly_unfrozen(self, thawed: list[int]) -> None:
        """A parameter frozen at construction must be unfrozen on every rank or on none; else all raise, naming it."""
        partly = [t for t, c in enumerate(thawed) if 0 < c < self.world_size]
        if partly:
            p = self._frozen[partly[0]][1]
            raise RuntimeError(f"ZeroRedundancyOptimizer: {self._name(p)} of shape {tuple(p.shape)}, frozen when "
                               f"the optimizer was built, requires grad on {thawed[partly[0]]} of {self.world_size} "
                               "ranks; unfreeze it on every rank or on none")

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
        plan, buffers = ShardPlan(self._trainable + added, self.world_size), len(self.flats)
        for g, piece in self._add_buffers(added, sorted(by_group), plan, self._buckets(plan, self.params + params)):
            self.optimizer.param_groups[g]["params"].append(piece)
        if self.grad_shards is not None:
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


def refuse_sparse(groups: list[dict], name: str = "params") -> None:
    """Refuse a sparse tensor in `groups`: the flat buffers hold dense ones only."""
    for g, group in enumerate(groups):
        for p in group["params"]:
            if p.layout != torch.strided:
                raise ValueError(f"{name}: group {g} holds a tensor of layout {p.layout}; ZeroRedundancyOptimizer "
                                 "shards dense tensors only (torch's refuses sparse ones too)")


def refuse_mixed_types(tensors: list[torch.Tensor], name: str = "params") -> None:
    """Refuse tensors of several dense types (float32 and float64, or CPU and CUDA), in torch's words."""
    first = torch.typename(tensors[0]) if tensors else None
    for t in tensors[1:]:
        if torch.typename(t) != first:
            raise ValueError(f"{name}: ZeroRedundancyOptimizer only supports using the same dense type for all "
                             f"parameters but got both {first} and {torch.typename(t)}")


def _name_of(optimizer_class) -> str:
    """The optimizer's class (or factory) as the ranks compare it: its module and qualified name."""
    name = getattr(optimizer_class, "__qualname__", type(optimizer_class).__name__)
    return f"{getattr(optimizer_class, '__module__', '')}.{name}"


def _options_text(options: dict) -> str:
    """A group's options (or the defaults), sorted by name, as the ranks compare them."""
    return ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
