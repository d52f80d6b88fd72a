"""Starting ranks: join the group that torchrun describes, or start ranks on this machine.

    torchrun --standalone --nproc-per-node 2 -m manualdp train --model lenet

`init_from_env` joins the process group of `torchrun`'s environment; `launch` starts ranks
on 127.0.0.1 without torchrun (benchmarks and tests); `shard` is the SPMD twin of
`split_batch`: the slice of a global batch that one rank trains on.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

from ..split import shard_sizes
from ..validate import check_batch, one_of, positive_int, timeout_seconds
from .transport.peers import DEFAULT_TIMEOUT

__all__ = ["rank_device", "init_from_env", "shard", "launch"]


def rank_device() -> torch.device:
    """This rank's device: `cuda:LOCAL_RANK` under NCCL, else `cpu`."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_from_env(backend: str | None = None, timeout: float | None = None) -> torch.device:
    """Join the process group that `torchrun` describes in RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
    return this rank's device.

    `backend` defaults to NCCL when there are GPUs and gloo otherwise. `timeout` (seconds,
    default `DEFAULT_TIMEOUT`) bounds the rendezvous and every wait of the group.
    """
    one_of("backend", backend, (None, "gloo", "nccl"))
    timeout = timeout_seconds("timeout", timeout)
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise RuntimeError(f"environment variables {', '.join(missing)} are not set: "
                               "start the processes with torchrun")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        seconds = timeout if timeout is not None else DEFAULT_TIMEOUT
        dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=seconds))
    return rank_device()


def shard(X: torch.Tensor, y: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s slice of the global batch: the same shard `split_batch` gives device `rank`."""
    check_batch(X, y, world_size, "ranks")
    sizes = shard_sizes(len(X), world_size)
    lo = sum(sizes[:rank])
    return X[lo:lo + sizes[rank]], y[lo:lo + sizes[rank]]


# ---------------------------------------------------------------- launching ranks without torchrun

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a forked rank starts from: importing these takes about 2 s of CPU per process, paid once
# by the fork server instead of by every rank of every launch (spawn imported them anew each time).
PRELOAD = ["torch", "torch.distributed", "manualdp", "manualdp.spmd"]


def _start_method() -> str:
    """"forkserver" where there is one (Linux, macOS), with `PRELOAD` imported once; else "spawn".

    Both start each rank from a clean interpreter state (no parent threads, no CUDA context) and
    import the script's main module anew, so a script needs the `if __name__ == "__main__":` guard
    either way; the fork server's children skip the imports that `PRELOAD` already made.
    """
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(PRELOAD)  # read once, when the server first starts
    return "forkserver"


def _note(outdir: str, name: str, text: str = "") -> None:
    """Leave a word for the launcher in launch's own folder, a place that `fn` is never told of."""
    with open(os.path.join(outdir, name), "w") as f:
        f.write(text)


def _worker(rank, fn, world_size, port, args, threads, init, timeout, outdir, backend="gloo", environ=None):
    if environ is not None:  # the launcher's environment now, not the fork server's when it started
        os.environ.clear()
        os.environ.update(environ)
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank, as `rank_device` expects
    if init:
        try:
            # A file rendezvous in our own folder: no race for a port that another process may take.
            dist.init_process_group(backend, init_method=f"file://{os.path.join(outdir, 'rendezvous')}", rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        except Exception as e:
            _note(outdir, f"init-failed{rank}", f"{type(e).__name__}: {e}")  # only this failure may be retried
            raise
    _note(outdir, f"started{rank}")  # from here on, starting the ranks again would run `fn` twice
    try:
        result = fn(*args)
    except BaseException as e:
        if not isinstance(e, Exception):  # torch's wrapper turns these into exit code 0 without a word
            _note(outdir, f"ended{rank}", f"fn raised {e!r}"[:200])
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    # Done: leave without tearing the group down. gloo's teardown, while a peer tears down its
    # side at the same moment, once aborted a rank whose work was finished ("terminate called
    # without an active exception"); the result is saved, the parent reads it, the OS closes the rest.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _MeshFlake(Exception):
    """gloo's full mesh failed to form in launch's own `init_process_group`, before `fn` started on any rank."""

    def __init__(self, error: Exception, line: str):
        super().__init__(line)
        self.error, self.line = error, line


def _mesh_flake(outdir: str, rank: int, world_size: int) -> str | None:
    """The error of `rank`'s own group setup if it is gloo's full-mesh flake and `fn` started nowhere; else None."""
    if any(os.path.exists(os.path.join(outdir, f"started{r}")) for r in range(world_size)):
        return None
    try:
        with open(os.path.join(outdir, f"init-failed{rank}")) as f:
            line = f.read()
    except FileNotFoundError:  # the rank failed elsewhere than in launch's init_process_group
        return None
    return line if "connectFullMesh" in line else None


def launch(fn, world_size: int, args: tuple = (), *, timeout: float = 120.0, threads: int = 1, init: bool = True,
           backend: str = "gloo") -> list:
    """Run `fn(*args)` in `world_size` new processes on 127.0.0.1 and return what each rank returned.

    With `init`, every process first joins a group of `backend` ("gloo", or "nccl" with one
    GPU per rank, rank r on `cuda:r`) whose collectives give up after `timeout` seconds; the
    whole run is killed after `timeout` seconds, so it always ends. `fn` must be importable (a
    module-level function) and its result picklable.
    """
    positive_int("world_size", world_size)
    positive_int("threads", threads)
    timeout_seconds("timeout", timeout, none_ok=False)
    one_of("backend", backend, ("gloo", "nccl"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend 'nccl' needs a GPU per rank: {world_size} ranks, {gpus} GPU(s) here")
    for attempt in (1, 2):
        try:
            return _run(fn, world_size, args, threads, init, timeout, backend)
        except _MeshFlake as flake:
            # gloo's full mesh on 127.0.0.1 now and then reads "Connection closed by peer" while it forms (pytorch
            # issue 53270): a torch flake before `fn` started on any rank; the whole job is started once more.
            if attempt == 2:
                raise flake.error from None
            warnings.warn(f"launch: gloo failed to connect the {world_size} ranks as the group formed "
                          f"({flake.line.strip().splitlines()[-1][:160]}); starting them again once")


def _run(fn, world_size: int, args: tuple, threads: int, init: bool, timeout: float, backend: str) -> list:
    """Start the ranks once and return what each returned (`launch`, its arguments checked)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="manualdp-launch-") as outdir:
        context = mp.start_processes(_worker, nprocs=world_size, join=False, start_method=_start_method(),
                                     args=(fn, world_size, _free_port(), tuple(args), threads, init, timeout, outdir,
                                           backend, dict(os.environ)))
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks running {getattr(fn, '__name__', fn)} "
                                       f"did not finish in {timeout} s")
        except mp.ProcessRaisedException as e:
            _stop(context)  # first, so that no rank starts `fn` after the look at who started it
            line = _mesh_flake(outdir, e.error_index, world_size)
            if line is not None:
                raise _MeshFlake(e, line) from e
            raise
        finally:
            _stop(context)
        return _results(outdir, context, fn, world_size)


def _stop(context) -> None:
    """Kill the ranks that still run and wait for them."""
    for p in context.processes:
        if p.is_alive():
            p.kill()
            p.join()


def _results(outdir: str, context, fn, world_size: int) -> list:
    """What each rank returned; a rank that ended with exit code 0 but no result is named, with how it ended."""
    missing = []
    for r in range(world_size):
        if not os.path.exists(os.path.join(outdir, f"rank{r}.pt")):
            try:
                with open(os.path.join(outdir, f"ended{r}")) as f:
                    how = f.read()
            except FileNotFoundError:  # os._exit in fn, or the process left some other way
                how = f"its process exited with code {context.processes[r].exitcode} before fn returned"
            missing.append(f"rank {r}: {how}")
    if missing:
        raise RuntimeError(f"launch: {getattr(fn, '__name__', fn)} ended without returning on "
                           f"{len(missing)} of {world_size} ranks ({'; '.join(missing)})")
    return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
