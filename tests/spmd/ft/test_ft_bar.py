"""A member removed from the run whose process does not exit (`bar.py`): barred, its asks refused in one line.

Through the coordinator's store in this process: the guard of a member that removes another bars
that process; the others' quorum leaves it out without waiting for it; the barred process, asking
again, is told in one line; the same id started again (a new process: a new heartbeat nonce) is let in.
"""
import concurrent.futures
import time

import pytest
import torch

from manualdp.spmd.ft import Quorum
from manualdp.spmd.ft.average import average_and_vote
from manualdp.spmd.ft.bar import bar, barred
from manualdp.spmd.ft.guard import STRIKES, ContributionGuard, Removed
from manualdp.spmd.ft.heartbeat import Heartbeat, Liveness
from manualdp.spmd.ft.quorum import wait_for_quorum
from tests.spmd.ft.harness import member
from tests.spmd.ft.test_ft_quorum import registered_with_heartbeat


class Judge:
    """Member `a` of a quorum {a, b, c} whose member c contributes 1000 times the others' norm, on a real store."""

    def __init__(self, store) -> None:
        self.id, self.step, self.capacity, self.store = "a", 0, 0, store
        self.quorum = Quorum(1, tuple(member(r) for r in "abc"), 1)
        self.guard = ContributionGuard()

    def average(self, flat: torch.Tensor) -> bool:
        if flat.numel() == 3:
            flat[1], flat[2] = 3.0, 3000.0
        flat.div_(3)
        return True

    def should_commit(self, ok: bool) -> bool:
        return ok


def ask(connect, rid, quorum_timeout=20.0):
    s = connect()
    return wait_for_quorum(s, member(rid), Liveness(s, 2.0), 0, quorum_timeout, 20.0, time.monotonic())


def test_a_removed_member_that_does_not_exit_is_barred_and_a_new_process_of_its_id_is_let_in(store):
    beats = registered_with_heartbeat(store, "abc")
    try:
        judge = Judge(store())
        for _ in range(STRIKES):  # a's guard sees c out of line STRIKES steps in a row: c is removed, and barred
            assert not average_and_vote(judge, [torch.ones(9)])
        assert barred(store(), "abc") == {"c": f"its contribution was out of line {STRIKES} steps in a row"}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            started = time.monotonic()
            asked = {rid: pool.submit(ask, store, rid) for rid in "abc"}  # c's process goes on: it asks again
            with pytest.raises(Removed) as info:
                asked["c"].result(timeout=60)
            quorums = [asked[rid].result(timeout=60) for rid in "ab"]
        took = time.monotonic() - started
        line = str(info.value)
        assert "\n" not in line and line.startswith("replica 'c' was removed from the run (its contribution") and \
            "its asks are refused" in line, line
        assert quorums[0] == quorums[1] and quorums[0].ids == ["a", "b"]
        assert took < 20.0, took  # c, alive but barred, was not waited for (quorum_timeout 20 s)
        beats[2].stop()
        beats[2] = registered_with_heartbeat(store, "c")[0]  # c started again: a new process, a new nonce
        assert barred(store(), "abc") == {}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            again = list(pool.map(lambda rid: ask(store, rid), "abc"))
        assert again[0] == again[2] and again[0].ids == ["a", "b", "c"]
    finally:
        for b in beats:
            b.stop(leave=True)


def test_a_bar_on_an_id_without_a_heartbeat_writes_nothing(store):
    s = store()
    bar(s, "nobody", "why")
    assert not s.check(["barred"]) and barred(s, ["nobody"]) == {}


def test_an_ask_left_by_an_earlier_process_of_an_id_is_not_taken_for_the_same_id_started_again(store):
    beats = registered_with_heartbeat(store, "ac")
    try:
        bar(store(), "c", "a test")
        with pytest.raises(Removed):  # c's barred process appends its ask to round 1, then is refused
            ask(store, "c")
        beats[1].stop()
        beats[1] = registered_with_heartbeat(store, "c")[0]  # c started again: it has not asked yet
        s = store()
        quorum = wait_for_quorum(s, member("a"), Liveness(s, 2.0), 0, 0.0, 20.0, time.monotonic())
        assert quorum.ids == ["a"], quorum  # a quorum_timeout of 0: the askers now, and the old c's ask is not c's
    finally:
        for b in beats:
            b.stop(leave=True)


class SlowStore:
    """A store whose `set` takes longer than a heartbeat's interval and records each value as it lands."""

    def __init__(self) -> None:
        self.started, self.landed = 0, []

    def clone(self):
        return self

    def check(self, keys) -> bool:
        return False

    def set(self, key, value) -> None:
        self.started += 1
        time.sleep(1.5)  # longer than stop() used to wait for the beat thread (2 intervals + 1 s)
        self.landed.append(value)


def test_no_beat_lands_after_stop_returns_so_the_same_id_started_again_is_never_shadowed():
    slow = SlowStore()
    beat = Heartbeat(slow, "c", 0.01)
    deadline = time.monotonic() + 60
    while slow.started < 2 and time.monotonic() < deadline:  # its second beat is in flight
        time.sleep(0.01)
    beat.stop()
    after_stop = list(slow.landed)
    beat._thread.join()
    assert len(after_stop) == 2 and slow.landed == after_stop, (after_stop, slow.landed)
