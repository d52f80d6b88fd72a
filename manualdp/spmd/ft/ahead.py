"""The quorum asked ahead (torchft's async quorum): decided in a thread while the step's forward and backward run.

With `Manager(async_quorum=True)`, `start_step()` of a replica that stepped in the last agreed
quorum, holds its state and its group, returns at once (with that quorum): a thread makes the
last step durable and asks for this step's quorum, by the same rules (`quorum.py`), on the
manager's connection, which the main thread leaves alone until the answer is taken. The first
call that needs it (`average`, `should_commit`, `Manager.quorum`) takes it:

- the fast path (`fast`): the quorum is agreed, nobody in it has a state to receive, and all
  its members hold its group: the replica publishes its mark and the step goes on. In a run
  where nothing fails that is every step, and the quorum costs the step nothing but the wait
  for the slowest asker;
- else (a member joined or left, one is behind, the group changes) the replica enters the quorum
  as a synchronous `start_step` does (the state sent or received, the group formed), averages
  with the others as usual (a newcomer is not left waiting in its allreduce), and votes the step
  down: its forward and backward ran on the last quorum's state. The members all see the same
  quorum, so every one that asked ahead does so, and the step is discarded on all; the next one
  starts in the new quorum.

A commit's mark (`quorum.publish_mark`) and its record in the store (`durable.record_committed`) are
written by the thread too, handed over as the vote commits (`later`): they go while the optimizer
steps and the next batch loads, so that the next ask starts with its own round trips only.

A failure of the thread (no quorum in time, the run finished, the coordinator gone) is raised by
the call that takes the answer.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

from .quorum import Quorum
from .recovery import plan_recovery

__all__ = ["AskAhead", "fast"]


class AskAhead:
    """One daemon thread per manager that runs the asks handed to it, one at a time (no thread started per step)."""

    def __init__(self, name: str) -> None:
        self._asks: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = False
        self._job = False  # a job handed to `later` whose end was not taken yet
        threading.Thread(target=self._serve, name=f"manualdp-ft-quorum-{name}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            ask = self._asks.get()
            if ask is None:
                return
            try:
                self._answers.put((ask(), None))
            except BaseException as e:  # noqa: BLE001 - raised again in the main thread, by result()
                self._answers.put((None, e))

    @property
    def pending(self) -> bool:
        """An ask was handed over and its answer not yet taken."""
        return self._pending

    def ask(self, ask: Callable[[], Quorum]) -> None:
        """Run `ask()` in the thread; `result()` takes its answer."""
        self._pending = True
        self._asks.put(ask)

    def later(self, job: Callable[[], None]) -> None:
        """Run `job()` in the thread now, before the next ask (a commit's mark and record); `settled()` ends it."""
        self._job = True
        self._asks.put(job)

    def settled(self) -> None:
        """Wait for the job handed to `later`, if any: raise what it raised."""
        if self._job:
            self._job = False
            _, error = self._answers.get()
            if error is not None:
                raise error

    def result(self) -> Quorum:
        """Wait for the answer of the ask handed over; return its quorum, or raise what it raised."""
        self.settled()
        self._pending = False
        quorum, error = self._answers.get()
        if error is not None:
            raise error
        return quorum

    def stop(self) -> None:
        """The thread ends after the ask it runs, if any (its answer is not taken)."""
        self._asks.put(None)


def fast(quorum: Quorum, group: tuple[int, int] | None) -> bool:
    """Whether every member can step in `quorum` as it stands: agreed, nobody behind, all in the group held.

    The same answer on every member: `quorum.group` is the group they hold only if they all hold it.
    """
    return (quorum.agreed and group is not None and quorum.group == group[0] and len(quorum.members) == group[1]
            and not plan_recovery(quorum) and all(m.synced and m.step == quorum.step for m in quorum.members))
