"""Rung 2 of the ladder: after backward, every gradient in one flat buffer, one allreduce.

Rung 1 pays one latency (alpha) per parameter; a ResNet has about a hundred parameters, so
that is a hundred rounds of messages where one would do. Here the gradients are copied into
one buffer (one per dtype), allreduced once and copied back: more memory traffic, far fewer
messages. Backward still finishes before the first byte is sent.
"""
from __future__ import annotations

import torch

from ...buckets import by_dtype, flatten, unflatten_
from ..collectives import allreduce
from .naive import NaiveDDP

__all__ = ["FlatDDP"]


class FlatDDP(NaiveDDP):
    """`NaiveDDP` with one allreduce of all the gradients (per dtype) instead of one per parameter."""

    def sync_gradients(self) -> None:
        reached = self.take_reached()
        untouched = self.unused_everywhere(reached, self.check_step(flag=not all(reached)))
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for grads in by_dtype([p.grad for p in self.params]):
            flat = flatten(grads)
            allreduce(flat, self.algorithm, self.group, timeout=self.timeout, check=False)
            unflatten_(flat.div_(self.world_size), grads)
        self.restore(untouched)  # no rank used these: their .grad as it was
