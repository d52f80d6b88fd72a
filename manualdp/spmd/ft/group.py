"""Replica groups: fault tolerance where a replica is a group of ranks (one torchrun job), as torchft's HSDP is.

Every rank of every group runs the same loop; only the groups are fault tolerant:

    dist.init_process_group("gloo", timeout=...)     # the group's own world (torchrun's), e.g. 2 ranks
    manager = GroupManager("a", "127.0.0.1", 29510)  # on every rank: its rank 0 speaks for the group
    manager.register_state("model", model.state_dict, model.load_state_dict)  # this rank's part: its lane's
    manager.register_state("optim", optimizer.state_dict, optimizer.load_state_dict)
    manager.watch(model)   # a rank with one backward more than the others: the step discarded, named
    while manager.step < steps:
        quorum = manager.start_step()          # the groups agree; a group behind receives each lane's state
        loss_of(model, my_shard(batch, quorum.rank("a"), dist.get_rank())).backward()
        ...                                    # in the group: average (DDP), or fully_shard's (group_shards.py)
        ok = manager.average(flat_grads)       # rank i with rank i of the other groups: sum / how many groups
        if manager.should_commit(ok):          # every rank of every member group averaged: all apply it
            optimizer.step()
        optimizer.zero_grad()

How it works. Rank 0 of each group holds a `Manager` (`manager.py`) under the group's id: it
heartbeats, asks the coordinator for the quorum (whose members are groups), receives the loop
step of a group at the highest step, and votes. It tells its ranks what was decided over the
group's own process group (`group`, the default one unless given): the quorum, who sends each
lane's state to whom (`recovery.plan_recovery`), the outcome of the vote. Rank i of every member
group forms lane i (`group_lanes.py`): the cross-group average runs per lane, per shard. A step
commits only if every rank of every member group averaged: the ranks' flags are reduced (MIN)
inside the group before its leader votes.

A group that loses a rank leaves the quorum as a whole: its other ranks fail their next
collective inside the group and raise `GroupBroken` (its leader votes the step down and stops
heartbeating first), and the other groups discard that step and train on without it. Start all
its ranks again (torchrun's restart does): rank i of the new group receives lane i's state from
rank i of a group holding the run's state, checked by SHA-256, before the group trains. Groups
of another size than the run's are refused at admission, in one line on each of their ranks
(the group size is one of the settings every member shares, `Manager.require_same`).

The group's own process group must wait longer than a quorum takes (its ranks wait on rank 0's
word meanwhile): give `init_process_group` a timeout of a few times `timeout`.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ...validate import a_callable, nn_module, positive_int, timeout_seconds
from .admission import Misfit
from .bucketed import average_fitting, finite
from .coordinator import connect
from .durable import RunFinished
from .group_backward import BackwardCount
from .group_disk import open_disk
from .group_lanes import Lane, LaneLost, gloo_words
from .group_leader import Leader
from .phases import without_traceback
from .quorum import Quorum
from .recovery import RecoveryError, plan_recovery
from .share import average_shares

__all__ = ["GroupManager", "GroupBroken"]

_log = logging.getLogger("manualdp.spmd.ft")

# what rank 0 raised, raised again on its ranks by name (subclasses before their bases); else RuntimeError
_RAISED = {"Misfit": Misfit, "RunFinished": RunFinished, "ValueError": ValueError, "TimeoutError": TimeoutError,
           "TypeError": TypeError}


def _stop(error: BaseException) -> tuple:
    """Rank 0's word that it raised `error`: its kind (one of `_RAISED`, else RuntimeError) and its line."""
    kind = next((name for name, cls in _RAISED.items() if isinstance(error, cls)), "RuntimeError")
    return ("stop", kind, str(error))


class GroupBroken(ConnectionError):
    """A rank of this replica group failed: the whole group has left the quorum; start all its ranks again."""


class GroupManager:
    """One per rank of a replica group: the quorum of groups, the average over a lane, commit or discard.

    Args:
        group_id: the group's name, unique among the live groups (the same on all its ranks).
        host, port: where the coordinator's store listens (`Coordinator`).
        group: the replica group's own process group (default: the default one, torchrun's world).
        min_groups, timeout, quorum_timeout, heartbeat_interval, heartbeat_timeout, token: as `Manager`'s
            `min_replicas`, ... (used by rank 0's `Manager`); `timeout` bounds each wait of every rank.
        guard: an average that is not finite (NaN or Inf) fails the step (`average` returns False, said in one
            line): the step is discarded on every member group, as a one-process replica's guard does. The
            lane's ranks hold the same average, so they judge alike. False: whatever it holds is averaged.
        checkpoint_dir: the run's folder: each rank keeps its lane's committed state, and a group started again
            goes on from the newest step all its ranks hold (`group_disk.py`).
    """

    def __init__(self, group_id: str, host: str, port: int, *, group: dist.ProcessGroup | None = None,
                 min_groups: int | None = None, timeout: float = 60.0, quorum_timeout: float = 10.0,
                 heartbeat_interval: float = 0.1, heartbeat_timeout: float = 2.0, token: str | None = None,
                 guard: bool = True, checkpoint_dir: str | None = None) -> None:
        if not isinstance(group_id, str) or not group_id or any(c.isspace() or c == "/" for c in group_id):
            raise ValueError(f"group_id must be a non-empty name without spaces or '/', got {group_id!r}")
        if min_groups is not None:
            positive_int("min_groups", min_groups)
        if timeout_seconds("timeout", timeout) is None:
            raise ValueError("timeout must be a positive number of seconds, got None")
        if not isinstance(guard, bool):
            raise TypeError(f"guard must be True or False, got {guard!r}")
        if not dist.is_initialized():
            raise RuntimeError("GroupManager needs the replica group's own process group: call "
                               "dist.init_process_group first (torchrun's world, one per group)")
        self.id, self.timeout, self._group, self.guard = group_id, float(timeout), group, guard
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.step = 0                          # steps committed, the same on every rank of every member group
        self.recoveries: list[dict] = []       # each lane state received: round, source, sha256
        self.last_error: BaseException | None = None  # what made the last failed step fail on this rank
        self._states: dict[str, tuple[Callable, Callable]] = {}  # name -> (state_dict, load_state_dict)
        self._quorum: Quorum | None = None
        self._in_step = self._ok = False
        self._manager: Leader | None = None
        self._backwards: BackwardCount | None = None  # `watch`: this rank's backward passes in the step
        self._compared = False                        # the ranks' counts were compared in this step
        self._settings, self._synced, self.resumed = {}, False, None  # `require_same`'s; the leader's word; from disk
        self._disk = open_disk(checkpoint_dir, group_id, self.rank, self.size, group)  # None: no checkpoint_dir
        if self.rank == 0:
            try:
                self._manager = Leader(self._lead_lanes, group_id, host, port, min_replicas=min_groups,
                                        timeout=timeout, quorum_timeout=quorum_timeout, token=token,
                                        heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout)
                self._manager.require_same(group_size=self.size)  # admission refuses a group of another size
                self._manager.disk = self._disk
            except BaseException as e:
                self._tell(_stop(e))
                raise
            self._tell(("ready",))
            store = self._manager.store
        else:
            self._follow({"ready"})
            store = connect(host, port, timeout, token)
        self._lane = Lane(store, group_id, self.rank, self.timeout, heartbeat_timeout,
                          connect=lambda: connect(host, port, timeout, token))

    # ------------------------------------------------------------ this rank's part of the state

    def register_state(self, name: str, state_dict: Callable[[], dict],
                       load_state_dict: Callable[[dict], object]) -> None:
        """Add `name` to what rank i of a recovering group receives from rank i of a healthy one (its lane's)."""
        a_callable("state_dict", state_dict)
        a_callable("load_state_dict", load_state_dict)
        if name in self._states:
            raise ValueError(f"a state named {name!r} is already registered")
        self._states[name] = (state_dict, load_state_dict)

    def watch(self, module: nn.Module) -> None:
        """Count `module`'s backward passes on this rank: a step whose ranks ran other counts is discarded, named."""
        nn_module("module", module)
        if self._backwards is not None:
            self._backwards.remove()
        self._backwards = BackwardCount(module)

    def require_same(self, **settings) -> None:
        """Add settings every member group must share (as `Manager.require_same`); call it on every rank."""
        self._settings.update(settings)  # the run's identity in the checkpoints of every rank
        if self._manager is not None:
            self._manager.require_same(**settings)

    def _state_dict(self) -> dict:
        return {name: get() for name, (get, _) in self._states.items()}

    def _load_state_dict(self, state: dict) -> None:
        for name, (_, load) in self._states.items():
            load(state[name])

    # ------------------------------------------------------------ once per step

    @property
    def quorum(self) -> Quorum | None:
        """The quorum of groups of the step under way, or of the last one; None before any."""
        return self._quorum

    @property
    def capacity(self) -> int:
        """The most groups this one can train with (its smallest global batch per rank); 0: any. Rank 0's counts."""
        return self._manager.capacity if self._manager is not None else 0

    @capacity.setter
    def capacity(self, value: int) -> None:
        if self._manager is not None:
            self._manager.capacity = value

    def start_step(self) -> Quorum:
        """Agree on this step's quorum of groups; receive each lane's state if behind; join the lanes. The quorum."""
        if self._in_step:
            raise RuntimeError(f"group {self.id!r} rank {self.rank}: start_step() called again before should_commit()")
        if self._disk is not None:  # before the leader raises the store's committed mark: every rank holds it
            self._disk.before_step(self, self._synced)
        if self._manager is not None:
            try:
                quorum = self._manager.start_step()
            except GroupBroken:
                raise
            except BaseException as e:
                self._tell(_stop(e))
                raise
            self._tell(("go", quorum.to_json(), self._manager.step))
        else:
            _, text, step = self._follow({"go"})
            quorum = Quorum.from_json(text)
            self.step = step
        if self._manager is not None:
            self.step = self._manager.step
        self._quorum, self._in_step, self._ok, self._compared = quorum, True, True, False
        if self._backwards is not None:
            self._backwards.reset()  # the step's forward and backward come after its quorum
        return quorum

    def _lead_lanes(self, quorum: Quorum) -> None:
        """On rank 0, within the manager's entry: tell the ranks their lane and plan, enter, and check that all did."""
        plan = plan_recovery(quorum)
        info = {"round": quorum.round, "number": quorum.group, "rank": quorum.rank(self.id), "ids": quorum.ids,
                "size": len(quorum.members), "send": self.id in plan.values(), "source": plan.get(self.id)}
        self._tell(("enter", info))
        if not self._all(self._enter_lane(info)):
            raise RuntimeError(f"group {self.id!r}: a rank could not enter lane group {quorum.group} "
                               f"(rank 0: {self.last_error})")

    def _enter_lane(self, info: dict) -> bool:
        """Send or receive this lane's state as planned, and join its lane if it changed; False if that failed."""
        try:
            self._lane.forget()
            if info["send"]:
                self._lane.send(info["round"], self._state_dict())
            if info["source"] is not None:
                self.recoveries.append(self._lane.receive(info["round"], info["source"], self._load_state_dict))
            if self._lane.number != info["number"]:
                self._lane.form(info["number"], info["rank"], info["size"], info["ids"])
            return True
        except RuntimeError as e:  # RecoveryError, gloo's rendezvous: a peer gone meanwhile
            self.last_error = without_traceback(e)
            self._lane.drop()
            if isinstance(e, (RecoveryError, LaneLost)):  # a sender or a lane's member lost: said on every rank
                _log.warning(f"replica group {self.id!r}, rank {self.rank}: {str(e).strip().splitlines()[0]}")
            return False

    def average(self, tensor: torch.Tensor) -> bool:
        """Average `tensor` in place over this rank's lane; False (the step cannot commit) if a peer failed.

        Sum then divide; an average that comes back NaN or Inf is averaged again from the shares, each divided
        first (`bucketed.average_fitting`: finite shares whose sum overflows commit, not retaken forever).
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if not self._in_step:
            raise RuntimeError("average() before start_step(): there is no quorum to average over")
        if not self._ok:
            return False
        alike = self._compared or self._same_backwards()
        # What a second average starts from (the first overwrites the tensor with the sum): a copy of the share,
        # taken only when some member's share might not sum finite (`share.may_not_sum`, agreed in the lane's
        # header), the only case in which the first average can come back NaN/Inf and `refill` run.
        kept: list[torch.Tensor] = []
        def first_or_again(t: torch.Tensor, divide_first: bool = False) -> bool:
            return self._lane_average(t, divide_first, None if divide_first else lambda s: kept.append(s.clone()))
        try:  # ValueError (another tensor on a peer group) goes up
            average_fitting(SimpleNamespace(average=first_or_again), tensor, lambda t: t.copy_(kept[0]))
        except RuntimeError as e:  # gloo's: a peer of the lane died or hangs
            self.last_error, self._ok = without_traceback(e), False
            return False
        if alike and self.guard and not finite(tensor):
            _log.warning(f"replica group {self.id!r}, rank {self.rank}: step {self.step}: the average over "
                         f"{', '.join(self._quorum.ids)} is not finite (NaN or Inf): the step is discarded on every "
                         f"member group")
            alike = False
        self._ok = alike  # summed all the same: the other groups' ranks wait on this one in the lane
        return alike

    def _lane_average(self, tensor: torch.Tensor, divide_first: bool, keep: Callable | None) -> bool:
        average_shares(tensor, self._lane.size, lambda t: self._lane.sum(t, self._quorum.ids, keep), divide_first)
        return True

    def _same_backwards(self) -> bool:
        """At the step's first average: whether the group's ranks ran as many backward passes (`watch`)."""
        self._compared = True
        try:
            return self._backwards is None or self._backwards.alike(
                self._group, f"replica group {self.id!r}, rank {self.rank}: step {self.step}")
        except RuntimeError as e:
            raise self._broken(e) from None

    def should_commit(self, ok: bool = True) -> bool:
        """Vote on this step for this rank; True on every rank of every member group if all of them averaged."""
        if not isinstance(ok, bool):
            raise TypeError(f"ok must be True or False, got {ok!r}")
        if not self._in_step:
            raise RuntimeError("should_commit() without a step under way: call start_step() first")
        self._in_step = False
        if self._ok and not self._compared:  # no average in this step: the counts are compared here
            self._ok = self._same_backwards()
        every = self._all(ok and self._ok)  # a rank that failed makes its whole group vote discard
        if self._manager is not None:
            try:
                committed = self._manager.should_commit(every)
            except BaseException as e:
                self._tell(_stop(e))
                raise
            self._synced = self._manager.synced  # its steps are the run's: they are saved (group_disk.py)
            self._tell(("vote", committed, self._synced))
        else:
            _, committed, self._synced = self._follow({"vote"})
        self._ok = False
        if committed:
            self.step += 1
        else:
            self._lane.drop()  # a failed lane is never reused: the next quorum names a new one
        return committed

    # ------------------------------------------------------------ inside the group

    def _tell(self, message: tuple) -> None:
        """Rank 0: send `message` to the group's ranks (GroupBroken if one is gone)."""
        try:
            dist.broadcast_object_list([message], group=self._group, group_src=0)
        except RuntimeError as e:
            raise self._broken(e) from None

    def _follow(self, expected: set[str]) -> tuple:
        """A rank but 0: rank 0's next word, one of `expected`; a stop raises what rank 0 raised, in its words."""
        box = [None]
        try:
            dist.broadcast_object_list(box, group=self._group, group_src=0)
        except RuntimeError as e:
            raise self._broken(e) from None
        while box[0][0] == "enter":  # a round entered, perhaps voted down: the next word follows
            if not self._all(self._enter_lane(box[0][1])):
                self._lane.drop()
            try:
                dist.broadcast_object_list(box, group=self._group, group_src=0)
            except RuntimeError as e:
                raise self._broken(e) from None
        if box[0][0] == "stop":
            raise _RAISED.get(box[0][1], RuntimeError)(box[0][2])
        assert box[0][0] in expected, box[0]  # rank 0 speaks this protocol only
        return box[0]

    def _all(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank of the group (MIN over the group); GroupBroken if a rank is gone."""
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        except RuntimeError as e:
            raise self._broken(e) from None
        if not flag.item():
            self._lane.drop()
        return bool(flag.item())

    def _broken(self, error: BaseException) -> GroupBroken:
        """The group lost a rank: rank 0 votes the step down and leaves the quorum; the error every rank raises."""
        self._lane.drop()
        self._in_step = False
        if self._manager is not None:
            try:
                if self._manager._in_step:
                    self._manager.should_commit(False)  # the other groups learn it now, not at a heartbeat timeout
            except Exception:  # noqa: BLE001 - the group leaves whatever the store says
                pass
            self._manager.close()
        lost = f"rank {1 - self.rank} of 2; " if self.size == 2 else ""  # gloo names an address, not a rank
        return GroupBroken(f"replica group {self.id!r}, rank {self.rank}: another rank of the group failed at step "
                           f"{self.step} ({lost}gloo: {gloo_words(error)}); the group left the quorum as a whole: "
                           f"start all its ranks again")

    def finish(self) -> None:
        """The run took its last step: rank 0 marks it finished (a group started later is told so), and all leave."""
        if self._disk is not None:  # every rank saved and marked it before the leader marks the run finished
            self._disk.finish(self)
        self._lane.drop()
        if self._manager is not None:
            self._manager.finish()

    def close(self) -> None:
        """Leave: rank 0 stops heartbeating (the other groups stop waiting for this one); the lane is dropped."""
        self._lane.drop()
        if self._manager is not None:
            self._manager.close()
