"""The layout of `ZeroRedundancyOptimizer` (`zero.py`): flat buffers, and the pieces of them this rank steps.

The partition differs from torch's, by design. torch's gives each rank whole parameters, sorted
by size and dealt greedily to the rank with the fewest elements so far (so one rank may hold
much more than another). We shard the flat vector into near-equal chunks, as the ring does,
with the layout of `manualdp.shards.ShardPlan`: one flat buffer per (parameter group, dtype), the
parameters made views of it, and this rank's chunk handed to its optimizer as one piece per
parameter it overlaps: the parameter itself where the chunk holds all of it, else a slice of
the buffer. Elementwise optimizers (SGD, Adam, AdamW, ...) give the same numbers either way, on
averaged gradients. What differs: which tensors `.optim` holds on a rank (`optim.state[p]`
exists only on a rank that owns all of `p`), and a gradient that differs across ranks (a closure
without DDP): both step each element with its owner's gradient, but the owners differ, so pytorch's
`test_step_with_closure`, `test_sharding` and `test_add_param_group` (which assert torch's owners) fail on ours.

The layout grows, never changes: a group added later (`add_param_group`) and a parameter
unfrozen later (`zero_guards.py`) get flat buffers of their own after the others, whose
layout, shards and optimizer state stay.
"""
from __future__ import annotations

import torch

from ...shards import ShardPlan

__all__ = ["ZeroLayout"]


class ZeroLayout:
    """Which pieces of which flat buffers this rank steps (a mixin: it uses the optimizer's plan, params, flats)."""

    @property
    def _all_params(self) -> list[torch.Tensor]:
        """Every parameter of every group, frozen ones too, in the order torch's state_dict numbers them."""
        return [p for g in self.param_groups for p in g["params"]]

    def _find_pieces(self) -> list[tuple[int, torch.Tensor]]:
        """Find this rank's pieces, (parameter, lo, hi, tensor), in the order the inner optimizer numbers them.

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

    def _add_buffers(self, added: list[list[torch.Tensor]], groups: list[int], plan: ShardPlan,
                     buckets: list) -> list[tuple[int, torch.Tensor]]:
        """Bind `added` (one list of parameters per new plan group, of parameter groups `groups`) to flat buffers
        after the others; `plan` and `buckets` are the whole new layout's. Returns the new pieces, as `_find_pieces`.
        """
        params = [p for ps in added for p in ps]
        self.plan, self._trainable, self.params = plan, self._trainable + added, self.params + params
        self._plan_groups += groups
        self.flats += ShardPlan(added, self.world_size).bind(params)  # the new buffers, as in `plan`
        self._record_binding()
        new = self._find_pieces()
        if self.grad_shards is not None:  # new buckets and hooks; what is summed so far is kept
            old, self.grad_shards = self.grad_shards, self._gradient_shards(buckets)
            self.grad_shards.adopt(old)
        return new
