"""What manualdp keeps between calls on one process group, in one object per group.

Collectives on a group share a few things across calls: the one thread that runs them in
order (`worker.py`), the link constants every rank agreed on (and whether measured times have drifted
from them), the call check's counter, the bytes sent, and per thread the scratch space and
the works kept until the next call. Kept apart in module-level dicts, each file had its own
idea of what a group is and none said what a group holds; here one `GroupState` says it,
`group_state(group)` is read once where a user hands the group in, and the executor is
given the state. A test that wants a fresh start makes a fresh state.
"""
from __future__ import annotations

import threading
import weakref

import torch
import torch.distributed as dist

from .peers import group_ranks, group_timeout
from .worker import InlineWorker, SerialWorker

__all__ = ["GroupState", "group_state", "group_worker", "release", "Traffic"]


class Traffic:
    """The bytes this process has sent by the executor on one process group, per dtype (e.g. "float32").

    The data of every collective, counted from this rank's sends in its plan as each call
    starts (the drop-in's comparison of comm hooks at its first step too, a few int64s); not
    counted: the call check's fingerprints, and torch's own collectives. A
    benchmark reads `traffic(group).sent()` before and after a step, on each rank.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the group's worker thread and the main thread both send
        self._sent: dict[str, int] = {}

    def add(self, dtype: torch.dtype, nbytes: int) -> None:
        name = str(dtype).removeprefix("torch.")
        with self._lock:
            self._sent[name] = self._sent.get(name, 0) + nbytes

    def sent(self) -> dict[str, int]:
        """A copy of the counts so far: dtype name -> bytes."""
        with self._lock:
            return dict(self._sent)


class GroupState:
    """Everything kept between calls on one process group."""

    def __init__(self, pg) -> None:
        # A weak reference: a process group held past destroy_process_group aborts the interpreter when freed at exit.
        self.pg = weakref.ref(pg)
        self.rank, self.peers = group_ranks(pg)  # this process's rank in the group, and every member's global rank
        self.early = dist.get_backend(pg) == "gloo"  # the executor posts receives a round early (gloo) or not
        self.link = None         # (the agreed Link, where from: "given", "cached" or "measured"); None until agreed
        self.times: dict = {}    # bytes -> (first ratios, latest ratios) of measured to predicted "auto" times
        self.confirmed: set = set()  # sizes whose first times a later window agreed with (`tune.drift_flag`)
        self.drifted = False     # a drift reported since the last look (`tune.drift_flag` also judges `times`)
        self.drift_looks = 0     # looks at the drift in a row that each saw it (`tune.drift_flag`)
        self.calls = 0           # checked calls made so far: the call check's counter
        self.headers = None      # the call check's receives for the next call's headers, posted early (gloo)
        self.late = None         # two ranks on gloo: the call check's `late.LateWatch` (False: none, headers instead)
        self.remeasures = 0      # times "auto" measured the link again after the first agreement (drift)
        self.traffic = Traffic()  # bytes sent by the executor
        self.local = threading.local()  # per thread (the worker's and the caller's): scratch space, kept works
        self._worker = None
        self._lock = threading.Lock()

    @property
    def timeout(self) -> float | None:
        """The group's timeout in seconds (None: torch does not say), read at each call: it may be changed after."""
        pg = self.pg()
        return None if pg is None else group_timeout(pg)

    @property
    def worker(self) -> SerialWorker | InlineWorker:
        """The one thread that runs, in submission order, every wrapper's collectives on this group."""
        with self._lock:
            if self._worker is None:
                if len(self.peers) == 1:
                    self._worker = InlineWorker()
                else:
                    nccl = dist.get_backend(self.pg()) == "nccl"
                    device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
                    # On a GPU the thread must talk to this rank's device (the current device is per thread).
                    init = (lambda: torch.cuda.set_device(device)) if device is not None else None
                    self._worker = SerialWorker("manualdp-allreduce", initializer=init)
            return self._worker


# id(process group) -> its state. Only the id is kept (and a weak reference in the state): a
# process group held past destroy_process_group aborts the interpreter when it is freed at exit.
_STATES: dict[int, GroupState] = {}
_STATES_LOCK = threading.Lock()  # the worker thread and the main thread both look states up


def group_state(group=None) -> GroupState:
    """The state of `group` (default: all ranks), made the first time it is asked for."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group "
                           "(or manualdp.spmd.init_from_env) first")
    state = _STATES.get(id(pg))
    if state is not None and state.pg() is pg:
        return state
    with _STATES_LOCK:
        state = _STATES.get(id(pg))
        if state is None or state.pg() is not pg:  # none yet, or a freed group's whose id came back
            if state is not None and state._worker is not None:
                state._worker.shutdown()
            if state is not None and state.late:
                state.late.close()
            state = _STATES[id(pg)] = GroupState(pg)
        return state


def release(group=None) -> None:
    """Let go of what this process keeps of `group` (default: all ranks), before it is destroyed.

    Its receives posted early (the next call's headers) and the works kept until the next call hold
    gloo's connections, and with them gloo's network thread, past `destroy_process_group`: left to the
    interpreter's exit, that thread's end raced Python's and aborted the process after its work was done
    ("terminate called without an active exception", exit -6). Freed here, on the caller's thread, they go
    while Python runs; each thread's kept works go with the old `local`.
    """
    pg = group if group is not None else dist.group.WORLD
    with _STATES_LOCK:
        state = _STATES.pop(id(pg), None) if pg is not None else None
    if state is not None:
        state.headers, state.local = None, threading.local()
        if state.late:
            state.late.close()


def after_wrappers(state: GroupState) -> None:
    """Wait until what the wrappers queued on the group's worker has gone out: collectives then follow program order.

    A wrapper queues its collectives on the group's worker thread (`GroupState.worker`): the
    step's call check as forward begins, the buckets during backward. A collective called
    meanwhile on the main thread (a loss averaged between forward and backward) would race
    them to the wire, and the ranks could pair one's with the other's. Called first, this
    makes it go out in the order the program called it, as in torch.distributed. A worker
    that failed (a wrapper's mismatched step) runs nothing more, so the call goes ahead at
    once, as on a rank whose worker is well; so does one made once the worker's thread has
    ended (at interpreter exit nothing would take it), or on the worker itself (a comm hook).
    """
    worker = state._worker
    if worker is not None and not isinstance(worker, InlineWorker) and not worker.is_current() and worker.serving():
        try:
            worker.submit(_nothing).result()
        except Exception:  # noqa: S110 - the worker failed for good: nothing queued there will go out
            pass


def _nothing() -> None:
    pass


def group_worker(group=None) -> SerialWorker | InlineWorker:
    """The one thread that runs, in submission order, every wrapper's collectives on `group`."""
    return group_state(group).worker
