"""Allreduce, reduce-scatter, all-gather, reduce and broadcast across processes, by the p2p executor.

The schedules are the book's (`manualdp.schedule`); each rank runs its share of them with
`manualdp.spmd.transport.p2p.run_schedule`. As in the single controller they work in place on the
whole buffer: rank i's own chunk is `manualdp.collectives.chunk(tensor, i, world_size)`.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..collectives import chunk
from ..schedule import get_collective
from ..validate import boolean, check_summable, int_between, one_of, positive_int, timeout_seconds
from .transport.group import after_wrappers, group_state
from .transport.call_check import make_check, same_call
from .transport.p2p import DEFAULT_SEGMENT_BYTES, run_allreduce, run_schedule
from .auto.pick import choose
from .auto.tune import DRIFT_EVERY, ENGINE_ALGORITHMS, agreed, drift_flag, measure_again, note

__all__ = ["ENGINE_ALGORITHMS", "allreduce", "reduce_scatter", "all_gather", "reduce", "broadcast"]


def allreduce(tensor: torch.Tensor, algorithm: str = "auto", group=None, *,
              segment_bytes: int = DEFAULT_SEGMENT_BYTES, timeout: float | None = None, check: bool = True,
              step: int = -1, identity: int = 0) -> None:
    """Sum `tensor` over the ranks of `group` (default: all), in place, with manualdp's schedules.

    Every rank must call it with a tensor of the same shape and dtype, as with
    `torch.distributed.all_reduce`. Afterwards the ranks hold bitwise identical sums. A peer
    silent for `timeout` seconds (default: the group's timeout), or gone, raises `PeerError`.

    `check` (default True): compare the calls (`manualdp.spmd.transport.call_check`): every rank's
    fingerprint (size, dtype, algorithm, segment size, call number) decides the tag its data
    travels on, so that only identical calls' messages pair, and ranks called differently all
    raise, naming who had what. At two ranks on gloo that is all that travels while the calls
    agree; only a first round that is late makes the ranks compare fingerprints (through the
    store). With more ranks, or NCCL, fixed-size headers go to every rank beside the first round
    (or alone, first, on NCCL). The check alone, a round trip, runs only where there is no data
    to carry it (an empty tensor, the first "auto" call, which must agree before it measures the
    link, one "auto" call in `DRIFT_EVERY`). Pass False only where the calls are known to match,
    as `DistributedDataParallel` does for its buckets after checking each step once (every
    rank's buckets were compared at construction).

    `step` (default -1: none): a wrapper's count of its steps, compared by the check too (the
    ladder's rungs 3 and 4 carry their step check on a step's first allreduce this way).
    `identity` (default 0: none, at most 2**62): a number standing for the caller (a wrapper's
    own), compared too, so that two wrappers' calls never pair.

    With "auto" and the check, each rank times its calls against the cost model's prediction;
    one call in `DRIFT_EVERY` carries whether this rank saw those times drift at two such looks
    in a row (`manualdp.spmd.auto.tune.drift_flag`), and then every rank measures the link again
    together: a moment's load on the host does not make a steady loop measure.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    check_summable(tensor)
    one_of("algorithm", algorithm, ENGINE_ALGORITHMS)
    positive_int("segment_bytes", segment_bytes)
    timeout = timeout_seconds("timeout", timeout)
    boolean("check", check)
    int_between("step", step, -1, 2 ** 62)
    int_between("identity", identity, 0, 2 ** 62)
    state = group_state(group)
    if len(state.peers) == 1:
        return
    timeout = timeout if timeout is not None else state.timeout
    after_wrappers(state)
    auto, requested = algorithm == "auto", algorithm
    # Every DRIFT_EVERY-th checked call of "auto" runs its check alone, carrying this rank's drift: all measure
    # again together when one saw the link change for two looks in a row (`tune.drift_flag`). The count is the
    # call number every rank compares, so every rank looks at the same call.
    look = auto and check and state.link is not None and (state.calls + 1) % DRIFT_EVERY == 0
    carried = check and state.early and tensor.numel() > 0 and not (auto and state.link is None) and not look
    # Alone, first: "auto" may measure the link, a collective that every rank must reach.
    if check and not carried and same_call(state, tensor, algorithm, segment_bytes, timeout,
                                           flag=look and drift_flag(state), step=step, identity=identity):
        measure_again(state, timeout)
    if tensor.numel() == 0:
        return
    nbytes = tensor.numel() * tensor.element_size()
    if auto:  # the cost model's pick
        algorithm = choose(len(state.peers), nbytes, agreed(state, timeout), tensor.element_size(), segment_bytes)
    header = make_check(state, tensor, requested, segment_bytes, timeout, schedule=algorithm,
                        step=step, identity=identity) if carried else None
    start = time.perf_counter()
    run_allreduce(tensor, algorithm, state, segment_bytes, timeout, check=header)
    if auto and check and tensor.device.type == "cpu":  # on a GPU the call returns before the work is done
        note(state, algorithm, tensor.numel() * tensor.element_size(), tensor.element_size(), segment_bytes,
             time.perf_counter() - start)


def _run(collective: str, tensor, algorithm: str, group, root: int, segment_bytes: int, timeout, sums: bool,
         check: bool, step: int = -1, identity: int = 0) -> int:
    """Check, then run `collective` on this rank; returns this rank's index in `group`.

    With `check`, the ranks compare their calls (collective, size, dtype, algorithm, root,
    segment size, call number: `transport.call_check`) before any data is used, as `allreduce`
    does: on gloo the headers ride beside the first round, whose receives wait in scratch space
    until the check has passed, so a refused call leaves the tensor unchanged; alone first (a
    round trip) on NCCL and for an empty tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if sums:
        check_summable(tensor)
    positive_int("segment_bytes", segment_bytes)
    timeout = timeout_seconds("timeout", timeout)
    boolean("check", check)
    int_between("step", step, -1, 2 ** 62)
    int_between("identity", identity, 0, 2 ** 62)
    state = group_state(group)
    int_between("root", root, 0, len(state.peers) - 1)
    schedule = get_collective(collective, algorithm, len(state.peers), root)
    if len(state.peers) == 1:
        return state.rank
    timeout = timeout if timeout is not None else state.timeout
    after_wrappers(state)
    carried = check and state.early and tensor.numel() > 0
    if check and not carried:
        same_call(state, tensor, algorithm, segment_bytes, timeout, collective=collective, root=root, step=step,
                  identity=identity)
    if tensor.numel():
        header = make_check(state, tensor, algorithm, segment_bytes, timeout, schedule=algorithm,
                            collective=collective, root=root, step=step, identity=identity) if carried else None
        run_schedule(tensor, schedule, state, segment_bytes, timeout, check=header)
    return state.rank


def reduce_scatter(tensor: torch.Tensor, algorithm: str = "ring", group=None, *,
                   segment_bytes: int = DEFAULT_SEGMENT_BYTES, timeout: float | None = None,
                   check: bool = True) -> torch.Tensor:
    """Sum `tensor` over the ranks so that this rank holds the sum of its own chunk; returns that chunk (a view)."""
    rank = _run("reduce_scatter", tensor, algorithm, group, 0, segment_bytes, timeout, sums=True, check=check)
    return chunk(tensor, rank, dist.get_world_size(group))


def all_gather(tensor: torch.Tensor, algorithm: str = "ring", group=None, *,
               segment_bytes: int = DEFAULT_SEGMENT_BYTES, timeout: float | None = None, check: bool = True) -> None:
    """Fill `tensor` with every rank's own chunk, in place: afterwards it is equal on all ranks."""
    _run("all_gather", tensor, algorithm, group, 0, segment_bytes, timeout, sums=False, check=check)


def reduce(tensor: torch.Tensor, dst: int = 0, algorithm: str = "tree", group=None, *,
           segment_bytes: int = DEFAULT_SEGMENT_BYTES, timeout: float | None = None, check: bool = True) -> None:
    """Sum `tensor` over the ranks into group rank `dst`'s copy; the others hold partial sums afterwards."""
    _run("reduce", tensor, algorithm, group, dst, segment_bytes, timeout, sums=True, check=check)


def broadcast(tensor: torch.Tensor, src: int = 0, algorithm: str = "tree", group=None, *,
              segment_bytes: int = DEFAULT_SEGMENT_BYTES, timeout: float | None = None, check: bool = True,
              step: int = -1, identity: int = 0) -> None:
    """Copy group rank `src`'s `tensor` into every other rank's, in place.

    `step` (default -1: none): a wrapper's count of its steps, compared by the check too, as `allreduce`'s (the
    ladder's rungs copy rank 0's buffers before each forward pass this way); `identity` as `allreduce`'s."""
    _run("broadcast", tensor, algorithm, group, src, segment_bytes, timeout, sums=False, check=check, step=step,
         identity=identity)
