"""The full training loops: epochs, a progress bar, checkpoints and resume, the non-finite guard.

`train` drives a list of devices from one process (the single controller); `train_spmd` is
one rank of a torchrun job. Both run the one epoch loop, `run_epochs`; they differ only in
how a step is taken, how an epoch's totals are gathered and what a checkpoint holds, which
`SingleController` and `OneRank` say.
"""
from __future__ import annotations

import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from ..buckets import DEFAULT_BUCKET_CAP_MB
from ..guard import NonFiniteGuard
from ..replicate import copy_params_, replicate
from ..schedule import ALGORITHMS, COLLECTIVES
from ..spmd.ddp.wrapper import DistributedDataParallel
from ..spmd.sharding.fsdp import fully_shard
from ..spmd.launch import rank_device, shard
from ..spmd.collectives import allreduce
from ..spmd.transport.peers import PeerError
from ..spmd.sampler import ShardedBatchSampler
from ..spmd.auto.tune import ENGINE_ALGORITHMS
from ..spmd.sharding.zero import ZeroRedundancyOptimizer as SpmdZero
from ..support.checkpoint import TrainingState, check_checkpoint_dir, check_layout, lock_checkpoint_dir, remove_orphans
from ..support.files import write_json_atomic
from ..support.history import History
from ..support.trace import Trace
from ..loss import count_correct, logits_of, summed_loss
from ..train import StepResult, evaluate, train_batch
from ..zero import ShardedOptimizer
from ..zero3 import Zero3
from ..validate import check_devices, iterable, nn_module, trainable, xy_pair
from .options import RunOptions, optimizer_factory
from .agree import agree_all_saved, agree_all_succeed, agree_on_checkpoint, agree_on_run_id, agree_on_settings
from .timeline import Timeline, merge_ranks

__all__ = ["train", "train_spmd", "run_epochs", "SingleController", "OneRank", "optimizer_factory"]


def train(
    net: nn.Module,
    train_iter,
    test_iter,
    devices,
    num_epochs: int,
    lr: float,
    *,
    loss_fn=None,
    algorithm: str | None = None,
    bucket_cap_mb: float | None = None,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nonfinite: str | None = "raise",
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    config: dict | None = None,
    progress: bool = True,
    log=print,
    optimizer=None,
    zero: int | None = None,
    trace: str | None = None,
) -> History:
    """Train `net` on `devices` with SGD; afterwards `net` holds the trained parameters.

    `optimizer` (a torch.optim class or factory, default SGD) is built with `lr`, and with
    `momentum` and `weight_decay` where they are not 0; `zero=1` or `2` shards it (`manualdp.zero`),
    `zero=3` the parameters too (`manualdp.zero3`; no `trace`). `algorithm` (default: "naive") is the
    allreduce's; with `zero=3` there is none, and ZeRO-3's all-gathers and reduce-scatters run by "ring" only.
    `trace=PATH` writes a Chrome trace (Perfetto) of every step, one track per device, and
    puts its summary (overlap, exposed communication) in `history.config["timeline"]` and its
    events in `history.trace` (in memory only, for `manualdp.support.trace.plot_trace`).

    With `checkpoint_dir`, a checkpoint is written after every epoch and every
    `checkpoint_every` steps; `resume=True` continues from the newest readable one, and the
    result is bitwise what an uninterrupted run gives (same seed, CPU). Resume refuses a
    checkpoint written with other options (only `num_epochs` may change); `config` adds
    options the loop cannot see (seed, batch size, data) to that identity.
    """
    trainable("net", nn_module("net", net))
    if algorithm is None:
        algorithm = "ring" if zero == 3 else "naive"
    opts = RunOptions.of(locals()).checked(ALGORITHMS)
    if opts.zero == 3 and opts.algorithm not in COLLECTIVES["all_gather"]:
        raise ValueError(f"algorithm={opts.algorithm!r} with zero=3: ZeRO-3 has no allreduce, and its all-gathers and "
                         "reduce-scatters run by 'ring' only; leave algorithm out, or pass 'ring'")
    if opts.zero == 3 and opts.trace is not None:
        raise ValueError(f"trace={opts.trace!r} is not supported with zero=3 (ZeRO-3's step has no timeline yet): "
                         "pass trace=None, or zero=1 or 2")
    devices = check_devices(devices)
    iterable("train_iter", train_iter)
    iterable("test_iter", test_iter)
    if opts.checkpoint_dir is not None:
        check_checkpoint_dir(opts.checkpoint_dir, opts.resume)
        check_layout(opts.checkpoint_dir, per_rank=False)
    release = lock_checkpoint_dir(opts.checkpoint_dir) if opts.checkpoint_dir is not None else (lambda: None)
    try:
        return _train(net, train_iter, test_iter, devices, opts)
    finally:
        release()


def _train(net, train_iter, test_iter, devices, opts: RunOptions) -> History:
    if opts.checkpoint_dir is not None:
        remove_orphans(opts.checkpoint_dir)
    replicas = replicate(net, devices)
    make, kwargs = optimizer_factory(opts.optimizer, opts.lr, opts.momentum, opts.weight_decay)
    if opts.zero == 3:
        return _train_zero3(net, replicas, make, kwargs, train_iter, test_iter, devices, opts)
    if opts.zero:
        sharded = ShardedOptimizer(replicas, make, stage=opts.zero, **kwargs)
        optimizers, saved = sharded.per_device(), [sharded]  # a checkpoint holds every device's shard
    else:
        optimizers = saved = [make(r.parameters(), **kwargs) for r in replicas]
    history = History(config=opts.history_config(devices=[str(d) for d in devices]))
    identity = opts.identity(net, num_devices=len(devices), device_type=devices[0].type)
    loop = TrainingState(train_iter, opts.checkpoint_dir, identity)
    if opts.resume:
        state = loop.resume(replicas, saved, history)
        if opts.log:
            opts.log(f"resumed from {state['path']} (epoch {state['epoch'] + 1}, step {state['global_step']})"
                     if state is not None else f"no checkpoint in {opts.checkpoint_dir}: starting from the beginning")
    timeline = (Timeline(Trace(), replicas, [f"dev{i}" for i in range(len(devices))], optimizers,
                         single_controller=True)
                if opts.trace is not None else None)
    mode = SingleController(replicas, optimizers, devices, summed_loss(opts.loss_fn), opts.algorithm,
                            opts.bucket_cap_mb, opts.nonfinite, test_iter, saved)
    run_epochs(mode, loop, history, opts.num_epochs, opts.checkpoint_every, opts.progress, opts.log)
    if timeline is not None:
        history.config["timeline"] = timeline.trace.summary(timeline.steps)
        history.trace = timeline.trace.to_dict()  # for a plot: `trace` may be a FIFO or stdout, never read back
        timeline.trace.save(opts.trace)
    copy_params_(net, replicas[0])
    return history


def _train_zero3(net, replicas, make, kwargs, train_iter, test_iter, devices, opts: RunOptions) -> History:
    """`_train` for ZeRO-3: the step is `Zero3.train_batch`; `net` is the whole model, put together from the shards
    to evaluate and to checkpoint, and a checkpoint's optimizer state is every device's shards."""
    sharded = Zero3(replicas, make, algorithm=opts.algorithm, **kwargs)
    history = History(config=opts.history_config(devices=[str(d) for d in devices]))
    loop = TrainingState(train_iter, opts.checkpoint_dir, opts.identity(net, num_devices=len(devices),
                                                                        device_type=devices[0].type))
    if opts.resume:
        state = loop.resume([net], [sharded], history)
        if opts.log:
            opts.log(f"resumed from {state['path']} (epoch {state['epoch'] + 1}, step {state['global_step']})"
                     if state is not None else f"no checkpoint in {opts.checkpoint_dir}: starting from the beginning")
    mode = FullySharded(sharded, net, devices, summed_loss(opts.loss_fn), opts.nonfinite, test_iter)
    run_epochs(mode, loop, history, opts.num_epochs, opts.checkpoint_every, opts.progress, opts.log)
    mode.gather()
    return history


def train_spmd(
    net: nn.Module,
    train_iter,
    test_iter,
    num_epochs: int,
    lr: float,
    *,
    loss_fn=None,
    algorithm: str = "auto",
    bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nonfinite: str | None = "auto",
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    config: dict | None = None,
    timeout: float | None = None,
    device=None,
    progress: bool = True,
    log=print,
    optimizer=None,
    zero: int | None = None,
    trace: str | None = None,
) -> History | None:
    """Train `net` with SGD on this rank's slice of every global batch; the History on rank 0, None elsewhere.

    Every rank must iterate the same global batches (same data, same seed), or, with a loader
    from `manualdp.spmd.shard_loader`, its own shard of each of them. Each rank's loss
    is its shard's sum divided by the global batch and multiplied by the world size, so that
    the average over ranks that DDP takes is the one-process gradient of the global batch.
    `nonfinite`, `checkpoint_dir`, `checkpoint_every` and `resume` work as in `train`;
    `config` and the resume checks work as in `train`; `timeout` (seconds, default: the
    process group's) bounds every wait for a peer.
    `optimizer` and `zero` work as in `train` (`manualdp.spmd.sharding.zero`); ZeRO-2 takes no `nonfinite`
    guard, since before its reduce-scatter the ranks hold different gradients and would disagree:
    the default, `"auto"`, is `"raise"` without ZeRO-2 and no check with it. With ZeRO-3 each rank checks its
    shards' gradients and the ranks decide together (`FullyShardedRank.gradients_pass`).
    """
    trainable("net", nn_module("net", net))
    if nonfinite == "auto":  # the default: check wherever every rank holds the averaged gradients
        nonfinite = None if zero == 2 else "raise"
    opts = RunOptions.of(locals()).checked(ENGINE_ALGORITHMS)
    iterable("train_iter", train_iter)
    iterable("test_iter", test_iter)
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call manualdp.spmd.init_from_env() first")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if opts.checkpoint_dir is not None:
        check_checkpoint_dir(opts.checkpoint_dir, opts.resume)  # also refuses a single-controller run's folder
        check_checkpoint_dir(os.path.join(opts.checkpoint_dir, f"rank{rank}"), opts.resume)
    device = torch.device(opts.device) if opts.device is not None else rank_device()
    return _train_spmd(net, train_iter, test_iter, opts, rank, world_size, device)


def _train_spmd(net, train_iter, test_iter, opts: RunOptions, rank: int, world_size: int, device) -> History | None:
    algorithm, timeout, log, checkpoint_dir = opts.algorithm, opts.timeout, opts.log, opts.checkpoint_dir

    if opts.zero == 2 and opts.nonfinite is not None:
        raise ValueError(f"nonfinite={opts.nonfinite!r} needs the averaged gradients on every rank; ZeRO-2 "
                         "has only shards: pass nonfinite=None or zero=1")
    if opts.zero == 3 and algorithm not in ("auto", "ring"):  # fully_shard's all-gathers and reduce-scatters: ring
        raise ValueError(f"algorithm={algorithm!r}: ZeRO-3's all-gathers and reduce-scatters run the ring schedule; "
                         "leave algorithm out or pass 'ring'")
    make, kwargs = optimizer_factory(opts.optimizer, opts.lr, opts.momentum, opts.weight_decay)
    if opts.zero == 3:  # no wrapper: the shards' gradients are averaged by fully_shard's reduce-scatters
        model = FullyShardedModel(net.to(device), timeout, Trace(pid=rank) if opts.trace is not None else None)
        optimizer = make(net.parameters(), **kwargs)  # this rank's shards
    else:
        # rebuild_buckets=False: the single controller's buckets, so that the sums match it bit for bit
        model = DistributedDataParallel(net.to(device), bucket_cap_mb=opts.bucket_cap_mb, algorithm=algorithm,
                                        timeout=timeout, rebuild_buckets=False)
        optimizer = (SpmdZero(net.parameters(), make, stage=opts.zero, timeout=timeout, **kwargs) if opts.zero
                     else make(net.parameters(), **kwargs))
    history = History(config=opts.history_config(world_size=world_size, backend=dist.get_backend(),
                                                  device=str(device)))
    identity = opts.identity(net, world_size=world_size, backend=dist.get_backend(), device_type=device.type)
    hyper = {f"{k} (group {i})": v for i, g in enumerate(optimizer.param_groups) for k, v in g.items() if k != "params"}
    agree_on_settings({**identity, **hyper}, timeout)  # e.g. a learning rate that differs
    rank_dir = os.path.join(checkpoint_dir, f"rank{rank}") if checkpoint_dir is not None else None
    if checkpoint_dir is not None:
        check_layout(checkpoint_dir, per_rank=True)
    present = rank_dir is not None and os.path.isdir(rank_dir)  # the lock makes the folder; was it there?
    release, problem = (lambda: None), None
    if rank_dir is not None:
        try:
            release = lock_checkpoint_dir(rank_dir)
        except (OSError, ValueError) as e:
            problem = e
    try:
        agree_all_succeed(problem, device, algorithm, timeout)
        loop = TrainingState(train_iter, rank_dir, identity)
        loop.run_id = agree_on_run_id(loop.run_id, device, algorithm, timeout)
        if opts.resume:
            remove_orphans(rank_dir)
            state = agree_on_checkpoint(rank_dir, device, algorithm, timeout, fits=loop.fits(net), log=log,
                                        present=present)
            if state is None and log and rank == 0:
                log(f"no checkpoint in {checkpoint_dir}: starting from the beginning")
            if state is not None:
                loop.check_identity(state)  # the same state on every rank: all refuse, or none
                loop.restore(state, [net], [optimizer], history)
                if log and rank == 0:
                    log(f"resumed from {state['path']} (epoch {state['epoch'] + 1}, step {state['global_step']}) "
                        f"on {world_size} ranks")
        timeline = None
        if opts.trace is not None:
            if model.recorder is None:  # (ZeRO-3's was handed to fully_shard)
                model.recorder = Trace(pid=rank)
            timeline = Timeline(model.recorder, [net], ["compute"], [optimizer], single_controller=False)
        sharded = getattr(train_iter, "batch_sampler", None)
        sharded = sharded if isinstance(sharded, ShardedBatchSampler) else None  # see manualdp.spmd.shard_loader
        mode = (FullyShardedRank if opts.zero == 3 else OneRank)(
            model, optimizer, summed_loss(opts.loss_fn), opts.nonfinite, device, algorithm, timeout, test_iter, sharded)
        run_epochs(mode, loop, history, opts.num_epochs, opts.checkpoint_every, opts.progress, log)
        if timeline is not None:
            timeline.close_backward()
            history.config["timeline"] = timeline.trace.summary(timeline.steps)  # this rank's
            merged = merge_ranks(timeline.trace)
            if merged is not None:
                write_json_atomic(opts.trace, merged)
                history.trace = merged  # rank 0's, as in `train`
    finally:
        release()
    return history if rank == 0 else None


class FullyShardedModel(nn.Module):
    """`net` with `fully_shard` applied to each child that has parameters (a container's children), then to
    itself: what `OneRank` needs of a wrapper (`rank`, `world_size`, `module`, `recorder`)."""

    def __init__(self, net: nn.Module, timeout: float | None, recorder=None):
        super().__init__()
        self.module, self.recorder = net, recorder
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        children = list(net.children())
        while children:
            child = children.pop(0)
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):  # a container never runs a forward: its children
                children[:0] = list(child.children())
            elif any(True for _ in child.parameters()):
                fully_shard(child, timeout=timeout, recorder=recorder)
        fully_shard(net, timeout=timeout, recorder=recorder)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def run_epochs(mode, loop: TrainingState, history: History, num_epochs: int, checkpoint_every: int | None,
               progress: bool, log) -> None:
    """The epoch loop of both modes: train on every batch, then gather, evaluate, record and checkpoint."""
    try:
        _run_epochs(mode, loop, history, num_epochs, checkpoint_every, progress, log)
    except OSError as e:
        e.history = history  # the epochs finished so far: the caller may still save them
        raise
    except KeyboardInterrupt as e:
        e.step = loop.global_step  # the steps done when Ctrl-C came: `manualdp train` says so
        raise


def _run_epochs(mode, loop, history, num_epochs, checkpoint_every, progress, log) -> None:
    say = log if log and mode.is_main else (lambda _: None)
    for epoch in range(loop.epoch, num_epochs):
        mode.train()
        start = time.perf_counter()
        batches = _progress(loop.batches(epoch), progress and mode.is_main, f"epoch {epoch + 1}/{num_epochs}",
                            _len(loop.train_iter))
        for batch in batches:
            X, y = xy_pair("train_iter", batch)
            n = mode.global_size(X, loop)
            if n < mode.parts:  # typically an epoch's last batch (drop_last=True avoids it); every rank skips it
                say(f"epoch {epoch + 1}: skipped a batch of {n}, fewer examples than the {mode.parts} {mode.what}")
                continue
            result = mode.step(X, y, n, loop.global_step)
            loop.record(result, n)
            if result.skipped:
                say(f"step {loop.global_step - 1}: non-finite gradient, update skipped{mode.everywhere}")
            if hasattr(batches, "set_postfix"):
                batches.set_postfix(**mode.postfix(loop), refresh=False)
            if checkpoint_every and loop.global_step % checkpoint_every == 0:
                mode.save(loop, history)
        if loop.seen == 0:
            raise ValueError(f"train_iter gave no usable batch in epoch {epoch + 1}")
        seconds = loop.seconds + time.perf_counter() - start
        loss_sum, correct = mode.totals(loop, epoch)
        if mode.is_main:
            seen = max(loop.seen, 1)
            history.record_epoch(loss_sum / seen, correct / seen, mode.evaluate(), seconds,
                                 loop.seen / seconds if seconds > 0 else float("nan"))
            say(f"epoch {epoch + 1}: loss {history.train_loss[-1]:.3f}, train acc {history.train_acc[-1]:.3f}, "
                f"test acc {history.test_acc[-1]:.3f}, {seconds:.1f} sec/epoch, "
                f"{history.samples_per_second[-1]:.0f} samples/s{mode.suffix}")
        loop.end_epoch()
        if loop.checkpoint_dir is not None:
            mode.save(loop, history)


class SingleController:
    """How `run_epochs` trains a list of replicas from one process."""

    is_main = True
    what = "devices"
    everywhere = ""  # nothing to add to "update skipped"
    suffix = ""

    def __init__(self, replicas, optimizers, devices, loss_fn, algorithm, bucket_cap_mb, nonfinite, test_iter,
                 saved=None):
        self.replicas, self.optimizers, self.devices = replicas, optimizers, devices
        self.saved = saved if saved is not None else optimizers  # what a checkpoint holds (ZeRO: the whole optimizer)
        self.loss_fn, self.algorithm, self.bucket_cap_mb = loss_fn, algorithm, bucket_cap_mb
        self.nonfinite, self.test_iter = nonfinite, test_iter
        self.parts = len(devices)

    def train(self) -> None:
        for r in self.replicas:
            r.train()

    def global_size(self, X, loop) -> int:
        return len(X)

    def step(self, X, y, n: int, step: int) -> StepResult:
        return train_batch(X, y, self.replicas, self.optimizers, self.devices, self.loss_fn, algorithm=self.algorithm,
                           bucket_cap_mb=self.bucket_cap_mb, nonfinite=self.nonfinite, step=step)

    def postfix(self, loop) -> dict:
        return {"loss": f"{loop.loss_sum / loop.seen:.3f}", "acc": f"{loop.correct / loop.seen:.3f}"}

    def totals(self, loop, epoch: int) -> tuple[float, float]:
        return loop.loss_sum, loop.correct

    def evaluate(self) -> float:
        return evaluate(self.replicas[0], self.test_iter, self.devices[0])

    def save(self, loop, history) -> None:
        loop.save(self.replicas, self.saved, history)


class FullySharded(SingleController):
    """How `run_epochs` trains with ZeRO-3 (`manualdp.zero3`): the replicas hold shards, `net` the whole model."""

    def __init__(self, sharded: Zero3, net: nn.Module, devices, loss_fn, nonfinite, test_iter):
        super().__init__(sharded.replicas, [], devices, loss_fn, sharded.algorithm, None, nonfinite, test_iter,
                         [sharded])
        self.sharded, self.net = sharded, net

    def step(self, X, y, n: int, step: int) -> StepResult:
        return self.sharded.train_batch(X, y, self.loss_fn, nonfinite=self.nonfinite, step=step)

    @torch.no_grad()
    def gather(self) -> None:
        """Put the whole model together in `net` (its parameters, and replica 0's buffers)."""
        for p, full in zip(self.net.parameters(), self.sharded.full_parameters()):
            p.copy_(full)
        for b, mine in zip(self.net.buffers(), self.replicas[0].buffers()):
            b.copy_(mine)

    def evaluate(self) -> float:
        self.gather()
        return evaluate(self.net, self.test_iter)

    def save(self, loop, history) -> None:
        self.gather()
        loop.save([self.net], self.saved, history)


class OneRank:
    """How `run_epochs` trains this rank's module, wrapped in manualdp's DDP, on its shard of every batch."""

    what = "ranks"
    everywhere = " on every rank"

    def __init__(self, model: DistributedDataParallel, optimizer, loss_fn, nonfinite, device, algorithm, timeout,
                 test_iter, sharded: ShardedBatchSampler | None = None):
        self.model, self.optimizer, self.loss_fn, self.nonfinite = model, optimizer, loss_fn, nonfinite
        self.device, self.algorithm, self.timeout, self.test_iter = device, algorithm, timeout, test_iter
        self.sharded = sharded  # the loader yields this rank's shards, not global batches
        self.parts = model.world_size
        self.is_main = model.rank == 0
        self.suffix = f" on {model.world_size} ranks"

    def train(self) -> None:
        self.model.train()

    def global_size(self, X, loop) -> int:
        return self.sharded.global_size(loop.step_in_epoch) if self.sharded is not None else len(X)

    def step(self, X, y, n: int, step: int) -> StepResult:
        """One step on this rank's shard of a global batch of `n`; loss and correct count are this rank's share."""
        rank, world_size = self.model.rank, self.model.world_size
        Xs, ys = (X, y) if self.sharded is not None else shard(X, y, rank, world_size)
        Xs, ys = Xs.to(self.device), ys.to(self.device)
        guard = NonFiniteGuard(self.nonfinite, [self.model.module], [self.optimizer], where=f"rank {rank}: ")
        self.optimizer.zero_grad(set_to_none=True)
        # ZeRO-2 reduce-scatters the gradients in its step: the wrapper must not average them first.
        sync = self.model.no_sync() if getattr(self.optimizer, "reduces_gradients", False) else nullcontext()
        try:
            with sync:
                out = self.model(Xs)
                loss = self.loss_fn(out, ys) / n * world_size
                loss.backward()
        except PeerError as e:
            raise e.at(f"step {step}") from e.__cause__
        result = StepResult(loss.item() * n / world_size, count_correct(logits_of(out).detach(), ys), False)
        # The gradients are averages, bitwise equal on every rank, and a NaN or Inf on one rank
        # makes the sum non-finite on all: every rank takes the same decision.
        if not self.gradients_pass(guard, step):
            return result._replace(skipped=True)
        self.optimizer.step()
        return result

    def gradients_pass(self, guard: NonFiniteGuard, step: int) -> bool:
        return guard.passes(step)

    def postfix(self, loop) -> dict:  # rank 0's shard only: the global figures would cost a sync per step
        return {"shard_loss": f"{loop.loss_sum * self.model.world_size / loop.seen:.3f}"}

    def totals(self, loop, epoch: int) -> tuple[float, float]:
        totals = torch.tensor([loop.loss_sum, loop.correct], dtype=torch.float64, device=self.device)
        try:
            allreduce(totals, self.algorithm, timeout=self.timeout)
        except PeerError as e:
            raise e.at(f"end of epoch {epoch + 1} (step {loop.global_step})") from e.__cause__
        return totals[0].item(), totals[1].item()

    def evaluate(self) -> float:
        # The bare module: a forward of the wrapper would wait for its peers.
        return evaluate(self.model.module, self.test_iter, self.device)

    def save(self, loop, history) -> None:
        error = None
        try:
            loop.save([self.model.module], [self.optimizer], history, world_size=self.model.world_size)
        except OSError as e:  # a full disk: every rank names it, rather than losing this rank at the next step
            error = e
        try:
            agree_all_saved(error, loop.checkpoint_dir, self.device, self.algorithm, self.timeout)
        except PeerError as e:  # a peer lost while the ranks compare their saves: say where training was
            raise e.at(f"step {loop.global_step} (after its checkpoint)") from e.__cause__


class FullyShardedRank(OneRank):
    """`OneRank` for ZeRO-3: a forward gathers parameters from every rank, so every rank evaluates, together."""

    def gradients_pass(self, guard: NonFiniteGuard, step: int) -> bool:
        """Each rank holds its shards' gradients only: each finds its first non-finite one, the ranks share what
        they found (a flag each; the names only when one is set), and all take the decision on the same name."""
        if guard.mode is None:
            return True
        bad = next((name for name, p in self.model.module.named_parameters()
                    if p.grad is not None and not bool(torch.isfinite(p.grad.to_local()).all())), None)
        flags = torch.zeros(self.model.world_size, dtype=torch.int32)
        flags[self.model.rank] = bad is not None
        dist.all_reduce(flags)
        if not flags.any():
            return True
        names: list = [None] * self.model.world_size
        dist.all_gather_object(names, bad)
        first = next(r for r, name in enumerate(names) if name is not None)
        return guard.passes_on([(f"{names[first]} (the shard on rank {first})", torch.tensor(float("nan")))], step)

    def totals(self, loop, epoch: int) -> tuple[float, float]:
        self.accuracy = evaluate(self.model.module, self.test_iter, self.device)  # every rank, in step
        return super().totals(loop, epoch)

    def evaluate(self) -> float:
        return self.accuracy


def _len(iterable_) -> int | None:
    try:
        return len(iterable_)
    except TypeError:
        return None


def _progress(iterable_, enabled: bool, desc: str, total: int | None = None):
    if not enabled:
        return iterable_
    from tqdm.auto import tqdm
    return tqdm(iterable_, desc=desc, total=total, leave=False, dynamic_ncols=True)
