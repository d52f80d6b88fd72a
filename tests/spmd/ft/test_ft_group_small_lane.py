"""A lane's formation (`group_lanes.Lane.form`) gives up when a member group is gone, not at gloo's rendezvous timeout.

Lanes of groups of one rank, in threads of this process, over an in-process coordinator (a few seconds). The
lanes' deadline (60 s) is far beyond the heartbeat timeout (0.5 s): a lane that waited gloo's rendezvous would
end with gloo's timeout, not with the liveness's 'gone' reason.
"""
import threading

import pytest
import torch

from manualdp.spmd.ft.group_lanes import Lane, LaneLost
from manualdp.spmd.ft.heartbeat import Heartbeat, register

DEADLINE = 60.0  # the lane's timeout: the test ends long before it unless the wait ignores the liveness
BEAT = 0.5       # the heartbeat timeout


def _form(lane, *args):
    """Form `lane` in a thread; what it raised (None: it formed). The thread is joined with a generous bound."""
    errors = []

    def run():
        try:
            lane.form(*args)
        except Exception as e:  # noqa: BLE001 -- the test asserts which
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(3 * DEADLINE)
    assert not thread.is_alive(), "the lane's formation hangs"
    return errors[0] if errors else None


def test_a_member_group_whose_heartbeat_stopped_ends_the_formation_naming_it(store):
    s = store()
    register(s, "B")  # B registered and never beats again: gone after BEAT s
    lane = Lane(s, "A", 0, DEADLINE, heartbeat_timeout=BEAT)
    error = _form(lane, 1, 0, 2, ["A", "B"])
    assert isinstance(error, LaneLost), error
    assert "B" in str(error) and "heartbeat stopped" in str(error) and "\n" not in str(error)
    assert lane.number is None  # no lane held: the step is asked again


def test_a_member_group_that_left_ends_the_formation(store):
    s = store()
    register(s, "B")
    beat = Heartbeat(s, "B", 0.05)
    beat.stop(leave=True)  # B closed on purpose (-1)
    error = _form(Lane(s, "A", 0, DEADLINE, heartbeat_timeout=BEAT), 1, 0, 2, ["A", "B"])
    assert isinstance(error, LaneLost) and "B" in str(error), error


def test_live_members_form_the_lane_and_sum_over_it(store):
    register(store(), "B")
    beat = Heartbeat(store(), "B", 0.05)  # B's group is alive while A waits for it to come
    register(store(), "A")
    beat_a = Heartbeat(store(), "A", 0.05)  # and A's while B waits for it in gloo's rendezvous (a live group beats)
    try:
        lanes = [Lane(store(), group, 0, DEADLINE, heartbeat_timeout=BEAT) for group in "AB"]
        tensors = [torch.ones(3), torch.full((3,), 2.0)]
        errors = [None, None]

        def member(i):
            try:
                lanes[i].form(1, i, 2, ["A", "B"])
                lanes[i].sum(tensors[i], ["A", "B"])
            except Exception as e:  # noqa: BLE001 -- the test asserts none
                errors[i] = e

        threads = [threading.Thread(target=member, args=(i,), daemon=True) for i in range(2)]
        threads[0].start()
        threads[0].join(3 * BEAT)  # A waits alone for longer than a heartbeat timeout: B is alive, so A waits on
        threads[1].start()
        for t in threads:
            t.join(3 * DEADLINE)
        assert not any(t.is_alive() for t in threads), "a lane's formation hangs"
        assert errors == [None, None]
        assert all(torch.equal(t, torch.full((3,), 3.0)) for t in tensors)
    finally:
        beat.stop()
        beat_a.stop()


@pytest.mark.parametrize("members", [None, ["A", "B"]])
def test_without_a_heartbeat_timeout_or_members_the_lane_forms_as_before(store, members):
    lanes = [Lane(store(), group, 0, 10) for group in "AB"]
    errors = [None, None]

    def member(i):
        try:
            lanes[i].form(1, i, 2, members)
        except Exception as e:  # noqa: BLE001 -- the test asserts none
            errors[i] = e

    threads = [threading.Thread(target=member, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [None, None] and [lane.number for lane in lanes] == [1, 1]
