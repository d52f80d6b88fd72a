"""What outlives the replicas and the coordinator: the run's committed step, each replica's newest state, its end.

Three records, each written only once what it names is safe:

- `committed` in the store: the most steps of the run that a replica holds, in memory or on
  its disk. A member raises it (never lowers it) at its next `start_step` after a commit, once
  it has written the state to disk: so the mark never names a step that no replica holds.
  `Floor` holds every quorum to it: a quorum never starts below it (the bug of issue 42: three
  newcomers, every holder dead, began the run again at step 0). It waits for a holder, a live
  replica or one started again from its disk, and after `timeout` fails in one line.
- the disk (`Checkpoints`, with `--checkpoint-dir DIR`): each replica keeps its newest
  committed state in `DIR/ID/`, in `support/checkpoint.py`'s files (temporary file, fsync,
  rename; a SHA-256 inside), with its step and the run's identity (the settings every member
  shares). A replica started again loads the newest one in `DIR/*/`, so a run whose replicas
  all died, or whose coordinator died, goes on from there: bitwise as if nothing happened.
  Beside it, `DIR/ID/steps.jsonl` gets one JSON line per step once it is durable: the run's history.
- `finished`, in the store and as `DIR/ID/finished.json`: the run took its last step. A
  replica started later is told so (`RunFinished`) and trains nothing.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import time
import warnings

import torch.distributed as dist

from ...support.checkpoint import read_checkpoint, remove_orphans, save_checkpoint
from ...support.files import write_json_atomic
from . import keys
from .history import append_step, lock_folder, logged_lines, logged_steps
from .look import peek
from .signed_store import CoordinatorLost

__all__ = ["RunFinished", "CoordinatorLost", "committed_step", "record_committed", "finished_at", "mark_finished",
           "Floor", "Checkpoints", "store_gone", "lost_line"]


class RunFinished(Exception):
    """The run this replica belongs to has ended: there is nothing left to train (not an error)."""


def committed_step(store: dist.Store) -> int:
    """The most steps of the run a replica has held (0 if none yet); a malformed value counts as 0."""
    raw = peek(store, keys.COMMITTED)
    return int(raw) if raw is not None and raw.isdigit() else 0


def record_committed(store: dist.Store, step: int) -> None:
    """Raise the store's mark to `step` steps, unless it is already there or higher (compare_set: never lowered)."""
    seen = str(step - 1).encode()  # most often what it holds (one round trip); if not, compare_set says what it does
    while not (seen.isdigit() and int(seen) >= step):
        now = store.compare_set(keys.COMMITTED, seen.decode(), str(step))
        if now == str(step).encode():
            return
        seen = b"" if now == seen else now  # torch answers a compare_set on a missing key with the value expected


def finished_at(store: dist.Store) -> int | None:
    """The step count at which the run ended, or None while it runs."""
    raw = peek(store, keys.FINISHED)
    return int(raw) if raw is not None and raw.isdigit() else None


def mark_finished(store: dist.Store, step: int) -> None:
    store.set(keys.FINISHED, str(step))


def store_gone(store: dist.Store) -> bool:
    """Whether the coordinator's store has stopped answering this connection."""
    try:
        store.check([keys.COMMITTED])
        return False
    except Exception:  # noqa: BLE001 - whatever the store's client raises once its server is gone
        return True


def lost_line(replica_id: str, where: str, error: BaseException, disk, durable: int) -> str:
    """What a replica that lost the coordinator says before it exits: why, and where the run goes on from.

    `disk`: its `Checkpoints`, or its group's `GroupDisk` (`group_disk.py`), or None; its `directory` is named.
    """
    first = getattr(error, "reason", None) or (str(error).strip().splitlines() or [type(error).__name__])[0]
    then = (f"it goes on from step {durable} in {disk.directory}" if disk is not None else
            "without --checkpoint-dir the run's state is lost with its replicas")
    return (f"replica {replica_id!r}: lost the coordinator at {where} ({first}); start it again, then this replica "
            f"with the same command: {then}")


class Floor:
    """Holds a replica's quorums to the run's committed step and end: asked once per look while it waits.

    Args:
        replica_id: whose quorums (for the messages).
        timeout: seconds a quorum below the committed step may wait for a holder before it fails.
    """

    def __init__(self, store: dist.Store, replica_id: str, timeout: float) -> None:
        self.store, self.id, self.timeout = store, replica_id, timeout
        self._behind_since: float | None = None

    def allows(self, step: int, ids: list[str] | None, store: dist.Store | None = None) -> bool:
        """Whether a quorum of `ids` may start at `step` (None: no quorum yet, only the end is checked).

        RunFinished if the run has ended; TimeoutError once quorums below the committed step have
        waited `timeout` s for a holder of it. `store`: the look to read (`look.py`), else this floor's.
        """
        store = store if store is not None else self.store
        end = finished_at(store)
        if end is not None:
            raise RunFinished(f"replica {self.id!r}: the run ended at step {end}: nothing left to train")
        if ids is None:
            return True
        top = committed_step(store)
        if step >= top:
            self._behind_since = None
            return True
        now = time.monotonic()
        self._behind_since = self._behind_since or now
        if now - self._behind_since > self.timeout:
            raise TimeoutError(f"replica {self.id!r}: step {top - 1} was committed but no live replica or checkpoint "
                               f"holds it (a quorum of {', '.join(ids)} would start at step {step}; waited "
                               f"{self.timeout:g} s): start a replica or replica group that holds it, with its "
                               f"--checkpoint-dir")
        return False


class Checkpoints:
    """A replica's newest committed state on disk, in `directory/replica_id/`, and the run's history and end there.

    Args:
        directory: the run's folder, the same for every replica (each writes below its own id).
        replica_id: this replica's name: its sub-folder.
    """

    def __init__(self, directory: str, replica_id: str) -> None:
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise ValueError(f"checkpoint_dir must be a path of a folder, got {directory!r}")
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"checkpoint_dir {os.fspath(directory)!r} exists and is not a folder")
        self.directory = os.fspath(directory)
        self.mine = os.path.join(self.directory, replica_id)
        self.id = replica_id
        self._last: int | None = None  # the last step in steps.jsonl (history.py), once read
        lock_folder(self.mine)  # this replica's folder, for this process's life: a second run sharing it is refused

    def save(self, step: int, identity: dict, state: dict, records: list[dict] = ()) -> str:
        """Write `state`, the run's state after `step` committed steps, atomically; keep the one before too.

        `records`: the history lines of the steps it holds that are not logged yet; whoever resumes
        from it logs them, so that a kill between this write and `log_step` loses no step.
        """
        os.makedirs(self.mine, exist_ok=True)
        remove_orphans(self.mine)  # what a write killed half-way left
        return save_checkpoint(self.mine, step, {"step": step, "identity": identity, "replica": self.id,
                                                 "state": state, "records": list(records)}, keep=2)

    def newest(self, identity: dict) -> dict | None:
        """The newest checkpoint of this run below the folder (any replica's), or None.

        ValueError naming the file if one holds another run (other settings); a damaged or
        vanishing file (another replica replacing it) is passed over.
        """
        for saved in self.intact(identity):
            return saved
        groups = glob.glob(os.path.join(glob.escape(self.directory), "rank*", "*", "ckpt-*.pt"))
        if groups:  # a replica group's lanes (group_disk.py): going on from 0 beside them would take the run again
            raise ValueError(f"checkpoint_dir {self.directory!r} holds the checkpoints of replica groups ({groups[0]}):"
                             f" a one-process replica cannot go on from them; give it another --checkpoint-dir")
        logged = logged_steps(self.directory)  # a history without a checkpoint: going on from 0 would take it again
        if logged is not None:
            raise ValueError(f"checkpoint_dir {self.directory!r}: {logged[1]} says {logged[0]} steps were committed, "
                             f"but no checkpoint there is intact: restore one, or start afresh in another folder")
        return None

    def intact(self, identity: dict):
        """Each intact checkpoint of this run below the folder (any replica's), newest first.

        ValueError naming the file if one holds another run (other settings); a damaged or
        vanishing file (another replica replacing it) is passed over.
        """
        paths = glob.glob(os.path.join(glob.escape(self.directory), "*", "ckpt-*.pt"))
        for path in sorted(paths, key=_step_of, reverse=True):
            try:
                saved = read_checkpoint(path)
            except FileNotFoundError:
                continue  # its replica wrote a newer one meanwhile, which this glob missed: an older one will do
            except Exception as e:  # noqa: BLE001 - damaged: fall back to the one before
                warnings.warn(f"skipping checkpoint {path}: {str(e).strip().splitlines()[0] if str(e) else e}")
                continue
            _check_identity(saved, identity, path)
            yield saved

    def log_step(self, record: dict) -> None:
        """Append `record` (a durable step: its number, round, members) as one JSON line to `steps.jsonl`."""
        os.makedirs(self.mine, exist_ok=True)
        self._last = append_step(self.mine, record, self._last)  # a step taken again replaces its line and after

    def log_carried(self, saved: dict) -> None:
        """Log the records a checkpoint carries (`save`) that no history below the folder holds: its writer's kill."""
        held = logged_lines(self.directory)
        for record in saved.get("records", ()):
            if json.dumps(record) + "\n" not in held:
                self.log_step(record)

    def mark_finished(self, step: int, identity: dict) -> None:
        os.makedirs(self.mine, exist_ok=True)
        write_json_atomic(os.path.join(self.mine, "finished.json"), {"step": step, "identity": identity})

    def refuse_if_finished(self, store: dist.Store, identity: dict) -> None:
        """RunFinished if a folder here says this run ended; the store learns it too (a coordinator started again)."""
        end = self.finished_at(identity)
        if end is not None:
            mark_finished(store, end)
            raise RunFinished(f"replica {self.id!r}: the run ended at step {end} ({self.directory} says so): "
                              f"nothing left to train")

    def finished_at(self, identity: dict) -> int | None:
        """The step count at which this run ended, as any replica's folder says, or None."""
        for path in glob.glob(os.path.join(self.directory, "*", "finished.json")):
            with contextlib.suppress(OSError, ValueError):
                with open(path) as f:
                    mark = json.load(f)
                if mark.get("identity") == _jsonable(identity):
                    return int(mark["step"])
        return None


def _step_of(path: str) -> tuple[int, bool]:
    name = os.path.basename(path)
    return int(name[5:13]) if name[5:13].isdigit() else -1, name.endswith("-epoch.pt")


def _jsonable(identity: dict) -> dict:
    return json.loads(json.dumps(identity, default=str))


def _check_identity(saved: dict, identity: dict, path: str) -> None:
    theirs = saved.get("identity", {})
    changed = [f"{k} {theirs.get(k)!r} here {identity.get(k)!r}" for k in sorted(set(theirs) | set(identity), key=str)
               if theirs.get(k) != identity.get(k)]
    if changed:
        raise ValueError(f"checkpoint {path} belongs to another run ({'; '.join(changed)}): start with that run's "
                         f"settings, or give this run another --checkpoint-dir")
