"""The one-process reference of a fault-tolerant run: the same batches, each step averaged over that step's members.

    losses = reference_run(net, batches, members, lr=0.1)                     # the CLI's way: "split"
    losses = reference_run(net, batches, members, lr=0.1, shards="fixed", replicas=["a", "b", "c"])

`members[k]` lists the replicas in step k's quorum. Two ways to give the replicas their data:
- "split" (`manualdp train --fault-tolerant`): the global batch is split among the step's
  members, so the step's gradient is the whole global batch's, whoever is in; the run equals an
  uninterrupted one;
- "fixed" (torchft's, and `tests/spmd/ft/replica.py`'s): replica i always trains on shard i of
  the global batch, one per replica of `replicas`; a step's gradient is the mean over its members
  of their shards' gradients, so a member that is out takes its shard with it: that step is an
  unbiased step on a smaller batch.
"""
from __future__ import annotations

import torch
from torch import nn

from ..loss import summed_loss
from ..spmd.launch import shard
from ..validate import learning_rate, nn_module, one_of

__all__ = ["reference_run"]


def reference_run(net: nn.Module, batches, members, lr: float, *, shards: str = "split", replicas=None,
                  loss_fn=None) -> list[float]:
    """Train `net` in place with SGD as the replicas of `members` would; each step's mean loss over the data it used."""
    nn_module("net", net)
    learning_rate("lr", lr)
    one_of("shards", shards, ("split", "fixed"))
    batches, members = list(batches), [list(m) for m in members]
    if len(batches) != len(members):
        raise ValueError(f"members must name the members of each of the {len(batches)} steps, got {len(members)}")
    if any(not m for m in members):
        raise ValueError(f"every step needs a member, got {members}")
    if shards == "fixed":
        if not replicas or any(r not in replicas for m in members for r in m):
            raise ValueError(f"shards='fixed' needs replicas, a list holding every member, got {replicas!r}")
    loss_fn = summed_loss(loss_fn)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    losses = []
    for (X, y), ids in zip(batches, members):
        optimizer.zero_grad(set_to_none=True)
        if shards == "split":
            parts, weight = [(X, y)], 1.0 / len(X)  # the members' shards together: the whole batch
        else:
            parts = [shard(X, y, replicas.index(r), len(replicas)) for r in ids]
            weight = 1.0 / sum(len(p[0]) for p in parts)  # the mean over the shards that were there
        total = sum(loss_fn(net(Xs), ys) for Xs, ys in parts) * weight
        total.backward()
        optimizer.step()
        losses.append(total.item())
    return losses
