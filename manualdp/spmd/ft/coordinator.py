"""The coordinator: the one process every replica talks to, hosting a key-value store.

    python -c "from manualdp.spmd.ft import Coordinator; Coordinator(29510, token=SECRET).serve()"

torchft calls it the lighthouse. Here it is only a `torch.distributed.TCPStore`, the same
key-value server that `init_process_group` uses to introduce ranks to each other. It holds no
logic: the replicas register and heartbeat in it (`heartbeat.py`), ask for a quorum and take
the first one written (`quorum.py`), vote on each step (`commit.py`), hand a joiner its state
(`recovery.py`), and each quorum's gloo group meets in it (`quorum_group.py`); `keys.py` names
every key. Every decision is a key that the first replica to write it wins (`compare_set`):
the store makes that atomic.

Who can reach it. The store listens on the address given, 127.0.0.1 by default (one machine);
another address only when asked, with a warning. With a secret (`token`) every key and value is
signed (`signed_store.py`): a process without it cannot forge a decision, a vote, a heartbeat or
a state. The coordinator writes a random nonce as it starts (`hello`, signed, first writer), and
every signature is keyed by it: what was signed in an earlier life (of this coordinator, or of
another run with the same secret) does not verify in this one. Without one the store is open, as
torch's: anyone who reaches the port can steer the run.
Either way torch's server accepts any number of connections from anyone who reaches the port (it
has no limit per address, and no way to set one): a process that holds thousands of them keeps
replicas from joining. Keep the port on a trusted network, or behind a firewall.

The store must outlive the replicas: once it is gone, their next wait on it raises.
"""
from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import secrets
import socket
import time

import torch.distributed as dist

from ...validate import int_between, timeout_seconds
from .keys import HELLO, MODE, PREFIX
from .signed_store import LOG, SignedStore, life_key

__all__ = ["Coordinator", "connect", "check_host", "check_token", "load_token", "PREFIX", "TOKEN_ENV", "LIMITS"]

TOKEN_ENV = "MANUALDP_FT_TOKEN"  # the environment variable a secret may come in, instead of --token-file
MIN_TOKEN = 16  # characters: a shorter secret is too easy to guess
LIMITS = ("torch's store server has no limit on connections, per address or in all: a process that reaches the "
          "port can hold thousands and keep replicas from joining")
OPEN = ("the coordinator's store is open (no secret: --token-file or MANUALDP_FT_TOKEN): a process that reaches its "
        "port can forge commits and votes, stall or eject replicas, serve a poisoned state and read the model")
WIDE = ("the coordinator listens on %s, beyond this machine: the secret signs every key and value (no forged "
        "decision, vote, heartbeat or state), but encrypts nothing (the model can be read) and cannot stop a "
        "stranger from deleting keys or holding connections; " + LIMITS)


class Coordinator:
    """Host the store on `host`:`port` (port 0: a free one, read back from `.port`), until `close()`.

    The store accepts any number of connections (torch's server cannot limit them): see the
    module's docstring for who can reach it, and what the secret protects.

    Args:
        port: the TCP port to listen on; 0 picks a free one.
        host: the address to listen on: "127.0.0.1" (the default) for one machine; another
            address (or "0.0.0.0", every interface) only for replicas on other machines.
        token: the run's shared secret (at least 16 characters), which every replica must be
            given too; None: the open mode.
        log_warnings: log `warnings` (what an open store, or another address, allows) once started;
            False: the caller tells them (`manualdp coordinator` prints them after its first line).
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1", token: str | None = None, *,
                 log_warnings: bool = True) -> None:
        int_between("port", port, 0, 65535)
        self.host = check_host(host)
        secret = check_token(token)
        listener = _listen(host, port)
        address = listener.getsockname()[0]
        wide = not ipaddress.ip_address(address.split("%")[0]).is_loopback
        self.warnings = [WIDE % address] * wide + [OPEN] * (secret is None)  # what the port allows, in words
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=30), master_listen_fd=listener.detach())
        self.port = self.store.port  # the store's own object: the server lives as long as this reference
        self.nonce: bytes | None = None  # with a secret, this life's: no signature of another life verifies
        self.store.set(f"{PREFIX}/{MODE}", "signed" if secret else "open")  # for a replica's one-line error only
        if secret is not None:  # this life's nonce, first writer wins: it keys every signature (`signed_store.py`)
            self.nonce = SignedStore(self.store, secret, PREFIX).compare_set(HELLO, "", secrets.token_hex(16))
        for warning in self.warnings if log_warnings else ():
            LOG.warning("%s", warning)

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


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` and listening: torch's server would listen on every interface."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"host {host!r} is not an address of this machine, nor a name that resolves: {e}") from None
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(1024)
    except OSError:
        listener.close()
        raise
    return listener


def check_host(host) -> str:
    """`host` if it is an address (a non-empty str without spaces); else one line naming it (TCPStore's own is not)."""
    if not isinstance(host, str):
        raise TypeError(f"host must be a str such as '127.0.0.1', got {type(host).__name__} {host!r}")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"host must be a non-empty address without spaces such as '127.0.0.1', got {host!r}")
    return host


def check_token(token) -> bytes | None:
    """The secret's bytes; None for None. One line naming the argument (never its value) if it is not a secret."""
    if token is None:
        return None
    if not isinstance(token, str):
        raise TypeError(f"token must be a str (the run's shared secret), got {type(token).__name__}")
    if len(token) < MIN_TOKEN or token != token.strip():
        raise ValueError(f"token must be at least {MIN_TOKEN} characters without spaces around them, got "
                         f"{len(token)} characters")
    return token.encode()


def load_token(path: str | None) -> str | None:
    """The secret in the file at `path` (its one line), else in $MANUALDP_FT_TOKEN, else None (the open mode)."""
    if path is None:
        token = os.environ.get(TOKEN_ENV) or None
        where = f"${TOKEN_ENV}"
    else:
        try:
            with open(path, encoding="utf-8") as file:
                token = file.read(4096).strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--token-file {path}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
        where = f"--token-file {path}"
    try:
        check_token(token)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return token


def connect(host: str, port: int, timeout: float, token: str | None = None, namespace: str | None = None):
    """A new connection to the coordinator's store, its keys below `PREFIX`; each wait on it gives up after `timeout` s.

    Returns a `SignedStore`: signed with `token`, or open without. One connection serves one
    thread at a time (a wait holds it), so the heartbeat thread gets its own (`store.clone()`).
    ConnectionError in one line if nobody answers within `timeout`; ValueError if the coordinator
    was started with another secret, or none.
    """
    check_host(host)
    int_between("port", port, 1, 65535)
    seconds = timeout_seconds("timeout", timeout)
    secret = check_token(token)
    try:
        with _quiet_stderr():  # torch's client logs each failed try in C++, dozens of lines, before it raises
            client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=seconds))
    except (RuntimeError, OSError):
        raise ConnectionError(f"cannot reach the coordinator at {host}:{port} within {seconds:g} s") from None
    mode, prefix = f"{PREFIX}/{MODE}", PREFIX if namespace is None else f"{PREFIX}/{namespace}"
    said = client.get(mode) if client.check([mode]) else None  # not signed: anyone on the port can write it
    if secret is None:
        if said == b"signed":
            raise ValueError(f"the coordinator at {host}:{port} asks for the run's secret (so says its mode key, "
                             f"which is not signed): give this replica the same --token-file (or ${TOKEN_ENV}) as "
                             "the coordinator")
        LOG.warning(OPEN)
        return SignedStore(client, None, prefix)
    # the signed nonce, not the mode key, decides: a stranger's mode key neither admits nor refuses a replica
    nonce = SignedStore(client, secret, PREFIX).peek(HELLO)  # this coordinator's life (a signed, random nonce)
    if nonce is None and said != b"signed":
        said = "nothing" if said is None else repr(said.decode(errors="replace"))
        raise ValueError(f"the coordinator at {host}:{port} holds nothing signed with this secret, and its mode key "
                         f"(not signed) says {said}: it runs without a secret (open), or a stranger wrote that key; "
                         f"start it with the same --token-file (or ${TOKEN_ENV}) as this replica, or give "
                         "this replica none")
    if nonce is None:
        raise ValueError(f"the coordinator at {host}:{port} does not hold this secret: start it and every "
                         f"replica with the same --token-file (or ${TOKEN_ENV})")
    return SignedStore(client, life_key(secret, nonce), prefix)


@contextlib.contextmanager
def _quiet_stderr():
    """Send this process's stderr (fd 2, where C++ writes) to /dev/null for the duration."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
