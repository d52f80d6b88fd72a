"""The parts of `manualdp.spmd.sharding.zero` that make it a drop-in for torch's `ZeroRedundancyOptimizer`.

- `consolidate_state_dict(to)`: every rank sends its shard's state to rank `to`, which
  stitches each parameter's pieces back together; its `state_dict()` is then a plain
  optimizer's (full-size tensors keyed by parameter index, and `param_groups`), as torch's.
- `state_dict()`: that full state, on rank `to` only; elsewhere, or before any consolidation, torch's
  error (a rank's own shard is `shard_state_dict()`).
- `load_state_dict` of such a full state (from a consolidation, or from a plain optimizer):
  each rank keeps the slices of its own pieces.
- `Joinable`: in `Join([model, opt])` a rank out of data still runs the step's collectives.

Our shards are slices of flat buffers, not whole tensors, so a parameter's state may be split
over ranks; an elementwise optimizer's state (momentum, Adam's moments) is a slice of the
parameter's, and its scalars (Adam's `step`) are the same on every piece.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable, JoinHook

from ...shards import options_of
from ...validate import boolean, index
from ..transport.agree import agree

__all__ = ["TorchCompat"]


def _elementwise(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _copied(value):
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


class TorchCompat(Joinable):
    """torch's full state and Join for `ZeroRedundancyOptimizer` (a mixin: it uses the optimizer's plan and pieces)."""

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on rank `to` (call it on every rank), for its `state_dict()`."""
        index("to", to, self.world_size, "the ranks of the group")
        # the same `to` everywhere, or every rank raises: a gather rooted at two ranks would wait out the timeout
        agree("ZeroRedundancyOptimizer.consolidate_state_dict's call", {"to": to}, self.group, timeout=self.timeout,
              check=True, hint="every rank must call consolidate_state_dict with the same `to`")
        shard = self.optimizer.state_dict()["state"]
        sizes = [hi - lo for _, lo, hi, _ in self.pieces]
        bad = [f"{name} of piece {i}" for i, values in shard.items() for name, v in values.items()
               if _elementwise(v) and v.numel() != sizes[i]]
        refused = torch.tensor([len(bad)], dtype=torch.int32, device=self._device)
        self._sum_over_ranks(refused)  # every rank raises, or none
        if int(refused):
            raise ValueError(f"cannot consolidate: the optimizer keeps state that is not elementwise "
                             f"({', '.join(bad[:3]) or 'on another rank'}), so its pieces do not join into "
                             "full tensors")
        shard = {i: {name: v.cpu() if isinstance(v, torch.Tensor) else v for name, v in values.items()}
                 for i, values in shard.items()}
        shards = [None] * self.world_size if self.rank == to else None
        dist.gather_object(shard, shards, dst=self.peers[to], group=self.group)
        self._consolidated_to = to
        self._full_state = self._stitch(shards) if self.rank == to else None

    def _stitch(self, shards: list[dict]) -> dict:
        """The full state, keyed by torch's parameter index, from every rank's shard (keyed by piece)."""
        parts: dict[int, list] = {}  # parameter -> [(lo, piece's state)] from every rank
        for rank, shard in enumerate(shards):
            for i, (j, lo, _) in enumerate(self._pieces_in_order(rank)):
                parts.setdefault(j, []).append((lo, shard.get(i)))
        number = {id(p): k for k, p in enumerate(self._all_params)}
        state = {}
        for j, pieces in parts.items():
            pieces = [s for _, s in sorted(pieces, key=lambda t: t[0])]
            if any(s is None for s in pieces):  # not stepped yet (no rank steps a parameter in part)
                continue
            p = self.params[j]
            state[number[id(p)]] = {name: torch.cat([s[name].reshape(-1) for s in pieces]).view(p.shape)
                                    if _elementwise(v)
                                    else _copied(v) for name, v in pieces[0].items()}
        return dict(sorted(state.items()))

    def _full_state_dict(self) -> dict:
        """The full state, as torch's: on rank `to` after `consolidate_state_dict(to)`; other ranks raise, in torch's
        words (a rank's own shard: `shard_state_dict()`)."""
        if self._full_state is None:  # torch's words
            where = ("" if self._consolidated_to is None
                     else f" (it was consolidated on rank {self._consolidated_to})")
            raise RuntimeError("Optimizer state has not been consolidated on this rank. Please call "
                               f"`consolidate_state_dict(to={self.rank})` on all ranks beforehand if you meant "
                               f"to save the global state{where}; for this rank's shard alone (a sharded "
                               "checkpoint), call shard_state_dict().")
        full = torch.optim.Optimizer.state_dict(self)  # param_groups as torch numbers them; our own state is empty
        full["state"] = {k: {name: _copied(v) for name, v in values.items()} for k, values in self._full_state.items()}
        return full

    def _load_full_state_dict(self, state: dict) -> None:
        """Load this rank's slices of a plain optimizer's full state; checked whole before anything changes."""
        saved_groups = state["param_groups"]
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state has {len(saved_groups)} parameter groups; this optimizer has "
                             f"{len(self.param_groups)}")
        for g, (saved, ours) in enumerate(zip(saved_groups, self.param_groups)):
            if not isinstance(saved, dict) or len(saved.get("params", ())) != len(ours["params"]):
                raise ValueError(f"state's parameter group {g} does not hold {len(ours['params'])} parameters, "
                                 "as this optimizer's does")
        # Saved indices name parameters by position, group by group, as torch's load_state_dict reads them.
        param_of = {k: p for saved, ours in zip(saved_groups, self.param_groups)
                    for k, p in zip(saved["params"], ours["params"])}
        plan_index = {id(p): j for j, p in enumerate(self.params)}
        by_param = {}
        for k, values in state["state"].items():
            if k not in param_of:
                raise ValueError(f"state holds state for parameter {k!r}, which no parameter group names")
            p = param_of[k]
            for name, v in values.items():
                if _elementwise(v) and v.numel() != p.numel():
                    raise ValueError(f"state's {name} for parameter {k} has {v.numel()} elements; the parameter "
                                     f"has {p.numel()}")
            if id(p) in plan_index:  # a frozen parameter has nothing to shard
                by_param[plan_index[id(p)]] = values
        inner = {}  # keyed by piece, each tensor shaped as its piece (a whole parameter's shape, or flat)
        for i, (j, lo, hi, piece) in enumerate(self.pieces):
            if j in by_param:
                start = self.plan.where[j][1]
                inner[i] = {name: v.reshape(-1)[lo - start:hi - start].clone().view(piece.shape) if _elementwise(v)
                            else _copied(v) for name, v in by_param[j].items()}
        groups = [{**options_of(saved), "params": [i for i, (j, *_) in enumerate(self.pieces)
                                                   if self._group_of(j) == g]}
                  for g, saved in enumerate(saved_groups)]
        self.optimizer.load_state_dict({"state": inner, "param_groups": groups})
        for outer, saved in zip(self.param_groups, saved_groups):
            outer.update(options_of(saved))

    def join_hook(self, **kwargs) -> JoinHook:
        """Join's hook: a rank out of data runs each step's collectives
        (`divide_by_initial_world_size`: default True)."""
        self._divide_by_initial = boolean("divide_by_initial_world_size",
                                          kwargs.get("divide_by_initial_world_size", True))
        return _JoinedRank(self)

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self):
        return self.process_group


class _JoinedRank(JoinHook):
    """While others train: step with them (stage 1: DDP's averages; stage 2: zeros into the reduce-scatter)."""

    def __init__(self, zero: TorchCompat) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        with torch.no_grad():
            self.zero._step(own_gradients=False)
