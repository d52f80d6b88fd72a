"""HSDP's drift check: the replicas of each shard compared across mesh dim 0, as the drop-in compares its replicas.

On a 2-D mesh (replicate, shard) rank (r, s) and rank (r', s) hold the same shard of every parameter:
the all-reduce across replicas (`fsdp_hsdp.py`) gives them the same gradient and their optimizers step
alike, so their shards stay bitwise equal. A user's code that changes one replica's shard (a load or an
edit on one rank, a stale `.grad` stepped on one replica) parts them silently: each trains on, and
`full_state_dict` mixes them. A 1-D mesh replicates nothing: no check there, and no collective.

So as a step's first forward with grad begins, at the steps `ladder.drift.due` names (0, 1, 2, 4, ...
below `every`, then its multiples; a step: a backward pass of the tree that all-reduced across the replicas, so
that replicas accumulating uneven numbers of micro-batches meet in the same check), every rank puts one digest per
local shard (`ladder.drift.digests`) in its replica's row of a table, summed by one checked allreduce
across the replicas: every rank of a column then knows the first parameter whose replicas differ, and
which replica differs from replica 0. The table's last column is the tree's count of all-reduces since its last
optimizer step (`fsdp_hsdp.py`): replicas in step hold the same; one that all-reduced at every micro-batch where the
others did at the last only differs, and is named for that rather than for the drift it causes.
A second allreduce of two numbers per column, over the shard group, tells every rank of the mesh, so that
all raise the same line (the columns that agree would otherwise wait in the next all-gather for peers
that raised). Both carry the check's step in their call check: replicas out of step are named so.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives import allreduce
from ..ladder.drift import digests, due
from ..transport.peers import group_ranks, refused_alike

__all__ = ["tick"]


def tick(unit) -> None:
    """A forward with grad begins a step of `unit`'s tree: compare the replicas' shards if the step is due, once per
    count of steps that all-reduced across the replicas (a forward without backward on one replica, a validation
    pass, or a micro-batch more shifts nothing: its peers meet the same check at their next forward)."""
    step = unit.step
    root, check, number = step.root, step.drift, step.steps
    if root.replicate is None or step.failure is not None or number == check.last:  # 1-D: nothing replicated
        return
    check.last = number
    if due(number, check.every):
        root.worker.submit(_compare, root, number).result()  # in line with the tree's collectives


@torch.no_grad()
def _compare(root, number: int) -> None:  # on the worker thread
    """Raise the same RuntimeError on every rank of the mesh if some column's replicas hold other shards."""
    params = [(u, p) for u in root.tree() for p in u.params]
    replica, replicas = group_ranks(root.replicate)
    shard, shards = group_ranks(root.group)
    table = torch.zeros(len(replicas), len(params) + 1, dtype=torch.int64)
    table[replica, :-1] = torch.tensor(list(digests((str(i), p.local()) for i, (_, p) in enumerate(params)).values()),
                                       dtype=torch.int64)
    # last: the tree's all-reduces since its last optimizer step, equal on replicas in step (`fsdp_hsdp`)
    table[replica, -1] = sum(root.step.since.values())
    allreduce(table, "ring", group=root.replicate, timeout=root.timeout, step=number)
    skewed = (table[:, -1] != table[0, -1]).nonzero().flatten().tolist()
    table = table[:, :-1]
    parted = (table != table[0]).any(0).nonzero().flatten().tolist()  # parameters whose replicas differ
    columns = torch.zeros(len(shards), 2, dtype=torch.int64)  # per column: 1 + the first parted parameter, a replica
    if skewed:  # they parted because they all-reduced unevenly: name that, not its consequence
        columns[shard] = torch.tensor([-1, skewed[0]])
    elif parted:
        first = parted[0]
        columns[shard] = torch.tensor([1 + first, int((table[:, first] != table[0, first]).nonzero()[0, 0])])
    allreduce(columns, "ring", group=root.group, timeout=root.timeout, step=number)
    skewed = [int(r) for k, r in columns.tolist() if k < 0]
    if skewed:
        raise refused_alike(RuntimeError(
            f"rank {dist.get_rank()} (replica {replica}, shard {shard}): fully_shard's HSDP replicas all-reduced a "
            f"different number of times since their last optimizer step (replica 0 and replica {skewed[0]}, at step "
            f"{number}'s drift check): every replica must all-reduce once per step (set_requires_all_reduce(False) "
            "before each micro-batch's backward but the last, True before the last) or at every micro-batch alike"))
    found = [(s, int(k) - 1, int(r)) for s, (k, r) in enumerate(columns.tolist()) if k > 0]
    if not found:
        return
    s, k, r = found[0]
    unit, p = params[k]
    name = f"{unit.name}.{p.name}" if unit.name else p.name
    more = f" (and in {len(found) - 1} more shard column{'s' * (len(found) > 2)})" if len(found) > 1 else ""
    raise refused_alike(RuntimeError(
        f"rank {dist.get_rank()} (replica {replica}, shard {shard}): fully_shard's HSDP replicas parted before step "
        f"{number}: parameter {name}'s shard {s} differs between replica 0 and replica {r}{more} (digests of its "
        "bits); the replicas of a shard must hold the same values (the all-reduced gradients step them alike): a "
        "rank changed or loaded its shard alone, or stepped a stale .grad on one replica "
        "(fully_shard(..., drift_check_every=0) turns this check off)"))
