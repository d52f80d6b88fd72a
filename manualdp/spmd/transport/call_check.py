"""The call check: ranks that call a collective differently all raise, naming who had what.

Every rank's fingerprint of its call (size, dtype, algorithm, segment size, call number, the
schedule it runs, which collective and its root, the caller's step and identity) decides the
tag its data travels on (`_tag`): only messages of identical calls pair, so nothing pairs with
a wrong message, and a receive posted for another size than its send (which makes gloo abort)
never meets it. What differs is how the ranks learn that their calls differ:

- two ranks on gloo (`TagCheck`): nothing more travels while the calls agree. The first
  message of the first round to arrive proves the peer called alike, before anything of it is
  used; a first round that is late makes the ranks compare fingerprints through the store
  (`late.py`), and when they differ each completes what the other posted toward it, and both
  raise;
- more ranks, or NCCL (`HeaderCheck`): the fingerprints go to every rank in fixed-size header
  messages (`everyone_hears_everyone`), beside the first round of data on gloo, alone first on
  NCCL. Then every rank compares the same table. A rank that knows only its partners in the
  first round cannot know a third rank called otherwise before it adds what arrived, so the
  headers stay. On a mismatch each rank completes what every peer posted toward it, then raises.

Either way a refused call leaves the tensor unchanged: the first round's receives all land in
scratch space until the check has passed. The check alone, with no data to carry it
(`same_call`: DDP's one check per step, an empty tensor, the first "auto" call), costs one
round trip and carries a flag every rank sees (`allreduce`: measure the link again).
"""
from __future__ import annotations

import datetime
import functools
import sys
import zlib
from array import array

import torch
import torch.distributed as dist

from ...schedule import ALGORITHMS, COLLECTIVES, Schedule, Transfer, get_collective
from .group import GroupState, group_state
from .late import LateWatch, group_store
from .p2p import exchange, plan, schedule_of
from .peers import peer_error, refused_alike

__all__ = ["HEADER_TAG", "check_same_call", "same_call", "make_check", "HeaderCheck", "TagCheck",
           "everyone_hears_everyone", "differs"]

HEADER_TAG = 2 ** 31 - 1  # the headers' tag; unchecked data goes on tag 0, checked data on `HeaderCheck.tag`
# compared, named in the error; "step" is a wrapper's count of its steps (-1: a call on its own)
# "wrapper": an identity a wrapper passes for itself (`identity`, 0: none), so that two wrappers' calls never pair
_FIELDS = ("elements", "dtype", "algorithm", "segment_bytes", "call", "schedule", "collective", "root", "step",
           "wrapper")
_SIZE, _FLAG = len(_FIELDS), len(_FIELDS) + 1  # then the element size (compared), and the flag (not compared)
# every dtype torch has, each its own number (two unlisted 1-byte types, bool and float8, once looked alike)
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_NAMES = sorted((*ALGORITHMS, "auto"))  # every collective's algorithms are allreduce's or among them
_COLLECTIVES = sorted(COLLECTIVES)


@functools.lru_cache(maxsize=64)
def everyone_hears_everyone(n: int) -> Schedule:
    """Each device's own chunk sent on to every device (an all-gather) in ceil(log2 n) rounds.

    Dissemination: before a round every device holds its own chunk and the `known - 1` chunks
    below it (mod n); it passes them to the device `known` places up, which then holds twice as
    many. Every round, every device sends one message and receives one, of fixed size.
    """
    rounds, known = [], 1
    while known < n:
        new = min(known, n - known)  # chunks the receiver does not hold yet
        rounds.append(tuple(Transfer(r, (r + known) % n, (r - j) % n, False)
                            for r in range(n) for j in reversed(range(new))))
        known += new
    return Schedule("dissemination", n, n, tuple(rounds), ("all-gather",) * len(rounds))


def check_same_call(tensor: torch.Tensor, algorithm: str, segment_bytes: int, group, timeout: float | None, *,
                    numel: int | None = None, flag: bool = False, step: int = -1, identity: int = 0) -> bool:
    """Raise on every rank unless all called allreduce alike: same size, dtype, algorithm, segment size, call number.

    The check alone, before any data moves. Returns whether any rank raised `flag`, a bit that
    rides along uncompared, so that every rank takes the same decision from it (`allreduce`:
    measure the link again).

    `numel` (default `tensor.numel()`): the size to compare, for a caller that checks a whole
    sequence of calls at once (`DistributedDataParallel`: all of a step's buckets). The call
    number counts this group's checked calls: a rank that is a call ahead, or that lost one to
    an error the others did not see, is found even when the sizes happen to agree. `step`: the
    caller's own count of its steps (a ladder rung's forward passes), compared too: a rank that
    skipped a backward pass, or ran one more, meets its peers' check of another step.
    `identity` (0: none): a number that stands for the caller (a wrapper's own), compared too.
    """
    return same_call(group_state(group), tensor, algorithm, segment_bytes, timeout, numel=numel, flag=flag, step=step,
                     identity=identity)


def same_call(state: GroupState, tensor: torch.Tensor, algorithm: str, segment_bytes: int, timeout: float | None, *,
              numel: int | None = None, flag: bool = False, collective: str = "allreduce", root: int = 0,
              step: int = -1, identity: int = 0) -> bool:
    """`check_same_call` on the group whose state is `state` (of `collective`, rooted at group rank `root`)."""
    check = make_check(state, tensor, algorithm, segment_bytes, timeout, numel=numel, flag=flag,
                       collective=collective, root=root, step=step, identity=identity)
    if isinstance(check, TagCheck):
        return check.alone()
    check.start()
    check()
    return check.flagged


def make_check(state: GroupState, tensor: torch.Tensor, algorithm: str, segment_bytes: int, timeout: float | None,
               **fields) -> "HeaderCheck | TagCheck":
    """The call check for this group: `TagCheck` for two ranks on gloo (nothing sent when the calls agree) in a
    group torch made (its store is known), else `HeaderCheck`.

    `fields`: `numel`, `flag`, `schedule`, `collective`, `root`, `step`, `identity`, as `HeaderCheck` takes them.
    """
    if state.late is None and state.early and len(state.peers) == 2:
        store = group_store(state.pg())
        state.late = LateWatch(state.rank, store) if store is not None else False
    kind = TagCheck if state.late else HeaderCheck
    return kind(state, tensor, algorithm, segment_bytes, timeout, **fields)


def _fingerprint(state: GroupState, tensor: torch.Tensor, algorithm: str, segment_bytes: int, *, numel: int | None,
                 flag: bool, schedule: str | None, collective: str, root: int, step: int,
                 identity: int) -> tuple[list[int], int]:
    """This call's row (the compared fields, `_FIELDS`, the element size, the flag) and its data's tag; counts the
    call."""
    state.calls += 1
    head, tail, crc, tail_bytes = _shape(tensor.numel() if numel is None else numel, tensor.dtype,
                                         tensor.element_size(), algorithm, segment_bytes, schedule, collective, root,
                                         step, identity, flag)
    call = state.calls.to_bytes(8, sys.byteorder, signed=True)
    # `_tag` of the row, from the CRC of the fields before the call number, cached: only the number is new
    return [*head, state.calls, *tail], 2 ** 30 + zlib.crc32(tail_bytes, zlib.crc32(call, crc)) % (2 ** 30 - 1)


@functools.lru_cache(maxsize=256)  # a loop calls with the same few shapes again and again
def _shape(numel: int, dtype: torch.dtype, element_size: int, algorithm: str, segment_bytes: int,
           schedule: str | None, collective: str, root: int, step: int, identity: int, flag: bool) -> tuple:
    """A call's row without its number: the fields before it, those after it, the CRC of the first and the bytes
    of the others (of the compared ones, as `_tag` hashes them)."""
    head = (numel, _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES), _NAMES.index(algorithm), segment_bytes)
    compared = (-1 if schedule is None else _NAMES.index(schedule), _COLLECTIVES.index(collective), root, step,
                identity, element_size)
    crc = zlib.crc32(array("q", head).tobytes())
    return head, (*compared, int(flag)), crc, array("q", compared).tobytes()


def _refused(collective: str, rows: list[list[int]]) -> ValueError:
    """The one error of a refused call, the same on every rank (`peers.refused_alike`)."""
    return refused_alike(ValueError(f"rank {dist.get_rank()}: {collective} called differently across ranks: "
                                    f"{_differences(rows)}; the ranks are out of step (one ran out of batches "
                                    "or skipped a step) or were given other arguments"))


class TagCheck:
    """Two ranks on gloo: the call's fingerprint is its data's tag, and nothing else travels while the calls agree.

    The executor posts the first round on `self.tag`, calls `start()` (which arms the group's
    `late.LateWatch`), waits for the round's first message, then `landed()`: messages of another
    call carry another tag and never pair, so one completed message means the peer called
    alike, and the rest of the round pipelines as unchecked data does. If the round is late the
    watch compares fingerprints through the store and, when they differ, settles the peer's
    first round (`settle`) so that every wait ends; `landed()` then raises on both ranks,
    naming what each had. The round's receives all land in scratch space,
    so a refused call leaves the tensor unchanged. `alone()` is the check without data (a round
    trip: the rows themselves, on their tag), which carries the flag.
    """

    def __init__(self, state: GroupState, tensor: torch.Tensor, algorithm: str, segment_bytes: int,
                 timeout: float | None, *, numel: int | None = None, flag: bool = False, schedule: str | None = None,
                 collective: str = "allreduce", root: int = 0, step: int = -1, identity: int = 0) -> None:
        self.row, self.tag = _fingerprint(state, tensor, algorithm, segment_bytes, numel=numel, flag=flag,
                                          schedule=schedule, collective=collective, root=root, step=step,
                                          identity=identity)
        self.compared = self.row[:_FLAG]
        self.waits_first = True  # the executor waits for the first round's first message, then calls `landed()`
        self.state, self.timeout, self.collective = state, timeout, collective
        self.flagged = False

    def start(self) -> None:
        """Watch the first round (its receives are posted)."""
        self.state.late.arm(self)

    def __call__(self) -> None:
        """Nothing to exchange: the tag did it."""

    def landed(self) -> None:
        """The first round has ended: raise on a mismatch (the round was settled, not paired)."""
        other = self.state.late.landed()
        if other is not None:
            me = self.state.rank
            rows = [self.compared + [0] if r == me else list(other) + [0] for r in range(2)]
            raise _refused(self.collective, rows)

    def abandon(self) -> None:
        """The first round failed (a peer gone): stop watching."""
        self.state.late.abandon()

    def alone(self) -> bool:
        """The check without data: the two rows swapped on the call's tag; returns whether either raised the flag."""
        table = torch.zeros(2, len(self.row), dtype=torch.int64)
        table[self.state.rank] = torch.tensor(self.row)
        exchange(table.view(-1), _header_rounds(2, self.state.rank, len(self.row)), self.state, self.timeout,
                 self.tag, check=self)
        self.flagged = bool(table[:, _FLAG].any())
        return self.flagged

    def settle(self, other: list[int]) -> None:
        """Complete what the peer, whose compared fields are `other`, posted toward this rank in its first round."""
        _settle(self.state, [other if p != self.state.rank else None for p in range(2)], self.timeout)


class HeaderCheck:
    """One call's check: `start()` sends the headers, `check()` completes them and raises on a mismatch.

    `schedule` (default None: the check alone): the algorithm this rank runs; the executor
    (`manualdp.spmd.transport.p2p.run_schedule`'s `check`) posts its first round on `self.tag`, between
    `start()` and `check()`. Afterwards `flagged` says whether any rank raised `flag`.
    `collective` and `root` say which of `manualdp.schedule.COLLECTIVES` it is; `step` is the
    caller's step count (-1: none), `identity` a number standing for the caller (0: none), all compared.

    On gloo the receives of the next call's headers are posted as soon as this call's have
    arrived (they are of fixed size, on a tag of their own), and kept in the group's state:
    gloo sends a message at once only to a receiver that has already posted its receive, and
    otherwise exchanges notifications first, a round trip through both ranks' network threads.
    """

    def __init__(self, state: GroupState, tensor: torch.Tensor, algorithm: str, segment_bytes: int,
                 timeout: float | None, *, numel: int | None = None, flag: bool = False,
                 schedule: str | None = None, collective: str = "allreduce", root: int = 0, step: int = -1,
                 identity: int = 0) -> None:
        self.row, self.tag = _fingerprint(state, tensor, algorithm, segment_bytes, numel=numel, flag=flag,
                                          schedule=schedule, collective=collective, root=root, step=step,
                                          identity=identity)
        self.collective = collective
        self.waits_first = False  # `__call__` knows: the executor needs to wait for nothing first
        self.state, self.timeout, self.device = state, timeout, tensor.device
        self.deadline = None if timeout is None else datetime.timedelta(seconds=timeout)
        self.flagged = False

    def landed(self) -> None:
        """The first round has ended: nothing more to know (`__call__` compared the headers before)."""

    def abandon(self) -> None:
        """Nothing to stop."""

    def start(self) -> None:
        """Send this rank's row (gloo; on NCCL the whole exchange happens in `check()`)."""
        state = self.state
        if not state.early:
            return
        posted, state.headers = state.headers, None
        try:
            self.table, self.recvs, self.rounds = posted or _post_receives(state, len(self.row))
            self.table.numpy()[state.rank] = self.row
            self.sends = self._send(0)
        except RuntimeError as e:
            raise peer_error(e, None, self.timeout) from e

    def _send(self, i: int) -> list:
        flat, pg, peers = self.table.view(-1), self.state.pg(), self.state.peers
        return [(peers[m.peer], pg.send([flat[m.lo:m.hi]], m.peer, HEADER_TAG)) for m in self.rounds[i].sends]

    def __call__(self) -> None:
        """Complete the exchange: afterwards every rank holds every rank's row; raise unless all agree."""
        state = self.state
        if not state.early:  # NCCL: each round's messages as one group
            n, width = len(state.peers), len(self.row)
            table = torch.tensor([self.row if i == state.rank else [0] * width for i in range(n)],
                                 dtype=torch.int64, device=self.device)
            exchange(table.view(-1), _header_rounds(n, state.rank, width), state, self.timeout, HEADER_TAG)
        else:
            peer, sent = None, []
            try:
                for i, received in enumerate(self.recvs):
                    for peer, work in received:
                        self._wait(work)
                    sent += self.sends
                    self.sends = self._send(i + 1) if i + 1 < len(self.rounds) else []
                for peer, work in sent:
                    self._wait(work)
                state.headers = _post_receives(state, len(self.row))  # the next call's, now
                # Freed only after the next call's messages are posted: a gloo work freed right after its
                # wait costs about 2 ms on a 2-core machine (`manualdp.spmd.transport.p2p._keep_until_next_call`).
                state.local.header_works = (self.recvs, sent)
            except RuntimeError as e:
                raise peer_error(e, peer, self.timeout) from e
            table = self.table
        rows = table.tolist()
        if all(row[:_FLAG] == self.row[:_FLAG] for row in rows):
            self.flagged = any(row[_FLAG] for row in rows)
            return
        mine = self.row[:_FLAG]
        # then nothing of this call is in flight: every rank raises alike (`peers.refused_alike`)
        _settle(state, [None if row[:_FLAG] == mine or row[5] < 0 else row for row in rows], self.timeout)
        raise _refused(self.collective, rows)

    def _wait(self, work) -> None:
        work.wait() if self.deadline is None else work.wait(self.deadline)


def _settle(state: GroupState, rows: list[list[int] | None], timeout: float | None) -> None:
    """Complete what every peer whose row is given posted toward this rank in its first round: receive its sends,
    answer its receives.

    `rows`: per group rank, the fingerprint of a peer that called otherwise, or None (this
    rank, a peer whose messages pair with this rank's own, or one whose headers were completed).
    """
    me, pg, n = state.rank, state.pg(), len(rows)
    works = []
    for p, row in enumerate(rows):
        if row is None or p == me:
            continue
        first, element_size = _first_round(row, p, n)
        tag = _tag(row)
        for m in first.sends:
            if m.peer == me:
                works.append((state.peers[p],
                              pg.recv([torch.empty((m.hi - m.lo) * element_size, dtype=torch.uint8)], p, tag)))
        for m in first.recvs:
            if m.peer == me:
                works.append((state.peers[p],
                              pg.send([torch.zeros((m.hi - m.lo) * element_size, dtype=torch.uint8)], p, tag)))
    deadline = None if timeout is None else datetime.timedelta(seconds=timeout)
    for peer, work in works:
        try:
            work.wait() if deadline is None else work.wait(deadline)
        except RuntimeError as e:
            raise peer_error(e, peer, timeout) from e


def _first_round(row: list[int], rank: int, n: int):
    """The first round that group rank `rank`, whose fingerprint is `row`, posted, and its element size.

    A row without a schedule is a check alone (`TagCheck.alone`): the rows themselves, swapped.
    """
    if row[5] < 0:
        width = _FLAG + 1
        return plan(everyone_hears_everyone(n), rank, n * width, n * width)[0], 8
    numel, segment_bytes, element_size = row[0], row[3], row[_SIZE]
    return plan(_schedule(row, n), rank, numel, max(1, segment_bytes // element_size))[0], element_size


def _schedule(row: list[int], n: int) -> Schedule:
    """The schedule a rank whose fingerprint is `row` runs, on `n` ranks."""
    collective, algorithm = _COLLECTIVES[row[6]], _NAMES[row[5]]
    return schedule_of(algorithm, n) if collective == "allreduce" else get_collective(collective, algorithm, n, row[7])


def _post_receives(state: GroupState, width: int):
    """A table for one call's headers, every round's receives posted into it (each lands in rows of its own),
    the rounds."""
    n, pg, peers = len(state.peers), state.pg(), state.peers
    table = torch.zeros(n, width, dtype=torch.int64)
    flat, rounds = table.view(-1), _header_rounds(n, state.rank, width)
    recvs = [[(peers[m.peer], pg.recv([flat[m.lo:m.hi]], m.peer, HEADER_TAG)) for m in rnd.recvs] for rnd in rounds]
    return table, recvs, rounds


@functools.lru_cache(maxsize=64)
def _header_rounds(n: int, rank: int, width: int):
    """This rank's share of the headers' exchange: `plan` keyed by plain numbers, cheap to look up on every call."""
    return plan(everyone_hears_everyone(n), rank, n * width, n * width)


def _tag(row: list[int]) -> int:
    """The data tag of a call: a hash of its compared fields, from 2**30 to 2**31 - 2, above the tags people pick.

    Distinct calls share a tag with odds 2**-30.
    """
    return 2 ** 30 + zlib.crc32(array("q", row[:_FLAG]).tobytes()) % (2 ** 30 - 1)


def differs(field: str, values: list[str], wildcard: str | None = None) -> str:
    """One differing field, as every agreement error of manualdp names it:
    `algorithm ring..tree (per rank: ring, tree)`.

    `wildcard`: a value that matches every other (shown per rank, left out of the range).
    """
    seen = sorted({v for v in values if v != wildcard}, key=_order)
    return f"{field} {'..'.join(seen)} (per rank: {', '.join(values)})"


def _order(value: str) -> tuple:
    """Integers (digests, sizes; negative ones too) numerically, then other values by length and text."""
    integer = value.lstrip("-").isdecimal() and value.count("-") <= 1
    return (0, int(value), "") if integer else (1, len(value), value)


def _differences(rows: list[list[int]]) -> str:
    names = {"dtype": lambda v: str(_DTYPES[v]).replace("torch.", "") if v < len(_DTYPES) else "other",
             "algorithm": lambda v: _NAMES[v], "schedule": lambda v: _NAMES[v] if v >= 0 else "none",
             "collective": lambda v: _COLLECTIVES[v], "step": lambda v: str(v) if v >= 0 else "none"}
    differ = []
    for i, field in enumerate(_FIELDS):
        values = [names.get(field, str)(row[i]) for row in rows]
        if len(set(values)) > 1:
            differ.append(differs(field, values))
    if not differ:  # two dtypes outside the list above
        differ.append(f"element size (per rank: {', '.join(str(row[_SIZE]) for row in rows)})")
    return "; ".join(differ)
