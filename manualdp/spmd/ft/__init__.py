"""Fault tolerance: data parallelism that trains on through a replica that dies, and takes it back in.

Each replica is a process of its own (one device), started on its own, and the replicas
meet in a store that one more process, the coordinator, hosts. Once per step they agree on
who is in (the quorum), re-form their process group when that changes, average the
gradients with the book's schedules, and apply the step on all members or on none. A
replica that dies costs the others the step it interrupted; one that comes back receives
the state of a member at the highest step and trains on. torchft does this for torch; here
every piece is a short file, in reading order:

- `coordinator.py`: `Coordinator`, the process that hosts the store (a `TCPStore`) on the address given; `connect`;
- `signed_store.py`: the store as the replicas see it: with the run's secret, every name and value signed;
- `keys.py`: the store's keys, every one the room writes or reads;
- `look.py`: one look at the store: each key read once per decision, a check and its get in one round trip;
- `trust.py`: what a quorum trusts of what it reads: well-formed values, a majority, claims the history bears out;
- `heartbeat.py`: who is alive: a counter each replica moves, watched on each observer's clock;
- `admission.py`: who may join: the run's settings, and room in the global batch; a misfit is refused alone;
- `quorum.py`: once per step, the live replicas agree on the members, the step and the group;
- `quorum_group.py`: the quorum's gloo process group, re-formed when the members change;
- `commit.py`: every member votes; the first outcome written to the store is everyone's;
- `recovery.py`: who sends the state to whom, and the state through the store, checksummed;
- `durable.py`: what outlives the processes: the run's committed step in the store (no quorum
  below it), each replica's newest committed state on disk (`checkpoint_dir`), the run's end;
- `ahead.py`: the quorum asked ahead, in a thread during forward and backward (`async_quorum`), and its fast path;
- `phases.py`: how the manager enters each step's quorum: ask, hold the state, send or receive it, join the group;
- `manager.py`: `Manager`, what a training loop asks once per step, tying the above together;
- `guard.py`: the members' contribution norms, gathered: one non-finite or far out of line discards the step;
- `average.py`: how each wrapper's step ends: flatten, average over the quorum, vote, unflatten;
- `bucketed.py`: the drop-in's reducer, each bucket averaged over the quorum through the manager during backward;
- `ddp.py`: `FaultTolerantDDP`: `start_step()`, backward, `step()` returns whether it committed;
- `local_sgd.py`: `LocalSGD` and `DiLoCo`: H steps alone, then the replicas meet.

This room stands on `transport/` (deadlines, `PeerError`), the collectives, the book's flat
buffers (`buckets.py`) and the drop-in's reducer (`ddp/`); nothing else in the engine imports it.
"""
from .coordinator import Coordinator
from .quorum import Member, Quorum
from .recovery import RecoveryError, plan_recovery
from .durable import RunFinished
from .manager import Manager
from .ddp import FaultTolerantDDP
from .local_sgd import DiLoCo, LocalSGD

__all__ = ["Coordinator", "Manager", "Member", "Quorum", "RecoveryError", "RunFinished", "plan_recovery",
           "FaultTolerantDDP", "LocalSGD", "DiLoCo"]
