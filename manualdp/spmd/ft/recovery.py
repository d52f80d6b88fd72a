"""Recovery: a replica that joins, or has fallen behind, receives the state of a member at the highest step.

Who sends to whom follows from the quorum alone (`plan_recovery`, a pure function), so every
member reads the same plan without a word more: the sources are the members at the quorum's
highest step whose state is the agreed one (at the very first quorum nobody's is: then the
first member by id, whose fresh model becomes everyone's); every other member that is behind,
or has no agreed state yet, receives from one of them, in turn.

A source writes its state (model, optimizer, loop state: whatever was registered with the
manager) as `torch.save` bytes under `state/ROUND/SOURCE` in the coordinator's store, and the
SHA-256 of those bytes beside it; a receiver waits for both (up to `timeout`), checks the sum
and loads the state with `weights_only=True`. torch's store takes at most `LIMIT` (8 MiB) in one
write, so bytes beyond one piece go in pieces under `state/ROUND/SOURCE/1`, `/2`, ..., their count
after the sum ("SHA256 COUNT"), at most `MOST` bytes in all. A piece missing when it is read (deleted
by a stranger, forgotten by its sender meanwhile, a count forged), or a count no sender writes, is a
RecoveryError at once, naming the piece; a sender named lost has its state forgotten by the receiver
that names it. The store suits models of a few hundred MiB; a larger one would go over the quorum's
group instead, by the same plan.
"""
from __future__ import annotations

import hashlib
import io
import re
import time
from typing import Callable

import torch
import torch.distributed as dist

from . import keys
from .quorum import POLL, Quorum
from .signed_store import LIMIT

__all__ = ["plan_recovery", "check_loadable", "send_state", "forget_state", "forget_lost", "receive_state",
           "RecoveryError"]

PIECE = LIMIT - 64  # bytes of the state in one write: the store's limit, less a signed value's seal (41 bytes)
MOST = 4 << 30  # bytes of a state the store carries: the coordinator holds it in memory, beside everything else
MOST_PIECES = -(-MOST // PIECE)


class RecoveryError(RuntimeError):
    """The state did not come within the deadline, came damaged (its checksum differs), or cannot be loaded."""


def plan_recovery(quorum: Quorum) -> dict[str, str]:
    """receiver id -> source id, for every member of `quorum` that must receive the state before its step.

    The top step is the highest among the holders of the agreed state (`quorum.step`): a member
    that counted more steps without holding it (a provisional quorum's, `quorum.py`) receives.
    """
    top = quorum.step
    sources = [m.id for m in quorum.members if m.step == top and m.synced]
    if not sources:  # nobody holds an agreed state yet: the first at the top step defines it
        sources = [next(m.id for m in quorum.members if m.step == top)]
    receivers = [m.id for m in quorum.members if m.id not in sources and (m.step < top or not m.synced)]
    return {r: sources[i % len(sources)] for i, r in enumerate(receivers)}


def check_loadable(state: dict, source: str) -> None:
    """RecoveryError (its `final` True: sending again will not help) naming each entry torch.load(weights_only=True)
    refuses: on the source, where the name of the user's registered state is known."""
    bad = [name for name, value in state.items() if _refused(value)]
    if bad:
        error = RecoveryError(f"replica {source!r} cannot send its state: {', '.join(map(repr, bad))} holds what "
                              f"torch.load(weights_only=True) refuses ({_refused(state[bad[0]])}); register states "
                              f"of tensors, numbers, strings, lists and dicts")
        error.final = True
        raise error


def _save(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _refused(value) -> str | None:
    """Why torch.load(weights_only=True) refuses `value` saved, in a few words; None if it loads."""
    try:
        torch.load(io.BytesIO(_save(value)), weights_only=True)
        return None
    except Exception as e:  # noqa: BLE001 - whatever the unpickler refuses
        return _why(e)


def _why(error: Exception) -> str:
    """torch.load's refusal in a few words (its own message runs to a dozen lines)."""
    found = re.search(r"Unsupported global: GLOBAL \S+", str(error))
    return found.group(0) if found else type(error).__name__


def send_state(store: dist.Store, round_: int, source: str, state: dict) -> str:
    """Write `state` for the receivers of `round_`; return its SHA-256 (hex)."""
    blob = _save(state)
    if len(blob) > MOST:
        error = RecoveryError(f"replica {source!r} cannot send its state: {len(blob)} bytes, over the {MOST} bytes "
                              "the coordinator's store carries")
        error.final = True
        raise error
    digest = hashlib.sha256(blob).hexdigest()
    pieces = [blob[at:at + PIECE] for at in range(0, len(blob), PIECE)] or [b""]
    for i, piece in enumerate(pieces):
        store.set(_piece(round_, source, i), piece)
    count = f" {len(pieces)}" if len(pieces) > 1 else ""
    store.set(keys.state_sha256(round_, source), digest + count)  # written last: the blob is whole once this is there
    return digest


def _piece(round_: int, source: str, i: int) -> str:
    """The key of piece `i` of a state: the state's own key for the first."""
    return keys.state(round_, source) + (f"/{i}" if i else "")


def forget_state(store: dist.Store, round_: int, source: str) -> None:
    """Remove what `send_state` wrote for `round_` (its receivers have read it, or given up)."""
    store.delete_key(keys.state_sha256(round_, source))
    store.delete_key(_piece(round_, source, 0))
    i = 1
    while store.delete_key(_piece(round_, source, i)):  # the further pieces, up to the first missing
        i += 1


def forget_lost(store: dist.Store, received: tuple[int, str] | None, quorum: Quorum,
                live: Callable[[list[str]], set[str]]) -> tuple[int, str] | None:
    """Forget the state received as `received` (round, source) once its source is lost (neither in `quorum` nor
    live): it died after sending, and would have forgotten it at its next step. Returns what is still watched."""
    if received is None or received[0] == quorum.round:
        return received  # nothing watched, or its round is under way: other receivers may be reading
    round_, source = received
    if source in quorum.ids or source in live([source]):
        return received  # it steps on, and forgets its own
    forget_state(store, round_, source)  # its round has ended: nobody reads it now (a live sender never sends it again)
    return None


def receive_state(store: dist.Store, round_: int, source: str, timeout: float,
                  gone: Callable[[], bool] | None = None, who: str | None = None) -> tuple[dict, str]:
    """The state `source` sent for `round_` and its SHA-256, checked; RecoveryError after `timeout` s or if damaged.

    `gone()`: whether the sender died meanwhile (its heartbeat stopped): RecoveryError at once, naming
    it (`who`, default "replica SOURCE"), so that the receiver asks again for another holder, or waits for one;
    what the lost sender wrote is forgotten here (nobody else would: it forgets its own at its next step).
    """
    sha256 = keys.state_sha256(round_, source)
    deadline = time.monotonic() + timeout
    while not store.check([sha256]):
        if time.monotonic() > deadline:
            raise RecoveryError(f"the state of replica {source!r} (round {round_}) did not come within {timeout:g} s")
        if gone is not None and gone():
            _lost(store, round_, source, who)
        time.sleep(POLL)
    expected, _, count = store.get(sha256).decode(errors="replace").partition(" ")  # a stranger's: damaged
    pieces = _count(count, round_, source)
    blob = b"".join(_read(store, round_, source, i, pieces, gone, who) for i in range(pieces))
    digest = hashlib.sha256(blob).hexdigest()
    if digest != expected:
        raise RecoveryError(f"the state of replica {source!r} (round {round_}) arrived damaged: "
                            f"sha256 {digest[:12]}..., sent as {expected[:12]}...")
    try:
        return torch.load(io.BytesIO(blob), weights_only=True), digest
    except Exception as e:  # noqa: BLE001 - the source names the entry (`check_loadable`)
        raise RecoveryError(f"the state of replica {source!r} (round {round_}) cannot be loaded with "
                            f"weights_only=True: {_why(e)}") from None


def _lost(store: dist.Store, round_: int, source: str, who: str | None) -> None:
    """Forget what the lost `source` wrote for `round_`, and raise the RecoveryError that names it."""
    forget_state(store, round_, source)
    sender = who or f"replica {source!r}"
    raise RecoveryError(f"{sender} was lost while sending its state (round {round_}): its heartbeat "
                        f"stopped; asking again for another holder of the run's state")


def _count(count: str, round_: int, source: str) -> int:
    """The number of pieces the sum names ("" : one); RecoveryError at once for one no sender writes."""
    if not count:
        return 1
    if count.isdecimal() and len(count) <= 6 and 1 <= int(count) <= MOST_PIECES:
        return int(count)
    raise RecoveryError(f"the state of replica {source!r} (round {round_}) arrived damaged: its sum names "
                        f"{count[:20]!r} pieces, not 1 to {MOST_PIECES} (at most {MOST} bytes); asking again for "
                        f"another holder of the run's state")


def _read(store: dist.Store, round_: int, source: str, i: int, pieces: int,
          gone: Callable[[], bool] | None, who: str | None) -> bytes:
    """Piece `i` of `pieces`; RecoveryError at once if it is not there (the sum is written after every piece)."""
    key = _piece(round_, source, i)
    value = store.peek(key)  # one round trip: a piece deleted between a check and a get would wait out the store
    if value is not None:
        return value
    if gone is not None and gone():
        _lost(store, round_, source, who)
    unsigned = ", or holds no value signed with this run's secret" if getattr(store, "signed", False) else ""
    raise RecoveryError(f"the state of replica {source!r} (round {round_}): piece {i + 1} of {pieces} ({key!r}) is "
                        f"missing{unsigned} (forgotten by its sender, or deleted or its count forged by a stranger); "
                        f"asking again for another holder of the run's state")
