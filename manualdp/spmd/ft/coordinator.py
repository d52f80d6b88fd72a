"""The coordinator: the one process every replica talks to, hosting a key-value store.

    python -c "from manualdp.spmd.ft import Coordinator; Coordinator(29510).serve()"

torchft calls it the lighthouse. Here it is only a `torch.distributed.TCPStore`, the same
key-value server that `init_process_group` uses to introduce ranks to each other. It holds no
logic: the replicas register and heartbeat in it (`heartbeat.py`), ask for a quorum and take
the first one written (`quorum.py`), vote on each step (`commit.py`), hand a joiner its state
(`recovery.py`), and each quorum's gloo group meets in it (`quorum_group.py`); `keys.py` names
every key. Every decision is a key that the first replica to write it wins (`compare_set`):
the store makes that atomic.

The store must outlive the replicas: once it is gone, their next wait on it raises.
"""
from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from ...validate import int_between, timeout_seconds
from .keys import PREFIX

__all__ = ["Coordinator", "connect", "check_host", "PREFIX"]


class Coordinator:
    """Host the store on `port` (0: a free one, read back from `.port`) of this machine, until `close()`.

    Args:
        port: the TCP port to listen on; 0 picks a free one.
        host: the address replicas connect to ("127.0.0.1" for one machine; the store
            itself listens on every interface).
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        int_between("port", port, 0, 65535)
        self.host = check_host(host)
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=30))
        self.port = self.store.port  # the store's own object: the server lives as long as this reference

    def serve(self, poll: float = 1.0) -> None:
        """Run until interrupted (Ctrl-C): what `manualdp coordinator` does."""
        try:
            while True:
                time.sleep(poll)
        except KeyboardInterrupt:
            pass
        finally:
            self.close()

    def close(self) -> None:
        """Stop serving: the replicas' next wait on the store fails."""
        self.store = None

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_host(host) -> str:
    """`host` if it is an address (a non-empty str without spaces); else one line naming it (TCPStore's own is not)."""
    if not isinstance(host, str):
        raise TypeError(f"host must be a str such as '127.0.0.1', got {type(host).__name__} {host!r}")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"host must be a non-empty address without spaces such as '127.0.0.1', got {host!r}")
    return host


def connect(host: str, port: int, timeout: float) -> dist.Store:
    """A new connection to the coordinator's store, its keys below `PREFIX`; each wait on it gives up after `timeout` s.

    One connection serves one thread at a time (a wait holds it), so the heartbeat thread gets
    its own (`store.clone()`).
    """
    check_host(host)
    int_between("port", port, 1, 65535)
    seconds = timeout_seconds("timeout", timeout)
    client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=seconds))
    return dist.PrefixStore(PREFIX, client)
