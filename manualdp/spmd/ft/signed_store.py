"""The coordinator's store as the replicas see it: every key and value signed with the run's shared secret.

The coordinator's `TCPStore` lets anyone who reaches its port read, write and delete any key.
With a secret (`--token-file`, or `MANUALDP_FT_TOKEN`) every replica reads and writes through a
`SignedStore`, so that a process without the secret cannot steer the run:

- each key's name in the store is HMAC-SHA256(secret, name): a stranger cannot compute the name
  of a decision not yet taken (a "discard" for a later round, a forged vote);
- each value carries an HMAC-SHA256 over (name, value): a value that does not verify is treated
  as absent, logged once per key, never fatal. A first-writer-wins `compare_set` that finds such a
  value in place replaces it, so a forged decision cannot block the honest one either;
- an appended value (`append`: the registered ids, the asks of a round) is signed chunk by chunk,
  and a chunk that does not verify is dropped alone.

What the secret does not protect: it encrypts nothing (torch's store can list its keys, so a
process that reaches the port can still read every value, the model's state included); it cannot
stop a stranger from deleting or overwriting keys, or from holding connections, which stalls the
run (the replicas then wait, and give up after their timeouts); the quorum's gloo connections
(`quorum_group.py`) are torch's, unauthenticated. Replay is bounded: a signature binds the key's
name, so a value copied to another key does not verify, and a heartbeat copied back in time does
not move (`heartbeat.py`). Every name and MAC is keyed by `life_key(secret, nonce)`, where the
nonce is the random one the coordinator writes when it starts (`coordinator.py`): nothing signed
in one coordinator's life (a finished run's "finished", its votes) verifies in another's, so a
stranger who recorded a run cannot replay it into the next one, nor into the same coordinator
started again. What carries a run across a coordinator's restart is the disk (`durable.py`).

Without a secret the store is open, as torch's: names and values are the plain ones, and only the
readers' own checks (a malformed value is ignored and logged) stand between a stranger and the run.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import time

import torch.distributed as dist

__all__ = ["SignedStore", "CoordinatorLost", "StoreLost", "ignore", "life_key", "LOG", "LIMIT"]

LOG = logging.getLogger("manualdp.spmd.ft")
_SET, _APPEND = b"S", b"A"  # a value set whole; a chunk of an appended value (one line of its own)
_MAC = 32  # bytes of an HMAC-SHA256
_POLL = 0.005  # seconds between two looks at a key whose value does not verify
_ABSENT = b"\0manualdp-ft-absent\0"  # what `peek` expects: no value of the room's holds it, so nothing is written
# bytes torch's TCPStore server takes in one buffer of a write (TCPStoreLibUvBackend.cpp's "Invalid payload size"):
# a larger one closes the writer's connection, which then reads as a lost coordinator (`StoreLost`)
LIMIT = 8 << 20


class CoordinatorLost(RuntimeError):
    """The coordinator's store stopped answering: this replica saved what it holds and leaves."""


class StoreLost(CoordinatorLost):
    """A connection to the coordinator's store broke (torch's DistNetworkError), on any call: `reason` says how.

    Raised by every `SignedStore` call, so that no store call anywhere reaches the user as torch's
    raw "Failed to recv"; a `Manager` turns it into its own line, after saving what it holds.
    """

    def __init__(self, where: str, reason: str) -> None:
        self.where, self.reason = where, reason
        super().__init__(f"lost the coordinator at {where} ({reason}); start it again, then this replica with the "
                         f"same command")


class _Guarded:
    """A store client whose every call turns a broken connection into `StoreLost`."""

    def __init__(self, client: dist.Store) -> None:
        self.raw = client
        self.where = f"{getattr(client, 'host', '?')}:{getattr(client, 'port', '?')}"

    def __getattr__(self, name: str):
        attribute = getattr(self.raw, name)
        if not callable(attribute):
            return attribute

        def guarded(*args, **kwargs):
            try:
                return attribute(*args, **kwargs)
            except dist.DistNetworkError as e:
                text = str(e).strip()
                raise StoreLost(self.where, text.splitlines()[0] if text else type(e).__name__) from None
        return guarded


def life_key(secret: bytes, nonce: bytes) -> bytes:
    """The key that signs one coordinator's life: HMAC(secret, nonce), so that no signature outlives the life."""
    if not isinstance(secret, bytes) or not isinstance(nonce, bytes) or not nonce:
        raise TypeError(f"secret and nonce must be non-empty bytes, got {type(secret).__name__} and {nonce!r}")
    return hmac.new(secret, b"life\0" + nonce, hashlib.sha256).digest()


class SignedStore:
    """The replicas' view of the coordinator's store: the methods of `torch.distributed.Store` the room uses.

    Args:
        client: a connection to the coordinator's `TCPStore`.
        secret: the run's shared secret; None: the open mode, names and values as they are.
        prefix: the namespace of the keys (every key is `prefix/name` before it is signed).
    """

    def __init__(self, client: dist.Store, secret: bytes | None, prefix: str) -> None:
        self._client = client if isinstance(client, _Guarded) else _Guarded(client)
        self._secret, self._prefix = secret, prefix
        self._ignored: set[str] = set()  # the keys whose bad value was logged already: once each

    @property
    def signed(self) -> bool:
        return self._secret is not None

    def clone(self) -> "SignedStore":
        """A new connection to the same store, with the same secret and namespace (one per thread)."""
        return SignedStore(self._client.clone(), self._secret, self._prefix)

    def namespace(self, name: str) -> "SignedStore":
        """The keys below `name`, on a new connection (tests give each case its own)."""
        return SignedStore(self._client.clone(), self._secret, f"{self._prefix}/{name}")

    def meeting(self, name: str) -> dist.Store:
        """A plain store below a secret-derived prefix, on a new connection: where gloo's rendezvous meets."""
        return dist.PrefixStore(self._name(name), self._client.raw.clone())  # gloo's: a torch Store

    def set_timeout(self, seconds: float) -> None:
        self._client.set_timeout(datetime.timedelta(seconds=seconds))

    # ------------------------------------------------------------ names and seals

    def _name(self, key: str) -> str:
        full = f"{self._prefix}/{key}"
        if self._secret is None:
            return full
        return "manualdp-ft-signed/" + hmac.new(self._secret, b"name\0" + full.encode(), hashlib.sha256).hexdigest()

    def _mac(self, key: str, kind: bytes, value: bytes) -> bytes:
        mac = hmac.new(self._secret, b"%d:%s%s" % (len(key), key.encode(), kind), hashlib.sha256)
        mac.update(value)
        return mac.digest()

    def _seal(self, key: str, value) -> bytes:
        """S, the length (8 bytes), the MAC, the value: bytes a stranger appends after it change nothing."""
        value = _bytes(value)
        if self._secret is None:
            return value
        return _SET + len(value).to_bytes(8, "big") + self._mac(key, _SET, value) + value

    def _open(self, key: str, raw: bytes) -> bytes | None:
        """The value `raw` holds for `key` if it verifies (appended chunks: those that do), else None (logged)."""
        if self._secret is None:
            return raw
        head = 9 + _MAC
        if raw[:1] == _SET and len(raw) >= head:
            value = raw[head:head + int.from_bytes(raw[1:9], "big")]
            if hmac.compare_digest(raw[9:head], self._mac(key, _SET, value)):
                return value
        lines = [line for line in raw.split(b"\n") if line]
        chunks = [c for c in (self._chunk(key, line) for line in lines) if c is not None]
        if len(chunks) < len(lines):
            self.ignore(key, "it does not carry this run's secret (a stranger's write, or a replica with another "
                             "secret)")
        return b"".join(chunks) if chunks else None

    def _chunk(self, key: str, line: bytes) -> bytes | None:
        kind, _, rest = line.partition(b" ")
        mac, _, payload = rest.partition(b" ")
        if kind != _APPEND:
            return None
        try:
            value = bytes.fromhex(payload.decode())
            ok = hmac.compare_digest(bytes.fromhex(mac.decode()), self._mac(key, _APPEND, value))
        except ValueError:
            return None
        return value if ok else None

    def ignore(self, key: str, why: str) -> None:
        """Log, once per key, that the value of `key` was ignored, and why."""
        if key not in self._ignored:
            self._ignored.add(key)
            LOG.warning("manualdp fault tolerance: ignored the value of %r in the coordinator's store: %s", key, why)

    def _fits(self, key: str, *sent: bytes) -> None:
        """Refuse a write whose bytes torch's store server would not take, before they are sent."""
        size = max(len(b) for b in sent)
        if size > LIMIT:
            raise ValueError(f"the value of {key!r} is {size} bytes{' signed' * self.signed}, over the {LIMIT} bytes "
                             "torch's TCPStore takes in one write (a larger one closes the connection): keep it "
                             "smaller, or send it outside the coordinator's store")

    # ------------------------------------------------------------ torch.distributed.Store's methods

    def set(self, key: str, value) -> None:
        sealed = self._seal(key, value)
        self._fits(key, sealed)
        self._client.set(self._name(key), sealed)

    def append(self, key: str, value) -> None:
        """Add `value` at the end of `key`'s value: signed on its own, so a stranger's chunk drops alone."""
        value = _bytes(value)
        if self._secret is not None:
            value = b"\n%s %s %s\n" % (_APPEND, self._mac(key, _APPEND, value).hex().encode(), value.hex().encode())
        self._fits(key, value)
        self._client.append(self._name(key), value)

    def check(self, keys: list[str]) -> bool:
        """Whether every key of `keys` holds a value that verifies."""
        names = [self._name(k) for k in keys]
        if not self._client.check(names):
            return False
        return self._secret is None or all(self._open(k, self._client.get(n)) is not None for k, n in zip(keys, names))

    def get(self, key: str) -> bytes:
        """`key`'s value, once it holds one that verifies (waiting, as torch's `get`, up to the store's timeout)."""
        name = self._name(key)
        deadline = time.monotonic() + self._client.timeout.total_seconds()
        while True:
            value = self._open(key, self._client.get(name))
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"key {key!r} of the coordinator's store holds no value signed with this "
                                          f"run's secret within {self._client.timeout.total_seconds():g} s")
            time.sleep(_POLL)

    def peek(self, key: str) -> bytes | None:
        """`key`'s value if it holds one that verifies, else None: `check` and `get` in one round trip."""
        raw = self._client.compare_set(self._name(key), _ABSENT, _ABSENT)  # torch answers a missing key with _ABSENT
        return None if raw == _ABSENT else self._open(key, raw)

    def multi_get(self, keys: list[str]) -> list[bytes | None]:
        """The values of `keys` (which must all exist); None for each one that does not verify."""
        raws = self._client.multi_get([self._name(k) for k in keys])
        return [self._open(k, raw) for k, raw in zip(keys, raws)]

    def compare_set(self, key: str, expected, desired) -> bytes:
        """Write `desired` if `key` holds `expected` ("" : nothing yet); return the value it holds after, verified.

        A value in place that does not verify counts as nothing: it is replaced by `desired`
        when `expected` is "" (first writer wins among those who hold the secret).
        """
        name, sealed, expected = self._name(key), self._seal(key, desired), _bytes(expected)
        want = self._seal(key, expected) if expected else b""
        self._fits(key, want, sealed)
        for _ in range(100):  # a stranger racing the replacement can only delay it
            raw = self._client.compare_set(name, want, sealed)
            if raw == sealed:
                return _bytes(desired)
            # torch answers a compare_set on a missing key with the expected value: the key is gone
            gone = bool(want) and raw == want
            value = self._open(key, raw) if raw and not gone else None
            if value is None and expected:
                return b""  # what the caller expected is not there
            if value is None:
                want = b"" if gone else raw  # a forged or malformed value in place: replace it
            elif value != expected:
                return value  # another writer's value, verified
            else:
                want = raw  # the expected value, in other bytes (a stranger appended to them): swap those
            if len(want) > LIMIT:  # grown by a stranger's appends: torch's store cannot be sent it to compare
                raise ValueError(f"the value in place of {key!r} grew to {len(want)} bytes by appends without the "
                                 f"run's secret, over the {LIMIT} bytes torch's TCPStore takes in one write, so it "
                                 "cannot be swapped: a stranger writes to the coordinator's port; keep it off (bind "
                                 "the coordinator to an address only the replicas reach)")
        return b""

    def delete_key(self, key: str) -> bool:
        return self._client.delete_key(self._name(key))


def ignore(store, key: str, why: str) -> None:
    """Log that the value of `key` was ignored: once per key on a `SignedStore`, else every time."""
    if isinstance(store, SignedStore):
        store.ignore(key, why)
    else:
        LOG.warning("manualdp fault tolerance: ignored the value of %r in the coordinator's store: %s", key, why)


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
