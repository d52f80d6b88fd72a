"""The fault-tolerant room's decisions, in one process: who is in a quorum, commit or discard, who recovers from whom.

The pure functions first, then the same decisions taken through a real store by threads that
stand for replicas (no process group is formed here).
"""
import concurrent.futures
import threading
import time

import pytest
import torch

from manualdp.spmd.ft import Quorum, RecoveryError, plan_recovery
from manualdp.spmd.ft.commit import commit_or_discard, outcome_of
from manualdp.spmd.ft.heartbeat import Heartbeat, Liveness, register
from manualdp.spmd.ft.quorum import decide, group_for, wait_for_quorum
from manualdp.spmd.ft.recovery import receive_state, send_state
from tests.spmd.ft.harness import member


# ---------------------------------------------------------------- pure functions

def test_decide_waits_for_every_live_replica_then_for_none_past_the_deadline():
    asks = {"a": member("a"), "b": member("b")}
    assert decide(asks, {"a", "b", "c"}, waited_enough=False) is None  # c is alive and has not asked
    assert [m.id for m in decide(asks, {"a", "b", "c"}, waited_enough=True)] == ["a", "b"]
    assert [m.id for m in decide(asks, {"a", "b"}, waited_enough=False)] == ["a", "b"]  # c is dead: no wait
    assert [m.id for m in decide(asks, {"b"}, waited_enough=False)] == ["b"]  # an asker since dead is left out


def test_decide_below_the_largest_min_replicas_waits():
    asks = {"a": member("a", min_replicas=1), "b": member("b", min_replicas=3)}
    assert decide(asks, {"a", "b"}, waited_enough=True) is None
    asks["c"] = member("c")
    assert len(decide(asks, {"a", "b", "c"}, waited_enough=False)) == 3


def test_a_group_is_reused_only_by_all_of_its_members_and_no_one_else():
    assert group_for([member("a", group=(4, 2)), member("b", group=(4, 2))], 9) == 4
    assert group_for([member("a", group=(4, 3)), member("b", group=(4, 3))], 9) == 9  # one of the 3 is gone
    assert group_for([member("a", group=(4, 2)), member("b", group=(4, 2)), member("c")], 9) == 9  # a joiner
    assert group_for([member("a", group=(4, 2)), member("b", group=None)], 9) == 9  # b's step failed


def test_plan_recovery():
    first = Quorum(1, (member("b", synced=False), member("a", synced=False), member("c", synced=False)), 1)
    assert plan_recovery(first) == {"a": "b", "c": "b"}  # nobody is synced: the first at the top step is the source
    later = Quorum(7, (member("a", 5), member("b", 5), member("c", 2), member("d", 0, synced=False)), 7)
    assert plan_recovery(later) == {"c": "a", "d": "b"}  # the behind and the new, from the members at step 5 in turn
    fresh_beside_synced = Quorum(2, (member("a", 0), member("b", 0, synced=False)), 2)
    assert plan_recovery(fresh_beside_synced) == {"b": "a"}
    assert plan_recovery(Quorum(3, (member("a", 4), member("b", 4)), 3)) == {}


def test_outcome_of():
    assert outcome_of({"a": True, "b": True}, {"a", "b"}, False) == "commit"
    assert outcome_of({"a": True, "b": False}, {"a", "b"}, False) == "discard"
    assert outcome_of({"a": True, "b": None}, {"a", "b"}, False) is None  # b is alive: wait for its vote
    assert outcome_of({"a": True, "b": None}, {"a"}, False) == "discard"  # b stopped beating
    assert outcome_of({"a": True, "b": None}, {"a", "b"}, True) == "discard"  # past the deadline
    assert outcome_of({"a": False, "b": None}, {"a", "b"}, False) == "discard"  # no need to wait


# ---------------------------------------------------------------- through a store

def ask(connect_, rid, after=0, quorum_timeout=5.0, timeout=10.0, min_replicas=1, heartbeat_timeout=1.0, took=None):
    """`rid`'s quorum; `took` (a list), if given, gets the seconds it waited (the connection not counted)."""
    s = connect_()
    start = time.monotonic()
    try:
        return wait_for_quorum(s, member(rid, min_replicas=min_replicas), Liveness(s, heartbeat_timeout), after,
                               quorum_timeout, timeout, start)
    finally:
        if took is not None:
            took.append(time.monotonic() - start)


def registered_with_heartbeat(connect_, ids):
    beats = []
    for rid in ids:
        register(connect_(), rid)
        beats.append(Heartbeat(connect_(), rid, 0.05))
    return beats


def test_replicas_asking_at_once_all_get_the_same_quorum(store):
    beats = registered_with_heartbeat(store, "abc")
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            quorums = list(pool.map(lambda rid: ask(store, rid), "abc"))
    finally:
        for b in beats:
            b.stop(leave=True)
    assert quorums[0] == quorums[1] == quorums[2] and quorums[0].ids == ["a", "b", "c"]


def test_a_live_replica_that_does_not_ask_is_left_out_after_the_deadline(store):
    beats = registered_with_heartbeat(store, "ab")  # b beats but never asks
    try:
        took = []
        quorum = ask(store, "a", quorum_timeout=1.0, took=took)
    finally:
        for b in beats:
            b.stop(leave=True)
    assert quorum.ids == ["a"] and 1.0 <= took[0] < 3, took


def test_a_replica_that_stops_beating_is_not_waited_for(store):
    register(store(), "a")
    beat_a = Heartbeat(store(), "a", 0.05)
    register(store(), "b")  # b registered, never beats: dead after heartbeat_timeout (0.5 s), not quorum_timeout
    try:
        took = []
        quorum = ask(store, "a", quorum_timeout=30.0, heartbeat_timeout=0.5, took=took)
    finally:
        beat_a.stop(leave=True)
    assert quorum.ids == ["a"] and 0.5 <= took[0] < 3, took


def test_below_min_replicas_it_waits_then_raises_naming_the_numbers(store):
    beats = registered_with_heartbeat(store, "a")
    try:
        took = []
        with pytest.raises(TimeoutError, match=r"replica 'a': no quorum of at least 2 replicas within 1\.5 s "
                                               r"\(round 1: asked \['a'\], alive \['a'\]\)"):
            ask(store, "a", timeout=1.5, min_replicas=2, took=took)
        assert 1.5 <= took[0] < 3
    finally:
        beats[0].stop(leave=True)


def test_below_min_replicas_it_waits_and_goes_on_when_one_comes(store):
    beats = registered_with_heartbeat(store, "a")
    late = []
    timer = threading.Timer(1.0, lambda: late.append(registered_with_heartbeat(store, "b")))
    timer.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            b = pool.submit(lambda: (time.sleep(1.2), ask(store, "b", min_replicas=2))[1])
            took = []
            quorum = ask(store, "a", min_replicas=2, took=took)
            assert b.result(timeout=20) == quorum
    finally:
        timer.join()
        for beat in beats + sum(late, []):
            beat.stop(leave=True)
    assert quorum.ids == ["a", "b"] and took[0] >= 1.0


def test_a_replica_that_asks_after_the_quorum_is_decided_is_in_the_next_round(store):
    beats = registered_with_heartbeat(store, "ab")
    try:
        first = ask(store, "a", quorum_timeout=0.3)  # b beats but does not ask: round 1 is a's alone
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            late_b = pool.submit(ask, store, "b")  # asks in round 1 (it knows no other), then in round 2
            next_a = pool.submit(ask, store, "a", first.round)
            assert late_b.result(timeout=10) == next_a.result(timeout=10)
    finally:
        for b in beats:
            b.stop(leave=True)
    assert first.ids == ["a"] and next_a.result().ids == ["a", "b"] and next_a.result().round == 2


def vote_all(connect_, quorum, votes: dict, timeout=10.0):
    def one(rid):
        s = connect_()
        return commit_or_discard(s, quorum, rid, votes[rid], Liveness(s, 1.0), timeout)
    with concurrent.futures.ThreadPoolExecutor(len(votes)) as pool:
        return list(pool.map(one, votes))


@pytest.mark.parametrize("votes, expected", [({"a": True, "b": True, "c": True}, True),
                                             ({"a": True, "b": False, "c": True}, False),
                                             ({"a": False, "b": False, "c": False}, False)])
def test_every_member_applies_the_same_outcome(store, votes, expected):
    beats = registered_with_heartbeat(store, "abc")
    try:
        quorum = Quorum(1, tuple(member(r) for r in "abc"), 1)
        assert vote_all(store, quorum, votes) == [expected] * 3
    finally:
        for b in beats:
            b.stop(leave=True)


def test_a_member_that_dies_before_voting_makes_the_others_discard_before_the_deadline(store):
    beats = registered_with_heartbeat(store, "abc")
    beats[2].stop()  # c stops beating and never votes
    try:
        quorum = Quorum(1, tuple(member(r) for r in "abc"), 1)
        start = time.monotonic()
        assert vote_all(store, quorum, {"a": True, "b": True}, timeout=30) == [False, False]
        assert time.monotonic() - start < 10
    finally:
        for b in beats[:2]:
            b.stop(leave=True)


def test_the_state_comes_whole_or_not_at_all(store):
    s = store()
    state = {"step": 3, "model": {"w": torch.arange(5.0)}, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]}}
    digest = send_state(s, 4, "a", state)
    got, seen = receive_state(s, 4, "a", 5)
    assert seen == digest and got["step"] == 3 and torch.equal(got["model"]["w"], torch.arange(5.0))
    blob = bytearray(s.get("state/4/a"))
    blob[len(blob) // 2] ^= 0xFF  # one byte damaged on the way
    s.set("state/4/a", bytes(blob))
    with pytest.raises(RecoveryError, match=r"the state of replica 'a' \(round 4\) arrived damaged"):
        receive_state(s, 4, "a", 5)
    with pytest.raises(RecoveryError, match=r"the state of replica 'b' \(round 4\) did not come within 0\.3 s"):
        receive_state(s, 4, "b", 0.3)
