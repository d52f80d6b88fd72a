"""SPMD training: every process runs this loop on its own slice of each global batch.

    torchrun --standalone --nproc-per-node 2 -m manualdp train --model lenet

`init_from_env` joins the process group that `torchrun` describes in the environment;
`train_spmd` is the twin of `manualdp.train.train`; `launch` starts ranks on this machine
without torchrun (benchmarks and tests).

Failures: every wait has a deadline (`timeout`, 300 s by default instead of gloo's 30
minutes); a rank whose peer dies or hangs raises `PeerError` ("rank 0: step 12: no answer
from rank 1 within 10 s ...") and exits, and torchrun stops the rest.

Checkpoints: every rank writes its own files, `checkpoint_dir/rank{r}/ckpt-STEP.pt`, with
its own RNG state, so no shared file system is needed. Ranks save at the same steps, so
their files differ at most by a newest one that a rank did not finish; on resume they
exchange their newest readable step and all load the smallest (two are kept per rank).
"""
from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from .buckets import DEFAULT_BUCKET_CAP_MB, assign_buckets
from .checkpoint import check_checkpoint_dir, check_layout, checkpoint_path, load_latest
from .distributed import DistributedDataParallel, _check_algorithm, allreduce
from .peers import DEFAULT_TIMEOUT, PeerError, check_timeout
from .split import shard_sizes
from .checkpoint import TrainingState
from .history import History
from .train import (NONFINITE, NonFiniteGradientError, StepResult, _count_correct, _len, _progress,
                    evaluate, first_nonfinite, summed_loss)

__all__ = ["DEFAULT_TIMEOUT", "PeerError", "init_from_env", "rank_device", "shard", "train_spmd", "launch"]


def rank_device() -> torch.device:
    """This rank's device: `cuda:LOCAL_RANK` under NCCL, else `cpu`."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_from_env(backend: str | None = None, timeout: float | None = None) -> torch.device:
    """Join the process group that `torchrun` describes in RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; return this rank's device.

    `backend` defaults to NCCL when there are GPUs and gloo otherwise. `timeout` (seconds,
    default `DEFAULT_TIMEOUT`) bounds the rendezvous and every wait of the group.
    """
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    timeout = check_timeout(timeout)
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise RuntimeError(f"environment variables {', '.join(missing)} are not set: start the processes with torchrun")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        seconds = timeout if timeout is not None else DEFAULT_TIMEOUT
        dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=seconds))
    return rank_device()


def shard(X: torch.Tensor, y: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s slice of the global batch: the same shard `split_batch` gives device `rank`."""
    if len(X) != len(y):
        raise ValueError(f"X and y must have the same length, got len(X)={len(X)} and len(y)={len(y)}")
    if len(X) < world_size:
        raise ValueError(f"batch of {len(X)} is smaller than the {world_size} ranks: every rank needs at least one example")
    sizes = shard_sizes(len(X), world_size)
    lo = sum(sizes[:rank])
    return X[lo:lo + sizes[rank]], y[lo:lo + sizes[rank]]


def train_spmd(
    net: nn.Module,
    train_iter,
    test_iter,
    num_epochs: int,
    lr: float,
    *,
    loss_fn=None,
    algorithm: str = "ring",
    bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nonfinite: str | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    timeout: float | None = None,
    device=None,
    progress: bool = True,
    log=print,
) -> History | None:
    """Train `net` with SGD on this rank's slice of every global batch; the History on rank 0, None elsewhere.

    Every rank must iterate the same global batches (same data, same seed). Each rank's loss
    is its shard's sum divided by the global batch and multiplied by the world size, so that
    the average over ranks that DDP takes is the one-process gradient of the global batch.
    `nonfinite`, `checkpoint_dir`, `checkpoint_every` and `resume` work as in `train`;
    `timeout` (seconds, default: the process group's) bounds every wait for a peer.
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be an nn.Module, got {type(net).__name__}")
    if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 1:
        raise ValueError(f"num_epochs must be a positive int, got {num_epochs!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    _check_algorithm(algorithm)
    assign_buckets([], bucket_cap_mb)
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
    if checkpoint_every is not None and (
            isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1):
        raise ValueError(f"checkpoint_every must be a positive int or None, got {checkpoint_every!r}")
    if not isinstance(resume, bool):
        raise TypeError(f"resume must be a bool, got {resume!r}")
    if (checkpoint_every is not None or resume) and checkpoint_dir is None:
        raise ValueError("checkpoint_every and resume need checkpoint_dir")
    timeout = check_timeout(timeout)
    for name, it in (("train_iter", train_iter), ("test_iter", test_iter)):
        if not hasattr(it, "__iter__"):
            raise TypeError(f"{name} must be iterable (e.g. a DataLoader), got {type(it).__name__}")
    if log is not None and not callable(log):
        raise TypeError(f"log must be callable or None, got {log!r}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call manualdp.spmd.init_from_env() first")
    loss_fn = summed_loss(loss_fn)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if checkpoint_dir is not None:
        check_checkpoint_dir(checkpoint_dir, resume)  # also refuses a single-controller run's folder
        check_checkpoint_dir(os.path.join(checkpoint_dir, f"rank{rank}"), resume)
    device = torch.device(device) if device is not None else rank_device()
    is_main = rank == 0

    model = DistributedDataParallel(net.to(device), bucket_cap_mb=bucket_cap_mb, algorithm=algorithm, timeout=timeout)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    history = History(config={
        "world_size": world_size, "backend": dist.get_backend(), "device": str(device), "num_epochs": num_epochs,
        "lr": lr, "algorithm": algorithm, "bucket_cap_mb": bucket_cap_mb,
    })
    if checkpoint_dir is not None:
        check_layout(checkpoint_dir, per_rank=True)
    loop = TrainingState(train_iter, os.path.join(checkpoint_dir, f"rank{rank}") if checkpoint_dir is not None else None)
    if resume:
        state = _agree_on_checkpoint(loop.checkpoint_dir, device, algorithm, timeout)
        if state is None and log and is_main:
            log(f"no checkpoint in {checkpoint_dir}: starting from the beginning")
        if state is not None:
            loop.restore(state, [net], [optimizer], history)
            if log and is_main:
                log(f"resumed from {state['path']} (epoch {state['epoch'] + 1}, step {state['global_step']}) "
                    f"on {world_size} ranks")
    for epoch in range(loop.epoch, num_epochs):
        model.train()
        start = time.perf_counter()
        batches = _progress(loop.batches(epoch), progress and is_main, f"epoch {epoch + 1}/{num_epochs}", _len(train_iter))
        for X, y in batches:
            if len(X) < world_size:  # every rank sees the same batch, so every rank skips it
                if log and is_main:
                    log(f"epoch {epoch + 1}: skipped a batch of {len(X)}, fewer examples than the {world_size} ranks")
                continue
            try:
                result = _step(model, optimizer, loss_fn, X, y, device, nonfinite, loop.global_step)
            except PeerError as e:
                raise e.at(f"step {loop.global_step}") from e.__cause__
            loop.record(result, len(X))
            if result.skipped and log and is_main:
                log(f"step {loop.global_step - 1}: non-finite gradient, update skipped on every rank")
            if hasattr(batches, "set_postfix"):  # rank 0's shard only: the global figures would cost a sync per step
                batches.set_postfix(shard_loss=f"{loop.loss_sum * world_size / loop.seen:.3f}", refresh=False)
            if checkpoint_every and loop.global_step % checkpoint_every == 0:
                loop.save([net], [optimizer], history, world_size=world_size)
        if loop.seen == 0:
            raise ValueError(f"train_iter gave no usable batch in epoch {epoch + 1}")
        seconds = loop.seconds + time.perf_counter() - start
        totals = torch.tensor([loop.loss_sum, loop.correct], dtype=torch.float64, device=device)
        try:
            allreduce(totals, algorithm, timeout=timeout)
        except PeerError as e:
            raise e.at(f"end of epoch {epoch + 1} (step {loop.global_step})") from e.__cause__
        if is_main:
            test_acc = evaluate(net, test_iter, device)  # the bare module: a forward of the wrapper would wait for its peers
            seen = max(loop.seen, 1)
            history.train_loss.append(totals[0].item() / seen)
            history.train_acc.append(totals[1].item() / seen)
            history.test_acc.append(test_acc)
            history.epoch_seconds.append(seconds)
            history.samples_per_second.append(loop.seen / seconds if seconds > 0 else float("nan"))
            if log:
                log(f"epoch {epoch + 1}: loss {history.train_loss[-1]:.3f}, train acc {history.train_acc[-1]:.3f}, "
                    f"test acc {test_acc:.3f}, {seconds:.1f} sec/epoch, {history.samples_per_second[-1]:.0f} samples/s "
                    f"on {world_size} ranks")
        loop.end_epoch()
        if checkpoint_dir is not None:
            loop.save([net], [optimizer], history, world_size=world_size)
    return history if is_main else None


def _step(model: DistributedDataParallel, optimizer, loss_fn, X, y, device, nonfinite, step: int) -> StepResult:
    """One step on this rank's shard; the loss and correct count are this rank's share of the global batch's."""
    rank, world_size = model.rank, model.world_size
    Xs, ys = shard(X, y, rank, world_size)
    Xs, ys = Xs.to(device), ys.to(device)
    # A skipped step must not keep what the bad forward pass wrote into BatchNorm statistics.
    saved_buffers = [b.detach().clone() for b in model.module.buffers()] if nonfinite == "skip" else None
    optimizer.zero_grad(set_to_none=True)
    out = model(Xs)
    loss = loss_fn(out, ys) / len(X) * world_size
    loss.backward()
    result = StepResult(loss.item() * len(X) / world_size, _count_correct(out.detach(), ys), False)
    if nonfinite is not None:
        # The gradients are the allreduced averages, bitwise equal on every rank, and a NaN or
        # Inf on one rank makes the sum non-finite on all: every rank takes the same decision.
        bad = first_nonfinite(model.module)
        if bad is not None:
            if nonfinite == "raise":
                raise NonFiniteGradientError(f"rank {rank}: non-finite gradient in parameter {bad!r} at step {step}")
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for b, saved in zip(model.module.buffers(), saved_buffers):
                    b.copy_(saved)
            return result._replace(skipped=True)
    optimizer.step()
    return result


def _exchange(value: int, device, algorithm: str, timeout: float | None) -> list[int]:
    """Every rank's `value` (ints >= -1), on every rank."""
    everyone = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    everyone[dist.get_rank()] = value + 1
    allreduce(everyone, algorithm, timeout=timeout)
    return [v - 1 for v in everyone.tolist()]


def _position(state: dict) -> int:
    """Where a checkpoint sits in the run: after step s mid-epoch is 2s, after step s at the end of an epoch 2s + 1."""
    return 2 * state["global_step"] + (state["step_in_epoch"] == 0)


def _load_step(directory: str, position: int) -> dict | None:
    step, end_of_epoch = divmod(position, 2)
    path = checkpoint_path(directory, step, bool(end_of_epoch))
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception:  # missing, truncated or corrupt: the caller tells every rank
        return None
    state["path"] = path
    return state


def _agree_on_checkpoint(directory: str, device, algorithm: str, timeout: float | None) -> dict | None:
    """The newest checkpoint step that every rank can read, loaded on every rank; None if no rank has any.

    Every rank sees the same exchanged steps, so all of them return, or all raise the same error.
    """
    state = load_latest(directory)  # warns about, and skips, files a kill left unreadable
    # Positions, not steps: a rank killed while rank 0 evaluates holds step s mid-epoch, its
    # peers may already hold step s at the end of the epoch, and those two states differ.
    newest = _exchange(-1 if state is None else _position(state), device, algorithm, timeout)
    parent = os.path.dirname(directory)
    if max(newest) < 0:
        return None
    if min(newest) < 0:
        missing = [r for r, s in enumerate(newest) if s < 0]
        raise ValueError(f"cannot resume from {parent}: rank(s) {missing} have no readable checkpoint in "
                         f"their rank<r>/ folder while others do (newest steps per rank: {[max(s, -1) // 2 if s >= 0 else None for s in newest]}); "
                         "were they written with another number of ranks?")
    position = min(newest)
    if _position(state) != position:
        state = _load_step(directory, position)
    loaded = _exchange(position if state is not None else -1, device, algorithm, timeout)
    if min(loaded) < 0:
        step = position // 2
        raise ValueError(f"cannot resume from {parent}: step {step} is the newest that every rank saved, but rank(s) "
                         f"{[r for r, s in enumerate(loaded) if s < 0]} cannot read it")
    if state.get("world_size") != dist.get_world_size():
        raise ValueError(f"cannot resume from {parent}: its checkpoints were written by {state.get('world_size')} "
                         f"ranks, this run has {dist.get_world_size()}")
    return state


# ---------------------------------------------------------------- launching ranks without torchrun

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, fn, world_size, port, args, threads, init, timeout, outdir):
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if init:
        # A file rendezvous in our own folder: no race for a port that another process may take.
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(outdir, 'rendezvous')}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
    try:
        result = fn(*args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))


def launch(fn, world_size: int, args: tuple = (), *, timeout: float = 120.0, threads: int = 1, init: bool = True) -> list:
    """Run `fn(*args)` in `world_size` new processes on 127.0.0.1 and return what each rank returned.

    With `init`, every process first joins a gloo group whose collectives give up after
    `timeout` seconds; the whole run is killed after `timeout` seconds, so it always ends.
    `fn` must be importable (a module-level function) and its result picklable.
    """
    import torch.multiprocessing as mp

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    if check_timeout(timeout) is None:
        raise ValueError("timeout must be a positive number of seconds, got None")
    with tempfile.TemporaryDirectory(prefix="manualdp-launch-") as outdir:
        context = mp.start_processes(_worker, nprocs=world_size, join=False, start_method="spawn",
                                     args=(fn, world_size, _free_port(), tuple(args), threads, init, timeout, outdir))
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks running {getattr(fn, '__name__', fn)} did not finish in {timeout} s")
        finally:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
