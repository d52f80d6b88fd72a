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
from manualdp.spmd.ft.heartbeat import Liveness
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
