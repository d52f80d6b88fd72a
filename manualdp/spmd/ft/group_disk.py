"""A replica group's committed work on disk: each rank keeps its lane's state; the group resumes from a step all hold.

`GroupManager(checkpoint_dir=DIR)` (`group.py`), `manualdp train --fault-tolerant ... --checkpoint-dir DIR` under
torchrun. Rank i of group ID keeps its state in `DIR/rank<i>/ID/`: lane i's folder is what a one-process run's
folder is (`durable.Checkpoints`, read and written unchanged: atomic files, a SHA-256 inside, the run's identity,
the newest two kept), and since rank i of every group holds the same state at a committed step, a group whose own
files are older goes on from a newer one of another group's rank i. The group's rank 0 logs the steps
(`DIR/rank0/ID/steps.jsonl`, `history.py`) and the records ride in its checkpoint, as a one-process replica's do.

Once per step, before the group's leader asks for the quorum (and raises the store's committed mark), every rank
saves the steps its group committed since, and the group waits until all of them have: the mark never names a
step that some rank of the group does not hold. A group started again (all groups dead, or a new coordinator)
gathers the steps each rank holds intact and resumes from the newest one EVERY rank holds (a rank killed
mid-save holds one step more than its peers: that step is taken again), tells the store, and the floor
(`durable.Floor`) lets its quorum start there. A folder of another run, of another group size or of one-process
replicas is refused in one line on every rank, before any step.
"""
from __future__ import annotations

import glob
import os

import torch.distributed as dist

from ...validate import non_negative_int, positive_int
from .durable import Checkpoints, RunFinished, mark_finished, record_committed
from .history import logged_steps
from .quorum import publish_mark

__all__ = ["GroupDisk", "open_disk"]

_KINDS = {"OSError": OSError}  # a rank's error is raised as this on every rank (else ValueError)


def _every_rank(value, group: dist.ProcessGroup | None) -> list:
    """Every rank's `value`, by rank (all_gather_object over the replica group); RuntimeError if a rank is gone."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _gather(manager, value) -> list:
    """Every rank's `value` in `manager`'s group (a `GroupManager`); GroupBroken if a rank is gone."""
    try:
        return _every_rank(value, manager._group)
    except RuntimeError as e:
        raise manager._broken(e) from None


def _raise_first(errors: list, group_id: str) -> None:
    """The first rank's error, raised on every rank alike, naming that rank ("rank r: ...", as `agree`'s); or none."""
    for rank, error in enumerate(errors):
        if error is not None:
            kind, line = error
            if kind == "RunFinished":
                raise RunFinished(f"replica group {group_id!r}: {line}")
            raise _KINDS.get(kind, ValueError)(f"rank {rank}: {line}")


def _line(error: BaseException) -> tuple[str, str]:
    kind = "OSError" if isinstance(error, OSError) else type(error).__name__
    return kind, (str(error).strip().splitlines() or [type(error).__name__])[0]


def open_disk(directory: str | None, group_id: str, rank: int, size: int,
              group: dist.ProcessGroup | None) -> "GroupDisk | None":
    """This rank's `GroupDisk` in `directory` (None: no disk); a folder refused on one rank is refused on all."""
    if directory is None:
        return None
    disk, error = None, None
    try:
        disk = GroupDisk(directory, group_id, rank, size)
    except (ValueError, OSError) as e:  # OSError: a file where a folder should be, a folder that cannot be made
        error = _line(e)
    _raise_first(_every_rank(error, group), group_id)
    return disk


class GroupDisk:
    """This rank's part of a replica group's checkpoints, in `directory/rank<rank>/group_id/`.

    Args:
        directory: the run's folder, the same for every rank of every group.
        group_id, rank, size: the group, this rank in it, and how many ranks it has (a folder saved by
            groups of another size is refused).
    """

    def __init__(self, directory: str, group_id: str, rank: int, size: int) -> None:
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise ValueError(f"checkpoint_dir must be a path of a folder, got {directory!r}")
        non_negative_int("rank", rank)
        positive_int("size", size)
        directory = os.fspath(directory)
        alone = glob.glob(os.path.join(glob.escape(directory), "*", "ckpt-*.pt"))
        if alone:  # DIR/ID/ckpt-*.pt: one-process replicas' folders, which a group cannot go on from
            raise ValueError(f"checkpoint_dir {directory!r} holds the checkpoints of one-process replicas "
                             f"({alone[0]}): a replica group of {size} ranks cannot go on from them; give it "
                             f"another --checkpoint-dir")
        self.directory, self.rank, self.size = directory, rank, size
        self.lane = Checkpoints(os.path.join(directory, f"rank{rank}"), group_id)  # its lock: this rank's folder
        self.saved = 0          # steps this rank has made durable
        self.looked = False     # the folder was read for a state to resume from

    def identity(self, settings: dict) -> dict:
        """The run's identity in this group's files: its settings and the group's size."""
        return {**settings, "group_size": self.size}

    def held(self, identity: dict) -> dict[int, dict]:
        """step -> an intact checkpoint of it for this rank's lane (any group's); ValueError for another run's."""
        found: dict[int, dict] = {}
        for saved in self.lane.intact(identity):
            found.setdefault(saved["step"], saved)
        return found

    def before_step(self, manager, synced: bool) -> None:
        """On every rank, before the group asks for a quorum: resume from disk (the first time), save what is due."""
        if not self.looked:
            self.resume(manager)
        self.save(manager, synced)

    def resume(self, manager) -> None:
        """On every rank of `manager`'s group (a `GroupManager`): go on from the newest step every rank holds, if any.

        RunFinished if a folder says the run ended; ValueError (the same on every rank) for a folder of
        another run or group size, or one whose history says more steps were committed than its ranks hold.
        """
        self.looked = True
        identity = self.identity(manager._settings)
        try:
            held, error = self.held(identity), None
            end = self.lane.finished_at(identity)
            if end is not None:
                if manager._manager is not None:  # the store learns it too (a coordinator started again)
                    mark_finished(manager._manager.store, end)
                error = ("RunFinished", f"the run ended at step {end} ({self.directory} says so): nothing left "
                                        f"to train")
        except ValueError as e:
            held, error = {}, _line(e)
        everyone = _gather(manager, (sorted(held), error))
        _raise_first([e for _, e in everyone], manager.id)
        common = set.intersection(*(set(steps) for steps, _ in everyone))
        step = max(common, default=0)
        logged = logged_steps(self.lane.directory) if self.rank == 0 else None
        late = _gather(manager, logged)[0]
        if late is not None and late[0] > step:
            raise ValueError(f"rank 0: checkpoint_dir {self.directory!r}: {late[1]} says "
                             f"{late[0]} steps were committed, but the newest step every rank holds intact is "
                             f"{step} (ranks hold {[steps for steps, _ in everyone]}): restore the missing files, "
                             f"or start afresh in another folder")
        if step <= manager.step:
            return
        saved = held[step]
        manager._load_state_dict(saved["state"])
        manager.step = self.saved = step
        manager._synced = True
        manager.resumed = {"path": saved["path"], "step": step}
        if manager._manager is not None:  # the leader holds the run's state from here, as a one-process replica would
            leader = manager._manager
            leader.step, leader.synced, leader._since, leader._durable = step, True, 0, step
            self.lane.log_carried(saved)  # its writer may have been killed before it logged them
            publish_mark(leader.store, leader.id, (step, 0))
            record_committed(leader.store, step)

    def save(self, manager, synced: bool) -> None:
        """On every rank: save the steps the group committed since the last call; return once every rank has."""
        if not synced or manager.step <= self.saved:
            return  # the same answer on every rank: the step and the leader's word are the group's
        records = list(manager._manager._pending) if manager._manager is not None else []
        try:
            self.lane.save(manager.step, self.identity(manager._settings), manager._state_dict(), records)
            error = None
        except OSError as e:  # a full disk, a folder made read-only: every rank says so, none goes on without it
            error = ("OSError", _line(e)[1])
        _raise_first(_gather(manager, error), manager.id)
        for record in records:  # every rank holds the step now: logged once (rank 0's records)
            self.lane.log_step(record)
        self.saved = manager.step

    def finish(self, manager) -> None:
        """The run took its last step: every rank saves it (`save`), then marks the run finished in its folder."""
        self.save(manager, manager._synced)
        if manager._synced:
            self.lane.mark_finished(manager.step, self.identity(manager._settings))
