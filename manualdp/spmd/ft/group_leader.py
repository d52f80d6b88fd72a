"""A replica group's rank 0 (`group.py`): the `Manager` that speaks for the group, its quorum's group its ranks' lanes.

It asks, heartbeats and votes as any replica's manager does; what differs: the state it exchanges
is the loop step only (each rank's lane carries its own shard of the rest), the ranks enter their
lanes while it does, it joins no process group of its own, and a lost coordinator is named with
the group's checkpoints (`group_disk.py`).
"""
from __future__ import annotations

from typing import Callable

from .durable import CoordinatorLost, lost_line
from .manager import Manager
from .quorum import Quorum

__all__ = ["Leader"]


class Leader(Manager):
    """The group's rank 0: a `Manager` whose quorum's group is its ranks' lanes, not its own default group."""

    def __init__(self, enter_lanes: Callable[[Quorum], None], *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._enter_lanes = enter_lanes
        self.guard = None  # the guard gathers norms over the default group: here, the replica group's own
        self.disk = None  # the group's checkpoints (`group_disk.py`): its ranks saved each step before it was marked

    def _lost(self, error: BaseException) -> CoordinatorLost:
        return CoordinatorLost(lost_line(self.id, self._where, error, self.disk, self._durable))

    def _exchange_state(self, quorum: Quorum):
        received = super()._exchange_state(quorum)  # the loop step (the lanes carry the rest)
        self._enter_lanes(quorum)  # RuntimeError if a rank could not: the round is voted down, and asked again
        return received

    def _join_group(self, quorum: Quorum) -> None:
        pass  # the ranks joined their lanes with the state, above

    def _leave_group(self) -> None:
        self._group = None  # the ranks leave their lanes on the outcome (`GroupManager.should_commit`)
