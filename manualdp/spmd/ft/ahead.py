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
  as a synchronous `start_step` does (the state sent or received, the group formed), and the
  step is discarded on every member (they all see the same quorum, so all take this path): its
  forward and backward ran on the last quorum's state. The next step starts in the new quorum.

A failure of the thread (no quorum in time, the run finished, the coordinator gone) is raised by
the call that takes the answer.
"""
from __future__ import annotations

import threading
from typing import Callable

from .quorum import Quorum
from .recovery import plan_recovery

__all__ = ["AskAhead", "fast"]


class AskAhead:
    """`ask()` running in a daemon thread; `result()` waits for it and returns its quorum, or raises what it raised."""

    def __init__(self, ask: Callable[[], Quorum]) -> None:
        self._quorum: Quorum | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(ask,), name="manualdp-ft-quorum", daemon=True)
        self._thread.start()

    def _run(self, ask: Callable[[], Quorum]) -> None:
        try:
            self._quorum = ask()
        except BaseException as e:  # noqa: BLE001 - raised again in the main thread, by result()
            self._error = e

    def result(self) -> Quorum:
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._quorum


def fast(quorum: Quorum, group: tuple[int, int] | None) -> bool:
    """Whether every member can step in `quorum` as it stands: agreed, nobody behind, all in the group held.

    The same answer on every member: `quorum.group` is the group they hold only if they all hold it.
    """
    return (quorum.agreed and group is not None and quorum.group == group[0] and len(quorum.members) == group[1]
            and not plan_recovery(quorum) and all(m.synced and m.step == quorum.step for m in quorum.members))
