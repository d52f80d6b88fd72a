"""The quorum asked ahead (`Manager(async_quorum=True)`, `ahead.py`): the fast path, a changed quorum, a failure."""
import threading
import time

import pytest
import torch

from manualdp.spmd.ft import Coordinator, Manager, RunFinished
from manualdp.spmd.ft.ahead import fast
from manualdp.spmd.ft.coordinator import connect
from manualdp.spmd.ft.durable import mark_finished
from manualdp.spmd.ft.heartbeat import Heartbeat, Liveness, register
from manualdp.spmd.ft.quorum import Member, Quorum, wait_for_quorum
from manualdp.spmd.ft.recovery import receive_state


def member(rid, step=3, synced=True, group=(5, 2)):
    return Member(rid, step, synced, group, 0)


def test_fast_only_when_agreed_nobody_behind_and_all_in_the_group_held():
    both = (member("a"), member("b"))
    assert fast(Quorum(6, both, 5), (5, 2))
    assert not fast(Quorum(6, both, 6), (5, 2))  # a new group
    assert not fast(Quorum(6, both, 5), None)  # this replica holds none
    assert not fast(Quorum(6, both, 5, agreed=False), (5, 2))  # provisional
    assert not fast(Quorum(6, (member("a"), member("b", step=2)), 5), (5, 2))  # b is behind
    assert not fast(Quorum(6, (member("a"), member("b", synced=False)), 5), (5, 2))


def test_async_quorum_must_be_a_bool():
    with pytest.raises(TypeError, match="async_quorum must be True or False, got 'yes'"):
        Manager("a", "127.0.0.1", 1, async_quorum="yes")


def test_asked_ahead_start_step_returns_at_once_and_the_step_commits_in_the_new_quorum():
    with Coordinator(0) as c, Manager("a", "127.0.0.1", c.port, timeout=10, async_quorum=True) as manager:
        first = manager.start_step()  # no group yet: asked as without async_quorum
        t = torch.ones(3)
        assert manager.average(t) and manager.should_commit(True) and manager.step == 1
        for step in (2, 3):
            assert manager.start_step() is first or step == 3  # the last quorum, returned before this one is decided
            assert manager.average(t) and torch.equal(t, torch.ones(3))
            assert manager.quorum.round == first.round + step - 1 and manager.quorum.group == first.group
            assert manager.should_commit(True) and manager.step == step
        with pytest.raises(RuntimeError, match="should_commit\\(\\) without a step under way"):
            manager.should_commit(True)


def test_a_quorum_that_changed_is_entered_as_start_step_does_and_the_step_is_discarded():
    with Coordinator(0) as c, Manager("a", "127.0.0.1", c.port, timeout=2, quorum_timeout=5,
                                      async_quorum=True) as manager:
        manager.start_step()
        t = torch.ones(3)
        assert manager.average(t) and manager.should_commit(True)
        store = connect("127.0.0.1", c.port, 10)
        register(store, "b")
        beat, seen = Heartbeat(store, "b", 0.05), {}

        def b_asks() -> None:  # a newcomer: it asks, and receives a's state, but never joins the group
            quorum = wait_for_quorum(store, Member("b", 0, False, None, 0), Liveness(store, 2.0), 0, 5.0, 10.0,
                                     time.monotonic())
            seen["quorum"], seen["state"] = quorum, receive_state(store, quorum.round, "a", 10.0)[0]

        try:
            manager.start_step()  # asked ahead: a waits for b, live, to ask
            thread = threading.Thread(target=b_asks)
            thread.start()
            assert not manager.average(t)  # a entered the new quorum: state sent, group formed (b never came)
            thread.join(30)
            assert not manager.should_commit(True) and manager.step == 1
            assert manager.quorum.ids == ["a", "b"] and seen["quorum"] == manager.quorum
            assert seen["state"] == {"step": 1}
            assert manager.last_error is not None
        finally:
            beat.stop(leave=True)


def test_a_failure_of_the_ask_is_raised_by_the_call_that_takes_it():
    with Coordinator(0) as c, Manager("a", "127.0.0.1", c.port, timeout=10, async_quorum=True) as manager:
        manager.start_step()
        assert manager.average(torch.ones(3)) and manager.should_commit(True)
        mark_finished(connect("127.0.0.1", c.port, 10), 1)
        manager.start_step()  # returns at once: the thread finds the run finished
        with pytest.raises(RunFinished, match="the run ended at step 1"):
            manager.average(torch.ones(3))
        manager.start_step()  # the step did not begin: it may be asked again, and is told the same
        with pytest.raises(RunFinished):
            manager.should_commit(True)
