"""The phases of `Manager.start_step`: ask for the quorum, hold its state, send or receive it, join its group.

`Manager` (`manager.py`) is what a loop calls; this is how it enters each step's quorum, in
order: `_start_step` asks (`quorum.py`) until a quorum takes this replica, and `_enter` makes it
a member (its mark published, the state sent to or received from a member at the highest step,
`recovery.py`, the group re-formed if the members changed, `quorum_group.py`). With
`async_quorum` the asking runs in a thread during forward and backward (`_ask_ahead`, `ahead.py`),
and the step's first call that needs the quorum takes it (`_settle`).
"""
from __future__ import annotations

import logging
import time

from ..transport.agree import agree
from . import admission
from .ahead import fast
from .quorum import PATIENCE, Member, Quorum, publish_mark, wait_for_quorum
from .quorum_group import form_group
from .recovery import RecoveryError, forget_lost, forget_state
from .signed_store import StoreLost

__all__ = ["Phases", "without_traceback"]

_log = logging.getLogger("manualdp.spmd.ft")


class Phases:
    """How a `Manager` enters each step's quorum (a part of `Manager`: it uses the manager's fields)."""

    def _start_step(self) -> Quorum:
        started, failure = time.monotonic(), None
        if self._sent is not None:  # the receivers of that round have read it, or given up
            forget_state(self.store, self._sent, self.id)
            self._sent = None
        settings = admission.canonical(self._settings)
        if self._round == 0:  # before its first ask, a misfit is refused (admission.py)
            admission.check(self.store, self.id, settings)
        while True:
            try:
                quorum = wait_for_quorum(self.store, self._member(settings), self._liveness, self._round,
                                         self.quorum_timeout, self.timeout, started, self._floor)
            except TimeoutError as e:
                if failure is None:
                    raise
                raise TimeoutError(f"replica {self.id!r}: no step could start within {time.monotonic() - started:.0f}"
                                   f" s; the last attempt failed with: {failure}") from e
            self._round, self._quorum, self._in_step = quorum.round, quorum, True
            failed = self._enter(quorum, settings)
            if failed is None:
                return quorum
            failure = failed
            if time.monotonic() - started > PATIENCE * self.timeout:
                raise TimeoutError(f"replica {self.id!r}: no step could start within {PATIENCE * self.timeout:g} s; "
                                   f"the last attempt failed with: {failed}") from failed

    def _member(self, settings: str) -> Member:
        return Member(self.id, self.step, self.synced, self._group, self.min_replicas or 0, self._since,
                      admission.digest(settings), self.capacity)

    _received: tuple[int, str] | None = None  # (round, source) of the last state received, till its source forgets it

    def _enter(self, quorum: Quorum, settings: str) -> BaseException | None:
        """Hold `quorum`'s state, send or receive it, join its group; None, or the failure ridden out (voted on)."""
        if quorum.agreed and self.synced and self.step == quorum.step:
            self._hold(quorum.round)  # before anything can fail: the quorum's other members count on it
        try:
            self._received = forget_lost(self.store, self._received, quorum, self._liveness.live)  # its sender died
            received = self._exchange_state(quorum)
            if self._group is None or self._group[0] != quorum.group:
                self._leave_group()
                self._join_group(quorum)
                self._group = (quorum.group, len(quorum.members))
                admission.publish(self.store, self.id, settings)  # the first quorum's are the run's
        except RuntimeError as e:  # RecoveryError, and torch.distributed's errors (a member gone meanwhile)
            if getattr(e, "final", False) or isinstance(e, StoreLost):  # a state that cannot load; no coordinator
                raise
            self.last_error = without_traceback(e)
            if isinstance(e, RecoveryError):  # its sender lost, or its state late or damaged: said, and asked again
                _log.warning(f"replica {self.id!r}: {str(e).strip().splitlines()[0]}")
            self.should_commit(False)
            return e
        if received is not None:  # outside the try: a model of another shape raises, as load_state_dict does
            state, source, digest = received
            self._received = (quorum.round, source)
            self.load_state_dict(state)
            self._pending.clear()  # the steps this replica counted alone are not the run's: the source's are
            self.recoveries.append({"round": quorum.round, "source": source, "step": self.step, "sha256": digest})
        if quorum.agreed and not (received is None and self.synced and self._since == quorum.round):
            self._hold(quorum.round)  # unless held above, and nothing received since
        elif not quorum.agreed:  # provisional: its steps are its own until it meets a holder of the run's state
            self.synced = False
            publish_mark(self.store, self.id, None)
        self._ok = True
        return None

    def _join_group(self, quorum: Quorum) -> None:
        """Join `quorum`'s process group and compare the settings over it (a replica group's leader: `ft/group.py`)."""
        form_group(self.store, quorum.group, quorum.rank(self.id), len(quorum.members), self.timeout)
        agree("the replicas' setup", self._settings, timeout=self.timeout, shown={"replica": self.id},
              hint="every replica must be started with the same settings")

    _tidied = False  # `_tidy` ran since the last ask: the ask starts with its own round trips

    def _tidy(self) -> None:
        """In `AskAhead`'s thread, as the vote commits (no disk): publish the commit's mark and record the step."""
        self._publish_due()
        self._make_durable(asking=True)  # the next ask on this thread raises RunFinished if the run has ended
        self._tidied = True

    def _tidy_taken(self) -> None:
        """Wait for the last commit's mark and record (`Phases._tidy`, on the ask thread) before this thread's next use
        of the store. What failed there is done again by the next ask (or `start_step`, `finish`) and raised by it."""
        if self._ahead is not None:
            try:
                self._ahead.settled()
            except Exception:  # noqa: S110 - redone where the caller is told (`_tidied` stays False)
                pass

    def _ask_ahead(self) -> Quorum:
        """In `AskAhead`'s thread: make the last step durable (without a disk), ask for this step's quorum, hold it."""
        if not self._tidied:
            self._publish_due()
            if self._disk is None:
                self._make_durable(asking=True)
        self._tidied = False
        quorum = wait_for_quorum(self.store, self._member(admission.canonical(self._settings)), self._liveness,
                                 self._round, self.quorum_timeout, self.timeout, time.monotonic(), self._floor)
        if fast(quorum, self._group):
            self._hold(quorum.round)  # as start_step does, before anything can fail
        return quorum

    _unentered = False  # a quorum asked ahead was taken off the fast path and is not entered yet (`quorum_ready`)

    def quorum_ready(self) -> bool:
        """Take the quorum asked ahead, if any, without entering it; False if the step needs it entered first.

        Entering may load a received state into the model: a caller under autograd (`FaultTolerantDDP`'s
        backward) leaves that to the next call that needs the quorum, after backward.
        """
        self._settle(enter=False)
        return not self._unentered

    def _settle(self, enter: bool = True) -> None:
        """Take the quorum asked ahead, if any: on the fast path it is held; else enter it, and discard this step."""
        if self._ahead is not None and self._ahead.pending:
            try:
                quorum = self._ahead.result()
            except BaseException as e:
                self._in_step = False
                self._raise_if_lost(e)
                raise
            self._round, self._quorum = quorum.round, quorum
            self._unentered = not fast(quorum, self._group)
        if not (self._unentered and enter):
            return
        self._unentered = False
        if self._enter(self._quorum, admission.canonical(self._settings)) is not None:
            self._in_step = True  # it voted discard: the caller's should_commit() reads that outcome again
        # forward and backward ran on the last quorum's state: the allreduces go (nobody waits for this
        # replica), and every member that asked ahead votes the step down (ahead.py)
        self._stale = True

    def _hold(self, round_: int) -> None:
        """This replica holds the agreed state, as of quorum `round_`: say so to the others."""
        self.synced, self._since = True, round_
        publish_mark(self.store, self.id, (self.step, self._since))


def without_traceback(error: BaseException) -> BaseException:
    """`error` and its causes without their tracebacks: kept, those frames would keep a failed group's sends alive."""
    seen = error
    while seen is not None:
        seen.__traceback__ = None
        seen = seen.__cause__ or seen.__context__
    return error
