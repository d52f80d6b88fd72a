"""The manager: what a replica's training loop asks, once per step, to train through failures.

    manager = Manager("a", "127.0.0.1", 29510, min_replicas=2)
    quorum = manager.start_step()      # agree on the members; recover if behind; join their group
    ok = manager.average(flat_grads)   # sum over the members, divide by how many they are
    if manager.should_commit(ok):      # every member applies the step, or none does
        optimizer.step()

`FaultTolerantDDP` (`ddp.py`), `LocalSGD` and `DiLoCo` (`local_sgd.py`) make these calls for
you. A replica that dies costs the others the step it interrupted: their allreduce fails, they vote to discard it, and
the next `start_step` forms a quorum without it. A replica that comes back (the same id, a new process) asks in,
receives the state of a member at the highest step, and trains on. With `async_quorum=True` the quorum is asked in a
thread while forward and backward run (`ahead.py`, as torchft's async quorum): a step where nothing changed waits for
no store round trip but its vote's; one whose quorum changed is voted down, and the next one starts in it.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from ...validate import a_callable, one_of, positive_int, timeout_seconds
from ..collectives import ENGINE_ALGORITHMS, allreduce
from . import keys
from .admission import Misfit
from .ahead import AskAhead
from .commit import commit_or_discard
from .coordinator import connect
from .durable import Checkpoints, CoordinatorLost, Floor, lost_line, mark_finished, record_committed, store_gone
from .guard import ContributionGuard
from .heartbeat import Heartbeat, Liveness, register
from .phases import Phases, without_traceback
from .quorum import POLL, Quorum, publish_mark
from .quorum_group import drop_group
from .share import ONE_ROUND, average_shares, schedule_for
from .signed_store import StoreLost
from .recovery import check_loadable, plan_recovery, receive_state, send_state  # here: the fault harnesses patch them

__all__ = ["Manager", "CoordinatorLost", "schedule_for", "ONE_ROUND"]

class Manager(Phases):
    """One per replica process: membership, the quorum's process group, commit or discard, recovery.

    Args:
        replica_id: this replica's name, unique among the live replicas; a replica started
            again under the same name is the same replica come back.
        host, port: where the coordinator's store listens (`Coordinator`).
        min_replicas: train only in a quorum of at least this many; fewer, and
            `start_step` waits, and raises TimeoutError once fewer than that many replicas
            have been alive for `timeout` seconds (or after `PATIENCE` timeouts in all).
            None (the default): at least one, and more than half of the last agreed quorum's
            members that did not leave (the split-brain guard, `trust.py`).
        token: the run's shared secret, the coordinator's (`Coordinator`): every key and value
            this replica writes is signed with it, and what is not is ignored. None: the open mode.
        timeout: seconds that any one wait may last: for a peer in the allreduce, for the
            votes, for the state of a recovery, for enough live replicas.
        quorum_timeout: seconds a quorum waits for a live replica that has not asked to be
            in it: the deadline past which a slow replica is left out of the step.
        heartbeat_interval, heartbeat_timeout: this replica beats every `interval` s; a
            replica whose beat has not moved for `heartbeat_timeout` s is dead to the others
            (so it must be longer than the interval). A replica id whose beat still moves is
            taken: a second live replica under it is refused.
        algorithm: the book's allreduce schedule for `average` (not "auto", which would
            measure the link again for every new group); at two members a buffer of up to
            `ONE_ROUND` bytes goes in one round, which gives the same bits (`schedule_for`).
        checkpoint_dir: the run's folder on disk (`durable.py`): this replica keeps its newest
            committed state in `checkpoint_dir/replica_id/`, and a replica started again (or a
            run whose replicas or coordinator all died) goes on from the newest one there.
        async_quorum: ask for each step's quorum in a thread while forward and backward run (`ahead.py`);
            `start_step` then returns at once with the last quorum, and `quorum` is the step's once taken.
    """

    def __init__(self, replica_id: str, host: str, port: int, *, min_replicas: int | None = None,
                 timeout: float = 60.0, quorum_timeout: float = 10.0, heartbeat_interval: float = 0.1,
                 heartbeat_timeout: float = 2.0,
                 algorithm: str = "ring", checkpoint_dir: str | None = None,
                 token: str | None = None, async_quorum: bool = False) -> None:
        if not isinstance(replica_id, str) or not replica_id or any(c.isspace() or c == "/" for c in replica_id):
            raise ValueError(f"replica_id must be a non-empty name without spaces or '/', got {replica_id!r}")
        if min_replicas is not None:
            positive_int("min_replicas", min_replicas)
        for name, value in (("timeout", timeout), ("quorum_timeout", quorum_timeout),
                            ("heartbeat_interval", heartbeat_interval), ("heartbeat_timeout", heartbeat_timeout)):
            if timeout_seconds(name, value) is None:
                raise ValueError(f"{name} must be a positive number of seconds, got None")
        if heartbeat_timeout <= heartbeat_interval:
            raise ValueError(f"heartbeat_timeout must be longer than heartbeat_interval ({heartbeat_interval!r} s), "
                             f"else every replica looks dead between two beats; got {heartbeat_timeout!r}")
        one_of("algorithm", algorithm, [a for a in ENGINE_ALGORITHMS if a != "auto"])
        if not isinstance(async_quorum, bool):
            raise TypeError(f"async_quorum must be True or False, got {async_quorum!r}")
        self._disk = Checkpoints(checkpoint_dir, replica_id) if checkpoint_dir is not None else None
        self._where = f"{host}:{port}"
        self.id, self.min_replicas, self.algorithm = replica_id, min_replicas, algorithm
        self.timeout, self.quorum_timeout = float(timeout), float(quorum_timeout)
        self.store = connect(host, port, timeout, token)
        _refuse_a_live_twin(self.store, replica_id, heartbeat_timeout)
        register(self.store, replica_id)
        self._heartbeat = Heartbeat(self.store, replica_id, heartbeat_interval)
        self._liveness = Liveness(self.store, heartbeat_timeout)
        self.step = 0              # steps committed: the same on every member of a quorum once it has recovered
        self.synced = False        # this replica's state is the agreed one (it recovered, or defined it)
        self._quorum: Quorum | None = None  # the quorum of the step under way, or of the last one
        self.async_quorum = async_quorum  # with it, the thread that asks for the quorum ahead (`ahead.py`):
        self._ahead = AskAhead(replica_id) if async_quorum else None
        self.recoveries: list[dict] = []   # each state received: round, source, step, sha256
        self.last_error: BaseException | None = None  # what made the last failed step fail
        self._states: dict[str, tuple[Callable, Callable]] = {}  # name -> (state_dict, load_state_dict)
        self._round = 0            # the last round this replica was in
        self._group: tuple[int, int] | None = None  # the process group held: (its number, its size)
        self._ok = False           # the step under way can still commit on this replica
        self._stale = False        # its forward and backward ran on another quorum's state: voted down (ahead.py)
        self._mark_due = False     # a commit's mark, published before the next ask (asked ahead: by that thread)
        self._in_step = False      # start_step() has run and should_commit() not yet
        self._sent: int | None = None  # the round whose state this replica wrote to the store
        self._since = 0            # the round of the last quorum it stepped in holding the agreed state (quorum.py)
        self._settings: dict = {}  # name -> value: what every member must share (`require_same`)
        self.capacity = 0          # the most members this replica can train with (its smallest batch); 0: any
        self.guard: ContributionGuard | None = ContributionGuard()  # judges each contribution (guard.py); None: off
        self._starting = threading.Lock()  # held while start_step() runs
        self._floor = Floor(self.store, replica_id, self.timeout)  # no quorum below the run's committed step
        self._durable = 0          # steps this replica has made durable: saved (with a checkpoint_dir), then marked
        self._pending: list[dict] = []  # the steps committed since: their records, logged once durable
        self._looked_on_disk = False
        self.resumed: dict | None = None  # the checkpoint this replica started from: path, step
        self._closed = False

    # ------------------------------------------------------------ the state a joiner receives

    def register_state(self, name: str, state_dict: Callable[[], dict],
                       load_state_dict: Callable[[dict], object]) -> None:
        """Add `name` to what a recovering replica receives: `state_dict()` here, `load_state_dict(...)` there."""
        a_callable("state_dict", state_dict)
        a_callable("load_state_dict", load_state_dict)
        if name == "step" or name in self._states:
            raise ValueError(f"a state named {name!r} is already registered")
        self._states[name] = (state_dict, load_state_dict)

    def state_dict(self) -> dict:
        """The loop state (`step`) and every registered state, as a recovering replica receives them."""
        return {"step": self.step, **{name: get() for name, (get, _) in self._states.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        for name, (_, load) in self._states.items():
            load(state[name])

    def require_same(self, **settings) -> None:
        """Add settings that every member of a quorum must share (method, H, lr, seed, ...), by name.

        Each new group compares them (`transport.agree.agree`, the engine's one comparison) before
        any state is loaded or step taken: members that differ all raise one ValueError naming the
        field and every member's value, instead of averaging numbers that do not belong together.
        """
        self._settings.update(settings)

    # ------------------------------------------------------------ once per step

    def start_step(self) -> Quorum:
        """Agree on this step's quorum; receive the state if behind; join the quorum's group. Returns the quorum.

        A member that fails while the group forms or the state passes fails the round for all
        (its vote is "discard"), and this replica asks again, for up to `PATIENCE` timeouts.
        In a provisional quorum (a live replica outside it holds more of the run: `quorum.py`)
        this replica trains, but its state stops being the agreed one until it receives it.
        """
        self._check_open("start_step")
        if self._in_step or not self._starting.acquire(blocking=False):
            raise RuntimeError(f"replica {self.id!r}: start_step() called again before the step of round "
                               f"{self._round} was voted on: call step() (or should_commit()) first")
        try:
            self._tidy_taken()
            ahead = self.async_quorum and self.synced and self._group is not None and self._sent is None
            if not ahead or self._disk is not None:  # a save reads the state: before forward moves a buffer
                self._make_durable()
            if not ahead:
                self._publish_due()
                return self._start_step()
            self._ahead.ask(self._ask_ahead)
            self._in_step, self._ok = True, True
            return self._quorum
        except BaseException as e:
            self._in_step = False  # it never began: a later start_step() may ask again
            self._raise_if_lost(e)
            raise
        finally:
            self._starting.release()

    @property
    def quorum(self) -> Quorum | None:
        """The quorum of the step under way (one asked ahead is taken first), or of the last one; None before any."""
        self._settle()
        return self._quorum

    def _exchange_state(self, quorum: Quorum) -> tuple[dict, str, str] | None:
        """Send the state to the members that need it from this replica; receive it if this one needs it (`phases.py`).

        Returns (state, source, sha256) when this replica received one, else None.
        """
        plan = plan_recovery(quorum)
        if self.id in plan.values():
            state = self.state_dict()
            send_state(self.store, quorum.round, self.id, state)
            self._sent = quorum.round
            check_loadable(state, self.id)  # after sending: the receivers do not wait for it
        if self.id not in plan:
            return None
        source = plan[self.id]
        state, digest = receive_state(self.store, quorum.round, source, self.timeout,
                                      gone=lambda: source not in self._liveness.live([source]))
        return state, plan[self.id], digest

    def average(self, tensor: torch.Tensor, divide_first: bool = False) -> bool:
        """Average `tensor` in place over the quorum's members; False (and the step cannot commit) if a member failed.

        The sum over the members that contributed, divided by how many they are: a member that
        died took its shard of the batch with it, and the step's gradient is the mean of the others'.
        Afterwards the members hold bitwise identical tensors (on False: anything). `divide_first`
        (every member alike): each share divided before the sum, as torch's DDP does: no sum of
        finite shares overflows (float16 and bfloat16 summed in float32: `share.py`), but the bits differ from
        sum-then-divide (`bucketed.average_fitting`).
        """
        self._check_open("average")
        if self.quorum is None:  # takes the quorum asked ahead
            raise RuntimeError("average() before start_step(): there is no quorum to average over")
        if not self._ok:
            return False
        n = len(self._quorum.members)
        try:
            average_shares(tensor, n, lambda t: allreduce(t, schedule_for(self.algorithm, n, t), timeout=self.timeout),
                           divide_first)
        except ValueError:
            raise  # the members called it differently (another model?): a bug to fix, not a fault to ride out
        except RuntimeError as e:  # PeerError, or gloo's own: a member died or hangs
            self.last_error, self._ok = without_traceback(e), False
            return False
        return True

    def should_commit(self, ok: bool = True) -> bool:
        """Vote on this step (`ok`: this replica's part went well), and return whether every member applies it.

        The same answer on every member. On True, `step` counts one more; on False this
        replica leaves the group (a failed group is not reused) and the caller must leave its
        model as it was before the step.
        """
        self._check_open("should_commit")
        self._settle()
        if not self._in_step:
            raise RuntimeError("should_commit() without a step under way: call start_step() first")
        self._in_step = False
        try:
            committed = commit_or_discard(self.store, self._quorum, self.id, ok and self._ok and not self._stale,
                                          self._liveness, self.timeout)
        except RuntimeError as e:
            if store_gone(self.store):
                raise self._lost(e) from None
            raise
        self._ok = self._stale = False
        if committed:
            self._pending.append({"step": self.step, "round": self._quorum.round, "members": self._quorum.ids})
            self.step += 1
            self._mark_due = self.synced
            if self._ahead is None:
                self._publish_due()
            elif self._disk is None:  # the thread writes the mark and the record at once, off the step's path
                self._ahead.later(self._tidy)
        else:
            self._leave_group()
        return committed

    def _publish_due(self) -> None:
        if self._mark_due:
            self._mark_due = False
            publish_mark(self.store, self.id, (self.step, self._since))

    def _leave_group(self) -> None:
        self._group = None
        drop_group()

    # ------------------------------------------------------------ what outlives the process (durable.py)

    def _make_durable(self, finishing: bool = False, asking: bool = False) -> None:
        """Resume from disk (first call); save the steps committed since the last call, mark them in the store, log."""
        if not (finishing or asking):  # finishing: saved even if the run ended; asking: the ask after this reads it
            self._floor.allows(self.step, None)  # RunFinished if the run has ended
        if self._disk is not None and not self._looked_on_disk:
            self._looked_on_disk = True
            self._resume_from_disk()
        # a provisional quorum's steps wait: they are the run's once its state becomes the agreed one (quorum.py)
        if self.synced and self.step > self._durable:
            if self._disk is not None:  # the records ride in the checkpoint: a kill before they are logged loses none
                self._disk.save(self.step, self._settings, self.state_dict(), self._pending)
                for record in self._pending:
                    self._disk.log_step(record)
            self._pending.clear()
            record_committed(self.store, self.step)  # only now: the mark never names a step nobody holds
            self._durable = self.step

    def _resume_from_disk(self) -> None:
        self._disk.refuse_if_finished(self.store, self._settings)
        saved = self._disk.newest(self._settings)
        if saved is None or saved["step"] <= self.step:
            return
        self.load_state_dict(saved["state"])
        self.synced, self._since, self._durable = True, 0, self.step
        self._disk.log_carried(saved)  # its writer may have been killed before it logged them
        publish_mark(self.store, self.id, (self.step, self._since))
        record_committed(self.store, self.step)
        self.resumed = {"path": saved["path"], "step": self.step}

    def _lost(self, error: BaseException) -> CoordinatorLost:
        """Save what this replica holds (the store cannot be told), and say so in one line."""
        if self._disk is not None and self.synced and self.step > self._durable:
            self._disk.save(self.step, self._settings, self.state_dict(), self._pending)
            for record in self._pending:
                self._disk.log_step(record)
            self._pending.clear()
            self._durable = self.step
        return CoordinatorLost(lost_line(self.id, self._where, error, self._disk, self._durable))

    def coordinator_lost(self, error: StoreLost) -> CoordinatorLost:
        """This replica's line for `error` (a store call of the caller's own that lost the coordinator), once saved."""
        if not isinstance(error, StoreLost):
            raise TypeError(f"error must be a StoreLost, got {type(error).__name__}")
        return self._lost(error)

    def _raise_if_lost(self, error: BaseException) -> None:
        """`CoordinatorLost` (from `_lost`) if `error` came of a store that stopped answering."""
        if isinstance(error, StoreLost) or (isinstance(error, RuntimeError) and not isinstance(error, CoordinatorLost)
                                            and store_gone(self.store)):
            raise self._lost(error) from None

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise RuntimeError(f"replica {self.id!r}: {call}() on a Manager that has closed (the run ended, or it "
                               f"left): make a new Manager to train again")

    # ------------------------------------------------------------ the end

    def finish(self) -> None:
        """The run took its last step: make it durable, mark the run finished (store and disk), and leave."""
        self._check_open("finish")
        try:
            self._tidy_taken()
            if self.synced:
                self._make_durable(finishing=True)
                mark_finished(self.store, self.step)
                if self._disk is not None:
                    self._disk.mark_finished(self.step, self._settings)
        finally:
            self.close()

    def close(self) -> None:
        """Leave: stop beating (the others stop waiting for this replica at once) and leave the group."""
        self._closed = True
        if self._ahead is not None:
            self._ahead.stop()
        self._heartbeat.stop(leave=True)
        self._leave_group()

    def __enter__(self) -> "Manager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _refuse_a_live_twin(store, replica_id: str, heartbeat_timeout: float) -> None:
    """Misfit if a live replica already goes by `replica_id`: its heartbeat moves within `heartbeat_timeout` s.

    A replica started again after it died finds its old counter still: that costs it one
    `heartbeat_timeout` of watching, once.
    """
    key = keys.heartbeat(replica_id)
    if not store.check([key]):
        return
    first, deadline = store.get(key), time.monotonic() + heartbeat_timeout
    while first.split()[-1:] != [b"-1"] and time.monotonic() < deadline:
        time.sleep(4 * POLL)
        if store.get(key) != first:
            raise Misfit(f"replica_id {replica_id!r} is already taken by a live replica (its heartbeat moves): "
                             f"give each replica its own id, or stop the other first")
