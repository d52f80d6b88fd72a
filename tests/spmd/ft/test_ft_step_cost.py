"""What a fault-tolerant step of `FaultTolerantDDP` costs, in counts (never times): the work each bucket and each
average does beyond the drop-in's, held to what it must be (issue 44: `bench/ft.py`'s 0.33x at the mlp)."""
import collections
import concurrent.futures
import dataclasses
import json
import math
import threading
import time

import pytest
import torch
import torch.distributed as dist

from manualdp.spmd.ft import Coordinator, FaultTolerantDDP, Manager
from manualdp.spmd.ft import keys
from manualdp.spmd.ft.coordinator import connect
from manualdp.spmd.ft.heartbeat import Heartbeat, Liveness, register
from manualdp.spmd.ft.quorum import Member, Quorum, wait_for_quorum
from manualdp.spmd import allreduce
from manualdp.spmd.ft.bucketed import finite
from manualdp.spmd.ft.manager import ONE_ROUND, schedule_for
from manualdp.spmd.launch import launch
from manualdp.spmd.transport.p2p import plan, schedule_of
from tests.spmd.ft.test_ft_ddp_buckets import loss_of, make, two_members

STEADY_ASK = 9  # store round trips of a steady ask (`test_a_steady_quorum_is_decided_in_few_round_trips`)
STEADY_STEP = 14  # store round trips per steady step of `FaultTolerantDDP` (`test_a_steady_fault_tolerant_step_...`)


@pytest.fixture
def coordinator():
    with Coordinator(0) as c:
        yield c


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_finite_is_isfinite_all_also_where_the_squares_overflow(dtype):
    big = torch.finfo(dtype).max / 2  # finite, but its square is not: the norm overflows, the exact test decides
    cases = [torch.zeros(0, dtype=dtype), torch.ones(5, dtype=dtype), torch.full((7,), big, dtype=dtype)]
    for bad in (math.nan, math.inf, -math.inf):
        t = torch.ones(9, dtype=dtype)
        t[4] = bad
        cases.append(t)
    for t in cases:
        assert finite(t) == bool(torch.isfinite(t).all()), t


def test_a_finite_buckets_average_is_judged_without_a_boolean_tensor_of_its_size(coordinator, monkeypatch):
    """Before: `isfinite(grads).all()` on every bucket's average, a boolean tensor as large as the bucket (about 16x
    the CPU time of its norm: 400 us of an mlp's step). Now one norm says so; `isfinite` runs only where it is not."""
    sizes, real = [], torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: sizes.append(t.numel()) or real(t))
    buckets = one_step_of_two(coordinator.port)
    assert buckets == [2, 8, 4, 12] and not set(sizes) & set(buckets), sizes


def one_step_of_two(port: int) -> list[int]:
    """One committed step of `FaultTolerantDDP` (a bucket per parameter) as if of two members: each bucket's size."""
    net = make()
    with Manager("one", "127.0.0.1", port, timeout=10) as manager:
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=0.1), manager, bucket_cap_mb=None)
        calls = two_members(manager)
        ft.start_step()
        loss_of(ft, 0).backward()
        assert ft.step()
    return [n for _, n in calls][:-1]  # the last average is the guard's norms


def test_at_two_members_a_buffer_up_to_one_round_goes_in_one_round_and_larger_ones_or_more_members_as_asked():
    """Before: the ring's two rounds for every buffer (the guard's norms, an mlp's 0.8 MB bucket): twice the messages,
    ~3x the CPU of one round."""
    small, large = torch.zeros(ONE_ROUND // 4, dtype=torch.float32), torch.zeros(ONE_ROUND // 8 + 1)
    assert plan_rounds(schedule_for("ring", 2, small)) == 1 == plan_rounds(schedule_for("tree", 2, torch.zeros(2)))
    assert schedule_for("ring", 2, large.double()) == "ring" and schedule_for("tree", 3, small) == "tree"


def plan_rounds(algorithm: str) -> int:
    return len(plan(schedule_of(algorithm, 2), 0, 1 << 10, 1 << 20))


def _both_schedules(sizes):
    torch.manual_seed(dist.get_rank())
    out = []
    for n in sizes:
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            x = torch.randn(n, dtype=torch.float64).mul_(10.0 ** torch.randint(-30, 30, (1,)).item()).to(dtype)
            a, b = x.clone(), x.clone()
            allreduce(a, "ring", timeout=60.0)
            allreduce(b, "recursive_doubling", timeout=60.0)
            out.append((n, str(dtype), torch.equal(a.view(torch.uint8), b.view(torch.uint8))))
    return out


def test_at_two_ranks_one_round_gives_the_rings_bits():
    """What `schedule_for` rests on: at two ranks, recursive doubling and the ring hold the same bits."""
    for rank_result in launch(_both_schedules, 2, ([1, 2, 3, 1000, 4097],), timeout=120.0):
        assert all(same for *_, same in rank_result), [r for r in rank_result if not r[-1]]


def test_a_commits_mark_and_record_go_on_the_ask_thread_as_the_vote_commits_not_on_the_next_asks_path(
        coordinator, monkeypatch):
    """Before: the next `start_step`'s ask wrote them first (2-4 store round trips before it could ask, on the wait
    the main thread meets as backward starts). Now the thread writes them while the optimizer steps; the ask doesn't."""
    from manualdp.spmd.ft import manager as manager_module
    records, real = [], manager_module.record_committed
    def record(store, step):
        records.append((threading.current_thread().name, step))
        real(store, step)

    monkeypatch.setattr(manager_module, "record_committed", record)
    net = make()
    with Manager("one", "127.0.0.1", coordinator.port, timeout=10, async_quorum=True) as manager:
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=0.1), manager)
        for k in range(3):
            ft.start_step()
            loss_of(ft, k).backward()
            assert ft.step()
            manager._ahead.settled()  # the job handed over as the vote committed has ended
            assert records[-1] == ("manualdp-ft-quorum-one", k + 1), records
        assert [s for _, s in records] == [1, 2, 3]  # once per commit: the asks wrote none again


# ---------------------------------------------------------------- the quorum's round trips in a steady step

class _Counted:
    """A store client that counts its calls (round trips to the coordinator), by call."""

    def __init__(self, inner) -> None:
        self._inner, self.calls = inner, collections.Counter()

    def __getattr__(self, name: str):
        attribute = getattr(self._inner, name)
        if not callable(attribute) or name in ("clone", "set_timeout"):  # set_timeout: the client's own, no trip
            return attribute

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return attribute(*args, **kwargs)
        return counted


def _steady_ask(connect_, min_replicas: int = 2) -> tuple[Quorum, collections.Counter]:
    """Replica a's ask for round 2 after a and b stepped in round 1 and committed, b's ask already in: its calls."""
    from manualdp.spmd.ft import admission
    from manualdp.spmd.ft.durable import Floor, record_committed
    from manualdp.spmd.ft.quorum import publish_mark
    beats = []
    for rid in "ab":
        register(connect_(), rid)
        beats.append(Heartbeat(connect_(), rid, 0.05))
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = list(pool.map(lambda rid: _ask(connect_(), rid, min_replicas), "ab"))[0]
        s = connect_()
        record_committed(s, 1)
        admission.publish(s, "a", admission.canonical({"lr": 0.1}))  # the run's settings, as its first quorum's
        for rid in "ab":
            publish_mark(s, rid, (1, first.round))
        s.append(keys.asks(first.round + 1), json.dumps(dataclasses.asdict(
            Member("b", 1, True, (first.group, 2), min_replicas, first.round))) + "\n")
        s = connect_()
        liveness = Liveness(s, 30.0)  # generous: a loaded machine may stall a heartbeat
        liveness.live(["a", "b"])  # a member has seen the others' heartbeats before
        counted = s._client = _Counted(s._client)
        me = Member("a", 1, True, (first.group, 2), min_replicas, first.round)
        quorum = wait_for_quorum(s, me, liveness, first.round, 30.0, 30.0, time.monotonic(), Floor(s, "a", 10.0))
        return quorum, counted.calls
    finally:
        for b in beats:
            b.stop(leave=True)


def _ask(s, rid, min_replicas) -> Quorum:
    me = Member(rid, 0, True, None, min_replicas)
    return wait_for_quorum(s, me, Liveness(s, 30.0), 0, 30.0, 30.0, time.monotonic())


@pytest.mark.parametrize("token", [None, "a-secret-of-the-run"])
def test_a_steady_quorum_is_decided_in_few_round_trips(token, request):
    """Before: 16 round trips (then 10) for the ask of a member whose quorum did not change (the round's quorum
    peeked twice before the ask, each key read alone, the heartbeats in a call of their own, the marks read though
    nobody is outside the members). Now `STEADY_ASK`."""
    with Coordinator(0, token=token) as c:
        quorum, calls = _steady_ask(lambda: connect("127.0.0.1", c.port, 10, token=token, namespace=request.node.name))
    assert quorum.ids == ["a", "b"] and quorum.agreed and quorum.step == 1
    assert sum(calls.values()) <= STEADY_ASK, calls


def test_a_steady_fault_tolerant_step_asks_the_store_few_times(coordinator):
    """A replica's store round trips per committed step of `FaultTolerantDDP` (quorum asked ahead: the mark and the
    record as the vote commits, the ask, the vote), counted over 4 steady steps. Before: 15 (the run's end read
    twice, by the record and by the ask right after it, on the same thread). Now `STEADY_STEP`."""
    net = make()
    with Manager("solo", "127.0.0.1", coordinator.port, timeout=10, async_quorum=True) as manager:
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=0.1), manager)
        for k in range(7):
            if k == 3:
                manager._ahead.settled()  # the last uncounted step's mark and record are written
                counted = manager.store._client = _Counted(manager.store._client)
            ft.start_step()
            loss_of(ft, k).backward()
            assert ft.step()
        manager._ahead.settled()
    assert sum(counted.calls.values()) <= 4 * STEADY_STEP, counted.calls
