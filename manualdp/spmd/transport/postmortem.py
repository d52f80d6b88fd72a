"""Which rank was lost first: every rank that stops on a `PeerError` leaves its line in the group's store.

When a machine dies, the ranks next to it see their connections close and stop. A rank
that was only waiting on one of *those* then sees that rank's connection close, and its
own error would name a live machine's rank. Each stopping rank therefore writes its one
line into the default process group's store (torchrun's agent store, or the file store of
`launch`) before it exits, and reads the line of the peer it lost: the error of every rank
then leads to the rank that was lost first. Its process exits only after the write, and
only that exit closes the connection its peers see, so the line is there when they look.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

from ...validate import positive_number
from .peers import PeerError

__all__ = ["explain_peer_error", "store_key"]


def store_key(rank: int) -> str:
    """Where rank `rank` leaves the line it stopped with."""
    return f"manualdp/peer-error/{rank}"


def explain_peer_error(error: PeerError, store=None, timeout: float = 2.0) -> str:
    """`error`'s line, followed by the line its peer left if that peer stopped first; this rank's line is left
    for the others.

    `store`: default, the default process group's. Store operations give up after
    `timeout` seconds: a store on a dead machine leaves `error`'s own line, never a hang.
    """
    if not isinstance(error, PeerError):
        raise TypeError(f"error must be a PeerError, got {type(error).__name__}")
    positive_number("timeout", timeout)
    line = str(error)
    try:
        if store is None:
            if not dist.is_initialized():
                return line
            store = dist.distributed_c10d._get_default_store()  # torch has no public getter
        store.set_timeout(datetime.timedelta(seconds=timeout))
        if error.peer is not None and store.check([store_key(error.peer)]):
            theirs = store.get(store_key(error.peer)).decode()
            theirs = theirs.removeprefix(f"rank {error.peer}: ")
            line = f"{line}; rank {error.peer} had stopped first: {theirs}"
        store.set(store_key(error.rank), line)
    except Exception:  # the store went with the machine that hosted it: say what this rank saw
        pass
    return line
