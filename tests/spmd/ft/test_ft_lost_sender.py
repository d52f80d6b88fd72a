"""A sender of recovery state lost during recovery (`recovery.receive_state`'s `gone`): named at once, in one line.

Through the coordinator's store in this process: the sender registered and beat, then stopped
(SIGKILL stops its heartbeat as this does); the receiver, a rank's lane or a one-process
replica's receive, raises a `RecoveryError` naming the lost sender within a few heartbeat timeouts,
not after its whole `timeout`, so that it asks again for another holder (`phases.py`, `group.py`).
The replica-group process test: `test_ft_group_lost_sender.py` (soak).
"""
import time

import pytest

from manualdp.spmd.ft.group_lanes import Lane
from manualdp.spmd.ft.heartbeat import Liveness
from manualdp.spmd.ft.recovery import RecoveryError, receive_state
from tests.spmd.ft.test_ft_quorum import registered_with_heartbeat


def lost(store, rid):
    """`rid` registered, beat a while, then died (its heartbeat stopped without a leave)."""
    beat = registered_with_heartbeat(store, [rid])[0]
    time.sleep(0.2)
    beat.stop()


def test_a_lanes_sender_group_lost_is_named_at_once_on_the_receiving_rank(store):
    lost(store, "A")
    lane = Lane(store(), "C", 1, timeout=60, heartbeat_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(RecoveryError) as info:
        lane.receive(4, "A", lambda state: None)
    took = time.monotonic() - started
    line = str(info.value)
    assert "\n" not in line and line.startswith("replica group 'A' (rank 1) was lost while sending its state (round 4)")
    assert "another holder" in line and took < 10, (took, line)


def test_a_replicas_sender_lost_is_named_at_once(store):
    lost(store, "a")
    s = store()
    live = Liveness(s, 0.5)
    started = time.monotonic()
    with pytest.raises(RecoveryError, match=r"^replica 'a' was lost while sending its state \(round 2\)"):
        receive_state(s, 2, "a", 60, gone=lambda: "a" not in live.live(["a"]))
    assert time.monotonic() - started < 10


def test_a_live_sender_is_waited_for_up_to_the_timeout(store):
    beats = registered_with_heartbeat(store, ["b"])
    try:
        s = store()
        live = Liveness(s, 0.5)
        with pytest.raises(RecoveryError, match=r"the state of replica 'b' \(round 3\) did not come within 1 s"):
            receive_state(s, 3, "b", 1.0, gone=lambda: "b" not in live.live(["b"]))
    finally:
        beats[0].stop(leave=True)
