"""allreduce's call check: ranks that call differently all raise, naming who had what; nothing aborts."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from manualdp.allreduce import run_schedule
from manualdp.cost import check_schedule
from manualdp.spmd import launch
from manualdp.spmd.transport.call_check import everyone_hears_everyone
from manualdp.spmd.transport.p2p import plan


@pytest.mark.parametrize("n", range(1, 10))
def test_every_device_hears_every_device_in_log2_rounds_of_one_message(n):
    schedule = everyone_hears_everyone(n)
    check_schedule(schedule)
    assert len(schedule.rounds) == (n - 1).bit_length()
    rows = [torch.full((n,), -1.0) for _ in range(n)]
    for i, row in enumerate(rows):
        row[i] = i
    run_schedule(schedule, rows)
    assert all(row.tolist() == list(range(n)) for row in rows)
    for rank in range(n):  # one peer to send to and one to hear from per round (a wrap-around splits a message)
        for rnd in plan(schedule, rank, n, n):
            assert len({m.peer for m in rnd.sends}) == len({m.peer for m in rnd.recvs}) == 1


def _mismatches(differs: int):
    """Group rank `differs` calls allreduce otherwise, one way per case; then a call that agrees."""
    from manualdp.spmd.collectives import allreduce
    from manualdp.spmd.transport.group import group_state
    rank = torch.distributed.get_rank()
    odd = rank == differs
    cases = {  # name -> (tensor, algorithm, segment_bytes)
        "size": (torch.ones(9 if odd else 6), "ring", 1 << 20),
        "empty": (torch.ones(0 if odd else 6), "ring", 1 << 20),
        "dtype": (torch.ones(6, dtype=torch.float64 if odd else torch.float32), "ring", 1 << 20),
        "algorithm": (torch.ones(6), "tree" if odd else "ring", 1 << 20),
        "auto": (torch.ones(6), "naive" if odd else "auto", 1 << 20),
        "segment": (torch.ones(6), "ring", 8 if odd else 1 << 20),
        "call": (torch.ones(6), "ring", 1 << 20),
        # after the first "auto" call (the link agreed), the headers travel beside the first round of data:
        "auto size": (torch.ones(9 if odd else 6), "auto", 1 << 20),
        "auto algorithm": (torch.ones(6), "ring" if odd else "auto", 1 << 20),
        "segments": (torch.ones(300_000 if odd else 200_000), "ring", 1 << 16),  # several messages in round 0
        "halving": (torch.ones(5 if odd else 7), "halving_doubling", 1 << 20),
        "tree": (torch.ones(7, dtype=torch.float64 if odd else torch.float32), "tree", 1 << 20),
        # partners swap in round 0 (at 3 ranks the extra rank folds in first): sent and received ranges overlap
        "doubling": (torch.ones(5 if odd else 7), "recursive_doubling", 1 << 20),
        "doubling or ring": (torch.ones(7), "ring" if odd else "recursive_doubling", 1 << 20),
    }
    out = {}
    for name, (t, algorithm, segment_bytes) in cases.items():
        if name == "auto size":  # agree the link first
            allreduce(torch.ones(6), timeout=20)
        if name == "call" and odd:  # as if this rank had made one checked call more than the others
            group_state().calls += 1
        before = t.clone()
        try:
            allreduce(t, algorithm, segment_bytes=segment_bytes, timeout=20)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
        out[name + " unchanged"] = torch.equal(t, before)
        if name == "call" and odd:
            group_state().calls -= 1  # back in step: the next call agrees
    t = torch.arange(10.0) * (rank + 1)
    allreduce(t, timeout=20)
    out["sum"] = t.tolist()
    return out


@pytest.mark.parametrize("world_size, differs", [(2, 1), (3, 2)])
def test_ranks_that_call_differently_all_raise_naming_each_ranks_value(world_size, differs):
    results = launch(_mismatches, world_size, (differs,), timeout=90)  # a rank that aborted fails launch
    ours, theirs = {"size": "6", "empty": "6", "dtype": "float32", "algorithm": "ring", "auto": "auto",
                    "segment": "1048576", "auto size": "6", "auto algorithm": "auto", "segments": "200000",
                    "halving": "7", "tree": "float32", "doubling": "7", "doubling or ring": "recursive_doubling"}, \
                   {"size": "9", "empty": "0", "dtype": "float64", "algorithm": "tree", "auto": "naive", "segment": "8",
                    "auto size": "9", "auto algorithm": "ring", "segments": "300000", "halving": "5", "tree": "float64",
                    "doubling": "5", "doubling or ring": "ring"}
    field = {"size": "elements", "empty": "elements", "dtype": "dtype", "algorithm": "algorithm", "auto": "algorithm",
             "segment": "segment_bytes", "auto size": "elements", "auto algorithm": "algorithm",
             "segments": "elements", "halving": "elements", "tree": "dtype", "doubling": "elements",
             "doubling or ring": "algorithm"}
    for rank, out in enumerate(results):
        for name in field:
            per_rank = ", ".join(theirs[name] if r == differs else ours[name] for r in range(world_size))
            assert out[name] is not None, (rank, name)  # every rank raised, also one that agrees with its peers
            assert f"rank {rank}: allreduce called differently across ranks: {field[name]} " in out[name], out[name]
            assert f"(per rank: {per_rank})" in out[name], (rank, out[name])
            assert out[name + " unchanged"], (rank, name)
        calls = out["call"]
        assert calls is not None and "call " in calls and "elements" not in calls, (rank, calls)
        assert out["call unchanged"]
        assert out["sum"] == [i * sum(range(1, world_size + 1)) for i in range(10)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1 << 40), min_size=12, max_size=12), st.integers(0, 10), st.integers(1, 1 << 40))
def test_a_calls_data_tag_is_above_the_tags_people_pick_and_changes_with_every_compared_field(row, field, delta):
    from manualdp.spmd.transport.call_check import _FLAG, HEADER_TAG, _tag
    assert _FLAG == 11  # ten compared fields, the element size, then the flag
    other = list(row)
    other[field] += delta
    for r in (row, other):
        assert 2 ** 30 <= _tag(r) < HEADER_TAG < 2 ** 31  # a C int, above 0 (unchecked data) and below the headers'
    flagged = row[:11] + [1 - row[11] % 2]
    assert _tag(flagged) == _tag(row)  # the flag rides along uncompared
    assert _tag(other) != _tag(row)  # distinct calls share a tag with odds 2**-30


@pytest.mark.parametrize("n", range(2, 9))
def test_every_allreduces_first_round_lands_in_scratch_so_a_refused_call_leaves_the_tensor_unchanged(n):
    from manualdp.schedule import ALGORITHMS
    from manualdp.spmd.transport.plan import overlaps
    from manualdp.spmd.transport.p2p import schedule_of
    for algorithm in ALGORITHMS:
        for numel in (1, 2, 3, n, 7, 100, 1000):
            for rank in range(n):
                for segment in (1, 3, 1000):
                    assert overlaps(plan(schedule_of(algorithm, n), rank, numel, segment)), (algorithm, numel, rank)


def _one_call_ahead(differs: int):
    """Group rank `differs` is one checked call ahead (as after one allreduce more): same size, only the number."""
    from manualdp.spmd.collectives import allreduce
    from manualdp.spmd.transport.group import group_state
    rank = torch.distributed.get_rank()
    allreduce(torch.ones(6), timeout=20)  # the link agreed: "auto" carries its check with the data
    out = {"call": group_state().calls + 1}  # the number of the next call on a rank in step
    for algorithm in ("auto", "ring"):
        if rank == differs:
            group_state().calls += 1
        t = torch.arange(6.0) + rank
        try:
            allreduce(t, algorithm, timeout=20)
            out[algorithm] = None
        except ValueError as e:
            out[algorithm] = str(e)
        out[algorithm + " unchanged"] = t.tolist() == (torch.arange(6.0) + rank).tolist()
        if rank == differs:
            group_state().calls -= 1
    t = torch.ones(3) * (rank + 1)
    allreduce(t, timeout=20)  # back in step: the next call agrees
    out["sum"] = t.tolist()
    return out


@pytest.mark.parametrize("world_size, differs", [(2, 1), (2, 0), (3, 1)])
def test_a_rank_one_call_ahead_with_the_same_size_raises_on_every_rank_naming_the_call_numbers(world_size, differs):
    results = launch(_one_call_ahead, world_size, (differs,), timeout=90)
    first = results[0]["call"]
    for rank, out in enumerate(results):
        for k, algorithm in enumerate(("auto", "ring")):
            error = out[algorithm]
            assert error is not None, (rank, algorithm)  # every rank raised, those in step with each other too
            assert error.startswith(f"rank {rank}: allreduce called differently across ranks: call "), error
            assert "elements" not in error and "dtype" not in error and "algorithm" not in error, error
            numbers = ", ".join(str(first + k + (r == differs)) for r in range(world_size))
            assert f"(per rank: {numbers})" in error, error
            assert out[algorithm + " unchanged"], (rank, algorithm)
        assert out["sum"] == [sum(range(1, world_size + 1))] * 3


def _counted_messages(calls: int):
    """Agreeing checked calls: every message this rank posts, counted, and its plan's count (from three ranks on,
    with the headers' dissemination rounds beside the data)."""
    from manualdp.spmd import collectives
    from manualdp.spmd.collectives import allreduce
    from manualdp.spmd.transport.group import group_state
    from manualdp.spmd.transport.p2p import plan, schedule_of
    state = group_state()
    allreduce(torch.ones(6), timeout=20)  # agree the link first (a check alone, then the calibration)
    pg, counts = state.pg(), {"send": 0, "recv": 0}

    class Counting:  # the process group, every send and receive counted
        def send(self, *a):
            counts["send"] += 1
            return pg.send(*a)

        def recv(self, *a):
            counts["recv"] += 1
            return pg.recv(*a)

    state.pg, collectives.group_state = (lambda: Counting()), (lambda group=None: state)  # the group seen anew
    x = torch.ones(50_000)
    for _ in range(calls):
        allreduce(x, "ring", timeout=20)
    state.pg = lambda: pg
    n = len(state.peers)
    assert x.tolist() == [float(n) ** calls] * x.numel()
    rounds = plan(schedule_of("ring", n), state.rank, x.numel(), (1 << 20) // 4)
    if n > 2:  # the headers: a fixed-size row to every rank, beside the first round (`everyone_hears_everyone`)
        rounds += plan(everyone_hears_everyone(n), state.rank, n, n)
    return counts, {"send": calls * sum(len(r.sends) for r in rounds),
                    "recv": calls * sum(len(r.recvs) for r in rounds)}


def test_at_two_ranks_calls_that_agree_send_nothing_but_their_data():
    for counted, planned in launch(_counted_messages, 2, (10,), timeout=90):
        assert counted == planned


def test_at_three_ranks_calls_that_agree_send_their_data_and_one_header_per_dissemination_round():
    for counted, planned in launch(_counted_messages, 3, (10,), timeout=120):
        assert counted == planned  # two header messages each way per call (ceil(log2 3) rounds), no more


def _slow_peer(calls: int):
    """Rank 1 comes late to most calls (longer than `late.LATE`, made 1 ms here): nothing is refused, sums hold."""
    import time

    from manualdp.spmd.collectives import allreduce
    from manualdp.spmd.transport import late
    from manualdp.spmd.transport.group import group_state
    late.LATE = 0.001
    rank = torch.distributed.get_rank()
    wrong = 0
    for i in range(calls):
        if rank == 1 and i % 3:
            time.sleep(0.005 * (i % 4))
        t = torch.arange(float(10 + i % 7)) * (rank + 1)
        allreduce(t, "ring" if i % 2 else "auto", timeout=30)
        wrong += t.tolist() != (torch.arange(float(10 + i % 7)) * 3).tolist()
    if rank == 1:
        time.sleep(0.02)
    try:  # then a call that differs still raises on both, also with a late peer
        allreduce(torch.ones(4 + rank), "ring", timeout=30)
        refused = None
    except ValueError as e:
        refused = str(e)
    return wrong, group_state().late.late_calls, refused


def test_a_peer_that_is_only_late_is_never_refused_and_a_late_mismatch_still_raises_on_both():
    results = launch(_slow_peer, 2, (40,), timeout=120)
    for rank, (wrong, late_calls, refused) in enumerate(results):
        assert wrong == 0, rank
        assert refused is not None and "elements 4..5 (per rank: 4, 5)" in refused, refused
    assert results[0][1] > 0  # rank 0 waited past LATE and compared through the store, then went on


def _one_long_wait(seconds: float):
    """Rank 1 comes to one call `seconds` late: rank 0's late thread looks at its entry a few times, not every POLL."""
    import time

    from manualdp.spmd.collectives import allreduce
    from manualdp.spmd.transport import late
    from manualdp.spmd.transport.group import group_state
    rank = torch.distributed.get_rank()
    allreduce(torch.ones(3), "ring", timeout=30)  # the group and its watch are made
    if rank == 1:
        time.sleep(seconds)
    t = torch.ones(5) * (rank + 1)
    allreduce(t, "ring", timeout=30)
    watch = group_state().late
    return t.tolist(), watch.late_calls, watch.looks, late.POLL, late.POLL_MOST


def test_a_peer_late_by_long_costs_a_few_looks_at_the_store_not_one_every_poll():
    seconds = 0.8
    (total, late_calls, looks, poll, most), _ = launch(_one_long_wait, 2, (seconds,), timeout=120)
    assert total == [3.0] * 5 and late_calls >= 1
    every_poll = seconds / poll  # looks at a fixed POLL (before: 2 ms apart, ~400 over 0.8 s)
    assert looks <= 10 + seconds / most < every_poll / 5, (looks, every_poll)


def _identities(differs: int):
    from manualdp.spmd.collectives import allreduce, broadcast
    from manualdp.spmd.transport.call_check import check_same_call
    rank = torch.distributed.get_rank()
    mine = 9 if rank == differs else 7
    out = []
    for call in (lambda t: allreduce(t, "ring", identity=mine, timeout=20),
                 lambda t: broadcast(t, identity=mine, timeout=20),
                 lambda t: check_same_call(t, "ring", 1 << 20, None, 20, identity=mine)):  # the check alone
        t = torch.ones(5) * (rank + 1)
        try:
            call(t)
            out.append(None)
        except ValueError as e:
            out.append((str(e), t.tolist() == [rank + 1.0] * 5))
    try:
        allreduce(torch.ones(2), identity=-1)
    except ValueError as e:
        out.append(str(e))
    t = torch.ones(2)
    allreduce(t, identity=3, timeout=20)  # the same identity on every rank: it goes through
    return out, t.tolist()


@pytest.mark.parametrize("world_size, differs", [(2, 0), (3, 2)])
def test_callers_with_another_identity_all_raise_naming_the_wrapper_field(world_size, differs):
    per_rank = ", ".join("9" if r == differs else "7" for r in range(world_size))
    for rank, (out, total) in enumerate(launch(_identities, world_size, (differs,), timeout=90)):
        for error, unchanged in out[:3]:
            assert f"rank {rank}: " in error and f"wrapper 7..9 (per rank: {per_rank})" in error, error
            assert unchanged
        assert "identity" in out[3] and "-1" in out[3]
        assert total == [float(world_size)] * 2


def _without_store():
    """A group whose store torch does not know: two ranks exchange headers instead, and still refuse alike."""
    from manualdp.spmd.collectives import allreduce
    from manualdp.spmd.transport import call_check
    from manualdp.spmd.transport.group import group_state
    call_check.group_store = lambda pg: None
    rank = torch.distributed.get_rank()
    t = torch.ones(3 + rank)
    try:
        allreduce(t, "ring", timeout=20)
        error = None
    except ValueError as e:
        error = str(e)
    t = torch.ones(4)
    allreduce(t, timeout=20)
    return error, group_state().late, t.tolist()


def test_two_ranks_of_a_group_without_a_known_store_exchange_headers_and_still_refuse_alike():
    for rank, (error, late, total) in enumerate(launch(_without_store, 2, (), timeout=60)):
        assert late is False and total == [2.0] * 4
        assert error is not None and "elements 3..4 (per rank: 3, 4)" in error, error


def _closed():
    from manualdp.spmd.collectives import allreduce
    from manualdp.spmd.transport.group import group_state
    allreduce(torch.ones(3), "ring", timeout=20)
    watch = group_state().late
    thread = watch._thread
    watch.close()
    thread.join(timeout=10)
    return thread.is_alive()


def test_a_closed_watch_ends_its_thread():
    assert launch(_closed, 2, (), timeout=60) == [False, False]
