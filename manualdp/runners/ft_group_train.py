"""One rank of a replica group: `manualdp train --fault-tolerant HOST:PORT --replica-id A` under torchrun.

    manualdp coordinator --port 29510
    torchrun --nproc-per-node 2 -m manualdp train --fault-tolerant 127.0.0.1:29510 --replica-id A --min-replicas 2
    torchrun --nproc-per-node 2 --master-port 29600 -m manualdp train --fault-tolerant 127.0.0.1:29510 \
        --replica-id B --min-replicas 2

A replica is then a group of ranks (torchrun's world), each holding the whole model: plain data
parallelism inside the group, fault tolerance across the groups (`spmd/ft/group.py`'s
`GroupManager`, one per rank). Step `s` trains on global batch `s`, split among the step's
quorum of groups as `ft_train.py` splits it among replicas, then the group's share among its
ranks. A rank's loss is its shard's sum divided by the global batch, times the groups and the
ranks: the sum inside the group divided by its size, then the average over the lane, is the whole
global batch's gradient, whoever is in (the one-process reference: `ft_reference.py`, "split").

A rank that dies takes its group out of the quorum: its other ranks raise `GroupBroken` and exit;
start the whole group again (torchrun's restart does), and rank i receives its state from rank i
of a healthy group. With `--checkpoint-dir DIR` each rank also keeps its committed state on disk
(`spmd/ft/group_disk.py`): groups that all died, or lost their coordinator, started again by the same
commands go on from the newest step every rank of the group holds. Not yet with a group of more than one
rank: `--local-sgd`, `--diloco`, `--zero 1` and `2`.

With `--zero 3` (fault-tolerant HSDP, as torchft's) each group shards the model among its ranks by
`fully_shard` (the gradients reduce-scattered in the group during backward), and rank i's shard is
averaged with rank i of the other groups (its lane); rank i registers only its shard's state (model and
optimizer, as local tensors: `spmd/ft/group_shards.py`), which is what its lane sends to a group started
again and what `--checkpoint-dir` keeps. `--zero` is one of the run's settings: a group with another is refused.

The guard on every contribution (on unless `--nonfinite off`, as for a one-process replica): a
group whose gradients or loss totals are non-finite after the sum inside the group (the same on
its every rank) still takes its part in the lane's sum (its peers wait on it), then votes the step
down, and its rank 0 says so in one line; a group whose own part is finite but whose average is
not (another group's part) votes it down too (`GroupManager`'s guard, which says so in one
line). The step is taken again; a group non-finite `STRIKES` steps in a row is removed (`Removed`,
one line on each of its ranks; the run goes on).
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import nn

from ..loss import count_correct, logits_of, summed_loss
from ..spmd.ft.group import GroupManager
from ..spmd.ft.group_shards import (flat_local_grads, load_local_model_state, load_local_optim_state,
                                   local_model_state, local_optim_state, put_local_grads)
from ..spmd.ft.guard import STRIKES, Removed
from ..spmd.launch import shard
from ..spmd.sharding.fsdp import FSDPModule, full_state_dict, fully_shard
from ..validate import learning_rate, timeout_seconds
from .ft_train import Run, check_loop_args, parameters_sha256, progress_bar, write_line
from .options import optimizer_factory

__all__ = ["group_problem", "train_group_rank", "init_group"]


def group_problem(args) -> str | None:
    """What `manualdp train --fault-tolerant` under torchrun (a replica group) cannot do yet, in one line; None."""
    why = {"--local-sgd": (args.local_sgd is not None, "a group averages its gradients every step"),
           "--diloco": (args.diloco is not None, "a group averages its gradients every step"),
           "--zero": (args.zero not in (None, 3), "a group's ranks hold the whole model, or shard it by --zero 3"),
           "--devices": (args.devices is not None, "every rank of the group is one device"),
           "--algorithm": (args.algorithm is not None, "the groups average by gloo's own allreduce")}
    bad = [f"{option} with --fault-tolerant under torchrun (a replica group): {text}"
           for option, (refused, text) in why.items() if refused]
    return bad[0] if bad else None


def init_group(timeout: float) -> None:
    """Join the replica group's own process group (torchrun's env), waiting longer than a quorum takes."""
    if timeout_seconds("timeout", timeout) is None:
        raise ValueError("timeout must be a positive number of seconds, got None")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=4 * timeout))


def train_group_rank(net: nn.Module, train_iter, test_iter, num_epochs: int, lr: float, manager: GroupManager, *,
                     loss_fn=None, optimizer=None, progress: bool = True, log=print, settings: dict | None = None,
                     guard: bool = True, zero: int | None = None):
    """Train `net` as this rank of `manager`'s replica group for `num_epochs`; the History, the same on every rank.

    `zero=3`: `net` is sharded by `fully_shard` over the group's ranks (HSDP across the groups); each rank
    registers its own shard's state (`spmd/ft/group_shards.py`), which rank i of a recovering group receives.
    """
    check_loop_args(net, train_iter, test_iter, num_epochs)
    learning_rate("lr", lr)
    if not isinstance(manager, GroupManager):
        raise TypeError(f"manager must be a manualdp.spmd.ft.group.GroupManager, got {type(manager).__name__}")
    if not isinstance(guard, bool):
        raise TypeError(f"guard must be True or False, got {guard!r}")
    if zero not in (None, 3):
        raise ValueError(f"zero must be None or 3 (a replica group shards by fully_shard or not at all), got {zero!r}")
    manager.guard = guard  # the run's setting: the manager fails a step whose average is not finite
    if zero == 3:
        shard_in_group(net)
    make, kwargs = optimizer_factory(optimizer, lr, 0.0, 0.0)
    opt = make(net.parameters(), **kwargs)
    run = Run(train_iter, num_epochs, summed_loss(loss_fn))
    # --zero is the run's: a group that shards (or not) where the others do not is refused at admission
    manager.require_same(**{"num_epochs": num_epochs, "batch_size": train_iter.batch_size, "lr": lr,
                            "optimizer": type(opt).__name__, "guard": guard, "zero": zero or 0, **(settings or {})})
    if zero == 3:
        manager.register_state("model", lambda: local_model_state(net), lambda s: load_local_model_state(net, s))
        manager.register_state("optim", lambda: local_optim_state(opt), lambda s: load_local_optim_state(opt, s))
    else:
        manager.register_state("model", net.state_dict, net.load_state_dict)
        manager.register_state("optim", opt.state_dict, opt.load_state_dict)
    manager.register_state("loop", run.state_dict, run.load_state_dict)
    size = train_iter.batch_size or 1
    manager.capacity = max(1, size // manager.size)  # every rank of every group needs an example
    bar = progress_bar(run.total, progress and manager.rank == 0, manager.id)
    members, strikes, seen = None, 0, 0

    def say(line: str) -> None:
        if log and manager.rank == 0:
            write_line(bar, log, line)
    try:
        while manager.step < run.total:
            quorum = manager.start_step()
            if members is None and manager.resumed:
                path, step = manager.resumed["path"], manager.resumed["step"]
                say(f"replica group {manager.id}: resumed from {path} at step {step}")
            if manager.step >= run.total:  # resumed from a checkpoint of the run's last step: nothing to take
                manager.should_commit(False)
                break
            if quorum.ids != members and log and manager.rank == 0:
                write_line(bar, log, f"replica group {manager.id}: step {manager.step}, quorum of {len(quorum.ids)}: "
                                 f"{', '.join(quorum.ids)} (round {quorum.round})")
            members = quorum.ids
            # what this rank's lane received in this step's entry, the bytes that came (said summed over the group)
            received = sum(r.get("bytes", 0) for r in manager.recoveries[seen:])
            seen = len(manager.recoveries)
            record = _group_step(run, net, opt, manager, quorum, guard, say, received)
            strikes = strikes + 1 if record.get("nonfinite") else 0
            if strikes >= STRIKES:
                raise Removed(f"replica group {manager.id!r}, rank {manager.rank}: its contribution was non-finite "
                              f"{strikes} steps in a row (NaN or Inf): removed from the run, which goes on without it")
            if record["committed"] and manager.step % run.per_epoch == 0:
                run.end_epoch(net, test_iter, manager.step // run.per_epoch, bar, log if manager.rank == 0 else None)
            if bar is not None:
                bar.n = manager.step
                bar.refresh()
        manager.finish()  # a group started after the end is told that the run has ended
    finally:
        if bar is not None:
            bar.close()
    run.history.config["fault_tolerant"] = {
        "replica_id": manager.id, "group_size": manager.size, "group_rank": manager.rank, "sync": "ddp",
        "steps": run.records, "recoveries": manager.recoveries, "zero": zero or 0,
        "parameters_sha256": parameters_sha256(_whole(net) if zero == 3 else net)}
    return run.history


def shard_in_group(net: nn.Module) -> None:
    """`fully_shard` each child of `net` that holds parameters, then `net`, over the replica group's own ranks."""
    for child in net.children():  # the default process group: the group's (torchrun's world), as its sums use
        if any(True for _ in child.parameters()):
            fully_shard(child)
    fully_shard(net)


def _whole(net: nn.Module) -> nn.Module:
    """A plain copy of sharded `net` holding the full parameters (a collective of the group): for its digest."""
    full, whole = full_state_dict(net), nn.Module()
    for i, (name, _) in enumerate(net.named_parameters()):  # in the order of the plain model's parameters
        whole.register_parameter(f"p{i}", nn.Parameter(full[name], requires_grad=False))
    return whole


def _group_step(run: Run, net: nn.Module, opt: torch.optim.Optimizer, manager: GroupManager, quorum, guard: bool,
                say, received: int = 0) -> dict:
    """Train on this rank's shard of global batch `manager.step`: sum in the group, average in the lane; the record."""
    b = manager.step
    X, y = run.batches.get(b // run.per_epoch, b % run.per_epoch)
    n, groups = len(X), len(quorum.ids)
    Xg, yg = shard(X, y, quorum.rank(manager.id), groups)
    Xs, ys = shard(Xg, yg, manager.rank, manager.size)
    opt.zero_grad(set_to_none=True)
    try:  # sharded (--zero 3), forward and backward gather and reduce-scatter inside the group
        out = net(Xs)
        loss = run.loss_fn(out, ys)
        (loss / n * groups * manager.size).backward()
    except RuntimeError:  # a rank of the group died there: voting down raises GroupBroken on every rank left
        manager.should_commit(False)
        raise
    params = [p for p in net.parameters() if p.requires_grad]
    sharded = isinstance(net, FSDPModule)  # --zero 3: fully_shard reduce-scattered the gradients in the group
    flat = flat_local_grads(params)  # this rank's shard of each gradient (all of it without --zero 3)
    # this rank's loss and correct count ride along, in float64: summed over the group and the lane, the batch's
    totals = torch.tensor([loss.item(), count_correct(logits_of(out).detach(), ys)], dtype=torch.float64)
    # sharded, each rank holds its own shard: whether any rank's is not finite, summed in the group, judged alike;
    # and the bytes of state this rank's lane received in the step's entry: the recovery's, summed over the group
    side = torch.tensor([0.0 if not sharded or bool(torch.isfinite(flat).all()) else 1.0, received],
                        dtype=torch.float64)
    try:
        for t in ([totals, side] if sharded else [flat, totals, side]):
            dist.all_reduce(t)  # inside the group: plain data parallelism (fully_shard's reduce-scatter averaged)
    except RuntimeError:  # a rank of the group died: voting down raises GroupBroken on every rank left
        manager.should_commit(False)
        raise
    if not sharded:
        flat.div_(manager.size)
    # after the sum inside the group every rank judges the same: its ranks judge alike
    flat_finite = side[0].item() == 0 if sharded else bool(torch.isfinite(flat).all())
    own_finite = not guard or (flat_finite and bool(torch.isfinite(totals).all()))
    # taken part in even when not finite: the lane waits; the manager's guard (on with `guard`) fails a step whose
    # average is not finite, another group's contribution or this one's, on every rank of the lane alike
    ok = manager.average(flat) and manager.average(totals)
    if not own_finite:
        say(f"replica group {manager.id}: step {b}: its contribution is non-finite (NaN or Inf): "
            f"the step is discarded on every member group and taken again")
    committed = manager.should_commit(ok)
    if committed:
        put_local_grads(params, flat)
        opt.step()
    record = {"step": b, "round": quorum.round, "members": quorum.ids, "committed": committed}
    if side[1].item() > 0:  # measured: what the store handed the group's lanes, the state's blobs and digests
        record["received_bytes"] = int(side[1].item())
        say(f"replica group {manager.id}: step {b}: received its state over its {manager.size} lane(s): "
            f"{int(side[1].item())} bytes")
    if not own_finite:
        record["nonfinite"] = True
    return run.record(record, totals * groups, n)
