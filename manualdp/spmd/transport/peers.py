"""Waiting on other ranks without hanging: a deadline on every wait, an error that names the peer.

When a rank dies, gloo usually notices at once ("Connection closed by peer"); when it hangs,
only a deadline helps. Either way the wait ends in a `PeerError` that names this rank, the
peer it was waiting for and (added by the training loop) the step. The group's worker thread,
which runs the wrappers' collectives in order and never holds a failing process's exit back
for a whole timeout, is in `worker.py`.
"""
from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT", "PeerError", "group_ranks", "group_timeout", "wait", "talking_to", "peer_error",
           "refused_alike", "is_refused_alike"]

DEFAULT_TIMEOUT = 300.0  # seconds; gloo's own default is 30 minutes of silence


def group_timeout(group=None) -> float | None:
    """The timeout `group` was created with, in seconds; None where torch does not say."""
    pg = group if group is not None else dist.group.WORLD
    # torch has no public getter; the backend's options hold what init_process_group/new_group got.
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:
            continue
    return None


def group_ranks(group) -> tuple[int, list[int]]:
    """This process's rank in `group` and the global rank of every member."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group "
                           "(or manualdp.spmd.init_from_env) first")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of group {group!r}")
    n = dist.get_world_size(group)
    if group is None or group is dist.group.WORLD:
        return rank, list(range(n))
    return rank, [dist.get_global_rank(group, r) for r in range(n)]



class PeerError(RuntimeError):
    """A peer did not answer in time, or its connection broke: it has died or hangs.

    Afterwards the process group is unusable (messages may be half-exchanged): exit, and let
    torchrun (or the other ranks' own timeouts) stop the rest.
    """

    def __init__(self, rank: int, peer: int | None, timed_out: bool, timeout: float | None, detail: str = "",
                 where: str = "") -> None:
        self.rank = rank            # this process's global rank
        self.peer = peer            # global rank it was waiting for; None: several ranks
        self.timed_out = timed_out  # True: silence for `timeout` s; False: the connection broke
        self.timeout = timeout      # the deadline in seconds; None: the process group's, unknown here
        self.detail = detail        # the backend's own words
        self.where = where          # e.g. "step 12", filled in by the training loop
        who = f"rank {peer}" if peer is not None else "the other ranks"
        prefix = f"rank {rank}: " + (f"{where}: " if where else "")
        if timed_out:
            within = f"{timeout:g} s" if timeout is not None else "the process group's timeout"
            text = f"no answer from {who} within {within} (it may have died or hung)"
        else:
            text = f"no answer from {who}: the connection was closed (it may have died)"
        super().__init__(prefix + text + (f" [{detail}]" if detail else ""))

    def __reduce__(self):
        return PeerError, (self.rank, self.peer, self.timed_out, self.timeout, self.detail, self.where)

    def at(self, where: str) -> "PeerError":
        """The same error, saying where in training it happened."""
        return PeerError(self.rank, self.peer, self.timed_out, self.timeout, self.detail, where)


def _timed_out(error: BaseException) -> bool:
    timeout_error = getattr(dist, "DistTimeoutError", ())
    return isinstance(error, timeout_error) or "timed out" in str(error).lower()


def _first_line(error: BaseException) -> str:
    """The backend's message without its source location (gloo: "[.../pair.cc:553] Connection closed ...")."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0][:200]  # gloo's advice to read the peer's log adds nothing here


@contextlib.contextmanager
def talking_to(peer: int | None, timeout: float | None):
    """Turn the errors of a send, receive or wait involving `peer` into `PeerError`.

    Gloo reports a peer that is gone from whichever call comes next: the wait, or already
    the posting of the next message, so both go through here.
    """
    try:
        yield
    except PeerError:
        raise
    except RuntimeError as e:  # gloo raises plain RuntimeErrors; torch's DistError types derive from it
        raise peer_error(e, peer, timeout) from e


def peer_error(error: RuntimeError, peer: int | None, timeout: float | None) -> RuntimeError:
    """`error` (not a `PeerError`) of a send, receive or wait involving `peer`, as a `PeerError`.

    For loops too hot for a `talking_to` around every message: they catch once and raise this.
    """
    rank = dist.get_rank() if dist.is_initialized() else -1
    return PeerError(rank, peer, _timed_out(error), timeout, _first_line(error))


def wait(work, peer: int | None, timeout: float | None) -> None:
    """Wait for `work` (a send, receive or collective); `PeerError` if `peer` is silent for `timeout` s or gone."""
    with talking_to(peer, timeout):
        if timeout is None:
            work.wait()  # the process group's own timeout applies
        else:
            work.wait(datetime.timedelta(seconds=timeout))


def refused_alike(error: BaseException) -> BaseException:
    """Mark `error` as a refusal that every rank raised alike, after an exchange that left nothing in flight.

    Ranks that compared what they were about to do (`agree.agree`, the call check) and found a
    difference all raise before any data moves: the group still pairs its messages, so its
    worker goes on serving later calls (`worker.SerialWorker`) instead of failing them for good.
    """
    error.refused_alike = True
    return error


def is_refused_alike(error: BaseException) -> bool:
    """Whether `error` was marked by `refused_alike`."""
    return getattr(error, "refused_alike", False) is True
