"""One replica of a run that trains through failures: `manualdp train --fault-tolerant` and `manualdp coordinator`.

    manualdp coordinator --port 29510                        # once; it hosts the store until stopped
    manualdp train --fault-tolerant 127.0.0.1:29510 --replica-id a --min-replicas 2   # one per replica
    manualdp train --fault-tolerant 127.0.0.1:29510 --replica-id b --min-replicas 2

Each replica is one process and one device. Step `s` trains on global batch `s` of the run
(the loader's order, the same on every replica and as in the one-process loop: `_Batches`),
split among the step's quorum as `split_batch` splits it among devices: the member of rank r
in the quorum (its members sorted by id) takes shard r. Its loss is its shard's sum divided by
the global batch and multiplied by the quorum's size, so that the average over the members
(`FaultTolerantDDP`) is the gradient of the whole global batch: a replica that leaves hands its
shard to the others, and the run follows the one-process run on the same batches, whoever is in.

With `sync="local_sgd"` or `"diloco"` (`--local-sgd H`, `--diloco H`) each replica takes H steps
alone on its shard of H global batches (the shards of the block's quorum), then the members
combine (`LocalSGD`, `DiLoCo`); blocks do not cross an epoch's end (its last block may be
shorter), so that every epoch is evaluated on the agreed parameters. A record is then a block.

A replica that joins (a new one, or a killed one started again with the same command) receives
the model, the optimizer and this loop's state (the epoch's running sums and the history so
far) from a member at the highest step, checked by SHA-256, so that every replica's `--json`
ends the same.

With `--checkpoint-dir DIR` each replica also keeps the newest committed state in `DIR/ID/`, and
one JSON line per committed step in `DIR/ID/steps.jsonl` (`spmd/ft/durable.py`): a run whose
replicas all died, or whose coordinator died, started again by the same commands goes on from
there, as if nothing had happened; a replica started after the run ended says so and exits 0.
"""
from __future__ import annotations

import hashlib
import os
import shlex
import time

import torch
from torch import nn

from ..loss import count_correct, logits_of, summed_loss
from ..cost import SYNC_METHODS
from ..spmd.ft import DiLoCo, FaultTolerantDDP, LocalSGD, Manager
from ..spmd.ft.admission import refusals
from ..spmd.ft.signed_store import StoreLost
from ..spmd.ft.guard import guard_settings
from ..spmd.launch import shard
from ..support.checkpoint import loader_generator
from ..support.history import History
from ..train import evaluate
from ..validate import fraction, iterable, learning_rate, nn_module, one_of, positive_int, trainable, xy_pair
from .options import optimizer_factory

__all__ = ["parse_address", "replica_command", "check_replica_id", "train_replica", "shared_settings",
           "parameters_sha256"]


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` as (host, port); ValueError naming the value unless the host is non-empty and 1 <= port <= 65535."""
    if not isinstance(text, str) or text.count(":") < 1:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:29510), got {text!r}")
    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:29510
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"expected HOST:PORT with a host before the colon, got {text!r}")
    if not (port.isascii() and port.isdigit()):  # '²' is a digit to str.isdigit, not to int()
        raise ValueError(f"expected HOST:PORT with a port number after the colon, got {text!r}")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"the port must be from 1 to 65535, got {int(port)} in {text!r}")
    return host, int(port)


def replica_command(host: str, port: int, token_file: str | None = None) -> str:
    """The command that starts a replica of the coordinator at `host:port`, as a user copies it from its first line."""
    command = f"manualdp train --fault-tolerant {host}:{port} --replica-id NAME"
    if token_file is not None:  # absolute: the line works from any folder
        command += f" --token-file {shlex.quote(os.path.abspath(token_file))}"
    return command


def check_replica_id(text: str) -> str:
    """A replica id as `Manager` takes it: non-empty, without spaces or '/'; ValueError naming the value."""
    if not isinstance(text, str) or not text or any(c.isspace() or c == "/" for c in text):
        raise ValueError(f"expected a non-empty name without spaces or '/', got {text!r}")
    return text


def parameters_sha256(net: nn.Module) -> str:
    """SHA-256 of the parameters' bytes, in order: equal on two replicas only if they are bitwise equal."""
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_replica(net: nn.Module, train_iter, test_iter, num_epochs: int, lr: float, manager: Manager, *,
                  loss_fn=None, optimizer=None, momentum: float = 0.0, weight_decay: float = 0.0,
                  progress: bool = True, log=print, sync: str = "ddp", sync_every: int = 1, outer_lr: float = 0.7,
                  outer_momentum: float = 0.9, settings: dict | None = None) -> History:
    """Train `net` as one replica of `manager`'s run for `num_epochs`; the History, the same on every replica.

    `sync`: "ddp" (average the gradients every step), "local_sgd" or "diloco" (H = `sync_every`
    steps alone, then average the parameters, or step the outer Nesterov SGD of `outer_lr` and
    `outer_momentum` on their average change). `settings`: more that every replica must share (the
    command line's seed, model, data), compared with the method's, the optimizer's, the epochs and
    the batch size as each quorum forms (`Manager.require_same`).

    `train_iter` must be a DataLoader (its order is drawn from its sampler, the same on every
    replica). `history.config["fault_tolerant"]` holds, per attempted step, its batch, round,
    members and whether it was committed (with the global batch's mean loss), and the state
    this replica received.
    """
    check_loop_args(net, train_iter, test_iter, num_epochs)
    if not isinstance(manager, Manager):
        raise TypeError(f"manager must be a manualdp.spmd.ft.Manager, got {type(manager).__name__}")
    one_of("sync", sync, SYNC_METHODS)
    if positive_int("sync_every", sync_every) != 1 and sync == "ddp":
        raise ValueError(f"sync_every must be 1 for sync='ddp' (it averages every step), got {sync_every}")
    learning_rate("outer_lr", outer_lr)
    fraction("outer_momentum", outer_momentum)
    make, kwargs = optimizer_factory(optimizer, lr, momentum, weight_decay)
    inner = make(net.parameters(), **kwargs)
    if sync == "ddp":
        ft = FaultTolerantDDP(net, inner, manager)
    elif sync == "local_sgd":
        ft = LocalSGD(net, inner, manager, sync_every)
    else:
        ft = DiLoCo(net, inner, manager, sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum)
    run = Run(train_iter, num_epochs, summed_loss(loss_fn), sync_every if sync != "ddp" else None)
    manager.require_same(**shared_settings(manager, train_iter, num_epochs, settings))
    manager.register_state("loop", run.state_dict, run.load_state_dict)
    size, n = train_iter.batch_size or 0, len(getattr(train_iter, "dataset", ()))
    manager.capacity = size if train_iter.drop_last or not n % max(size, 1) else n % size  # a member needs an example
    bar = progress_bar(run.total, progress, manager.id)
    members = None
    try:
        _, seen = refusals(manager.store, 0)  # the refusals before this replica came are not news
        while manager.step < run.total:
            quorum = ft.start_step()
            if members is None and manager.resumed and log:
                write_line(bar, log,
                           f"replica {manager.id}: resumed from {manager.resumed['path']} at step {manager.step}")
            if manager.step >= run.total:  # resumed from a checkpoint of the run's last step: nothing to take
                manager.should_commit(False)
                break
            if quorum.ids != members and log:
                write_line(bar, log, f"replica {manager.id}: step {manager.step}, quorum of {len(quorum.ids)}: "
                                 f"{', '.join(quorum.ids)} (round {quorum.round})")
            members = quorum.ids
            notes, seen = refusals(manager.store, seen)
            for note in notes if log else ():
                write_line(bar, log, note)  # e.g. "replica c refused: lr 0.2 != 0.1": the run goes on
            record = run.step(ft, quorum) if run.sync_every is None else run.block(ft, quorum)
            if record["committed"] and manager.step % run.per_epoch == 0:
                run.end_epoch(net, test_iter, manager.step // run.per_epoch, bar, log)
            if bar is not None:
                bar.n = manager.step
                bar.set_postfix(quorum=len(quorum.ids), loss=f"{record['loss']:.3f}" if record["committed"] else "-",
                                refresh=False)
                bar.refresh()
        if manager.step >= run.total:
            manager.finish()  # a replica started later is told that the run has ended (spmd/ft/durable.py)
    except StoreLost as e:  # a store call of this loop's own (the refusals), or one the Manager let through
        raise manager.coordinator_lost(e) from None
    finally:
        if bar is not None:
            bar.close()
    run.history.config["fault_tolerant"] = {
        "replica_id": manager.id, "min_replicas": manager.min_replicas, "sync": sync, "sync_every": sync_every,
        **({"outer_lr": outer_lr, "outer_momentum": outer_momentum} if sync == "diloco" else {}),
        "steps": run.records,
        "recoveries": manager.recoveries, "parameters_sha256": parameters_sha256(net)}
    return run.history


def check_loop_args(net: nn.Module, train_iter, test_iter, num_epochs: int) -> None:
    """What a replica's loop (one process or a group's rank) needs of its arguments; the error names the bad one."""
    trainable("net", nn_module("net", net))
    iterable("test_iter", test_iter)
    positive_int("num_epochs", num_epochs)
    if getattr(train_iter, "batch_sampler", None) is None:
        raise TypeError(f"train_iter must be a torch DataLoader with a batch sampler, got {type(train_iter).__name__}")


def shared_settings(manager: Manager, train_iter, num_epochs: int, settings: dict | None = None) -> dict:
    """What every member must share beyond the method's and optimizer's: what travels and what decides the result.

    The epochs and batch size, the allreduce's schedule (`manager.algorithm`: members calling it
    differently would fail the whole quorum's step) and the contribution guard, on or off (its
    norms travel before the average: `spmd/ft/guard.py`), and `settings` (the command line's).
    """
    if not isinstance(manager, Manager):
        raise TypeError(f"manager must be a manualdp.spmd.ft.Manager, got {type(manager).__name__}")
    if settings is not None and not isinstance(settings, dict):
        raise TypeError(f"settings must be a dict or None, got {type(settings).__name__}")
    return {"num_epochs": positive_int("num_epochs", num_epochs), "batch_size": getattr(train_iter, "batch_size", None),
            "algorithm": manager.algorithm, "guard": guard_settings(manager.guard), **(settings or {})}


class Run:
    """The loop's state: the run's batches, this epoch's running sums, the history; a joiner receives the last two."""

    def __init__(self, train_iter, num_epochs: int, loss_fn, sync_every: int | None = None):
        self.batches, self.loss_fn, self.sync_every = _Batches(train_iter, num_epochs), loss_fn, sync_every
        self.batches_per_epoch = len(train_iter)
        if self.batches_per_epoch == 0:
            raise ValueError("train_iter gave no batch: fewer examples than one batch (drop_last)")
        # what manager.step counts: batches (DDP), or blocks of up to H batches that end at an epoch's end
        self.per_epoch = -(-self.batches_per_epoch // (sync_every or 1))
        self.total = num_epochs * self.per_epoch
        self.sums = {"loss": 0.0, "correct": 0.0, "seen": 0, "seconds": 0.0}
        self.history = History()
        self.records: list[dict] = []
        self.started = time.perf_counter()

    def state_dict(self) -> dict:
        h = self.history
        return {"sums": dict(self.sums), "history": [h.train_loss, h.train_acc, h.test_acc, h.epoch_seconds,
                                                     h.samples_per_second]}

    def load_state_dict(self, state: dict) -> None:
        self.sums = dict(state["sums"])
        self.history = History(*[list(x) for x in state["history"]])

    def step(self, ft: FaultTolerantDDP, quorum) -> dict:
        """Train on this replica's shard of global batch `manager.step`; the step's record."""
        b = ft.manager.step
        X, y = self.batches.get(b // self.per_epoch, b % self.per_epoch)
        n, size = len(X), len(quorum.ids)
        Xs, ys = shard(X, y, quorum.rank(ft.manager.id), size)
        out = ft(Xs)
        loss = self.loss_fn(out, ys)
        (loss / n * size).backward()
        # the global batch's loss and correct count: each member's, summed (averaged with the step, times the members)
        totals = torch.tensor([loss.item(), count_correct(logits_of(out).detach(), ys)], dtype=torch.float64)
        committed = ft.step(also=(totals,))
        record = {"step": b, "round": quorum.round, "members": quorum.ids, "committed": committed}
        return self.record(record, totals * size, n)

    def block(self, ft: LocalSGD, quorum) -> dict:
        """Take block `manager.step` (up to H batches, alone on this replica's shards), then combine; its record."""
        k, H, size = ft.manager.step, self.sync_every, len(quorum.ids)
        epoch, first = k // self.per_epoch, (k % self.per_epoch) * H
        length = min(H, self.batches_per_epoch - first)
        totals = torch.zeros(2, dtype=torch.float64)  # this replica's loss and correct count over its shards
        seen = 0
        for j in range(length):
            if j:
                ft.start_step()  # clears the gradients; the quorum is the block's
            X, y = self.batches.get(epoch, first + j)
            Xs, ys = shard(X, y, quorum.rank(ft.manager.id), size)
            out = ft(Xs)
            loss = self.loss_fn(out, ys)
            (loss / len(X) * size).backward()  # the mean over this shard (equal shards): DDP's gradient scale
            totals += torch.tensor([loss.item(), count_correct(logits_of(out).detach(), ys)], dtype=torch.float64)
            seen += len(X)
            # averaged with the block at its end (then times the members): the H global batches' totals
            committed = ft.step(end_block=j == length - 1, also=(totals,))
        record = {"step": k, "batch": epoch * self.batches_per_epoch + first, "local_steps": length,
                  "round": quorum.round, "members": quorum.ids, "committed": committed}
        return self.record(record, totals * size, seen)

    def record(self, record: dict, totals: torch.Tensor, seen: int) -> dict:
        """Keep `record`; if it was committed, add its `totals` (loss, correct count of `seen` examples) to the sums."""
        if record["committed"]:
            record["loss"] = totals[0].item() / seen
            self.sums["loss"] += totals[0].item()
            self.sums["correct"] += totals[1].item()
            self.sums["seen"] += seen
        self.records.append(record)
        return record

    def end_epoch(self, net: nn.Module, test_iter, epoch: int, bar, log) -> None:
        now = time.perf_counter()
        seconds, self.started = now - self.started, now
        s = self.sums
        self.history.record_epoch(s["loss"] / s["seen"], s["correct"] / s["seen"], evaluate(net, test_iter),
                                  seconds, s["seen"] / seconds if seconds > 0 else float("nan"))
        self.sums = {"loss": 0.0, "correct": 0.0, "seen": 0, "seconds": 0.0}
        if log:
            h = self.history
            write_line(bar, log, f"epoch {epoch}: loss {h.train_loss[-1]:.3f}, train acc {h.train_acc[-1]:.3f}, "
                             f"test acc {h.test_acc[-1]:.3f}")


class _Batches:
    """Batch i of epoch e of a DataLoader, as iterating it epoch after epoch gives it, in any order of asking.

    The loader's shuffling generator is saved at the start of every epoch, after a whole pass
    over the epoch before (a pass draws more than the epoch's order: the iterator's seed, and a
    last permutation as the sampler ends), so that a replica that joins at step s starts at its batch.
    """

    def __init__(self, loader, num_epochs: int):
        self.loader, self.generator = loader, loader_generator(loader)
        self.starts = []
        for _ in range(num_epochs if self.generator is not None else 0):
            self.starts.append(self.generator.get_state())
            for _ in loader:
                pass
        self.at, self.it, self.current = None, None, None  # (epoch, i) of `current`, the batch last given

    def get(self, epoch: int, i: int):
        if self.at == (epoch, i):
            return self.current  # a discarded step is taken again on the same batch
        if self.at is None or self.at != (epoch, i - 1):
            if self.generator is not None:
                self.generator.set_state(self.starts[epoch])
            self.it = iter(self.loader)
            for _ in range(i):
                next(self.it)
        self.current, self.at = xy_pair("train_iter", next(self.it)), (epoch, i)
        return self.current


def progress_bar(total: int, enabled: bool, replica_id: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=f"replica {replica_id}", leave=False, dynamic_ncols=True)


def write_line(bar, log, line: str) -> None:
    if bar is not None and log is print:
        bar.write(line)
    else:
        log(line)
