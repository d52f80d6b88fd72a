"""SPMD training: every process runs this loop on its own slice of each global batch.

    torchrun --standalone --nproc-per-node 2 -m manualdp train --model lenet

`init_from_env` joins the process group that `torchrun` describes in the environment;
`train_spmd` is the twin of `manualdp.train.train`; `launch` starts ranks on this machine
without torchrun (benchmarks and tests).
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
from .distributed import DistributedDataParallel, _check_algorithm, allreduce
from .split import shard_sizes
from .train import History, _count_correct, _progress, evaluate, summed_loss

__all__ = ["init_from_env", "rank_device", "shard", "train_spmd", "launch"]


def _timeout(timeout) -> datetime.timedelta | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return datetime.timedelta(seconds=timeout)


def rank_device() -> torch.device:
    """This rank's device: `cuda:LOCAL_RANK` under NCCL, else `cpu`."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_from_env(backend: str | None = None, timeout: float | None = None) -> torch.device:
    """Join the process group that `torchrun` describes in RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; return this rank's device.

    `backend` defaults to NCCL when there are GPUs and gloo otherwise; `timeout` is in seconds.
    """
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    td = _timeout(timeout)
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise RuntimeError(f"environment variables {', '.join(missing)} are not set: start the processes with torchrun")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        kwargs = {"timeout": td} if td is not None else {}
        dist.init_process_group(backend, init_method="env://", **kwargs)
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
    device=None,
    progress: bool = True,
    log=print,
) -> History | None:
    """Train `net` with SGD on this rank's slice of every global batch; the History on rank 0, None elsewhere.

    Every rank must iterate the same global batches (same data, same seed). Each rank's loss
    is its shard's sum divided by the global batch and multiplied by the world size, so that
    the average over ranks that DDP takes is the one-process gradient of the global batch.
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be an nn.Module, got {type(net).__name__}")
    if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 1:
        raise ValueError(f"num_epochs must be a positive int, got {num_epochs!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    _check_algorithm(algorithm)
    assign_buckets([], bucket_cap_mb)
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call manualdp.spmd.init_from_env() first")
    loss_fn = summed_loss(loss_fn)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(device) if device is not None else rank_device()
    is_main = rank == 0

    model = DistributedDataParallel(net.to(device), bucket_cap_mb=bucket_cap_mb, algorithm=algorithm)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    history = History(config={
        "world_size": world_size, "backend": dist.get_backend(), "device": str(device), "num_epochs": num_epochs,
        "lr": lr, "algorithm": algorithm, "bucket_cap_mb": bucket_cap_mb,
    })
    for epoch in range(num_epochs):
        model.train()
        start = time.perf_counter()
        loss_sum = correct = seen = 0.0
        batches = _progress(train_iter, progress and is_main, f"epoch {epoch + 1}/{num_epochs}")
        for X, y in batches:
            Xs, ys = shard(X, y, rank, world_size)
            Xs, ys = Xs.to(device), ys.to(device)
            optimizer.zero_grad(set_to_none=True)
            out = model(Xs)
            loss = loss_fn(out, ys).sum() / len(X) * world_size
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(X) / world_size
            correct += _count_correct(out.detach(), ys)
            seen += len(X)
            if hasattr(batches, "set_postfix"):  # rank 0's shard only: the global figures would cost a sync per step
                batches.set_postfix(shard_loss=f"{loss_sum * world_size / seen:.3f}", refresh=False)
        seconds = time.perf_counter() - start
        totals = torch.tensor([loss_sum, correct], dtype=torch.float64, device=device)
        allreduce(totals, algorithm)
        if not is_main:
            continue
        test_acc = evaluate(net, test_iter, device)  # the bare module: a forward of the wrapper would wait for its peers
        history.train_loss.append(totals[0].item() / max(seen, 1))
        history.train_acc.append(totals[1].item() / max(seen, 1))
        history.test_acc.append(test_acc)
        history.epoch_seconds.append(seconds)
        history.samples_per_second.append(seen / seconds if seconds > 0 else float("nan"))
        if log:
            log(f"epoch {epoch + 1}: loss {history.train_loss[-1]:.3f}, train acc {history.train_acc[-1]:.3f}, "
                f"test acc {test_acc:.3f}, {seconds:.1f} sec/epoch, {history.samples_per_second[-1]:.0f} samples/s "
                f"on {world_size} ranks")
    return history if is_main else None


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
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
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
    if _timeout(timeout) is None:
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
