"""A replica group lost as a lane forms, after its roll call (soak: 4 rank processes, `lane_loss_worker.py`).

Groups A and B of 2 ranks meet; B's ranks answer the roll call of their lanes and are lost in gloo's rendezvous
of the lane once they published their address: killed (SIGKILL) or leaving on purpose (SIGTERM). Adversary 51's
L1 and L3: A's ranks waited there (gloo connecting for minutes) while their group-mates waited on them inside
the group until its gloo timeout, and the whole job was lost. Now A's ranks say it in one line, discard the step,
drop B from the quorum and train on to the end, equal to the one-process reference of the steps' members.
"""
import time

import pytest

from manualdp.spmd.ft import keys
from manualdp.spmd.ft.coordinator import connect
from tests.spmd.ft.test_ft_group_train import Groups, check_against_reference, log, records, wait

STEPS = 4


class LaneLossGroups(Groups):
    """`Groups` whose ranks run `lane_loss_worker.py` (a group lost after a roll call, by its config)."""

    worker = "tests.spmd.ft.lane_loss_worker"


@pytest.fixture
def groups(tmp_path):
    g = LaneLossGroups(tmp_path)
    yield g
    g.close()


def wait_until_heartbeating(port: int, group: str, ranks) -> None:
    """Wait (generously) until `group`'s leader heartbeats: a group started after it meets it in its first quorum."""
    store, deadline = connect("127.0.0.1", port, 30), time.monotonic() + 120
    while not store.check([keys.heartbeat(group)]):
        assert time.monotonic() < deadline and all(p.poll() is None for p, _ in ranks), [log(o) for _, o in ranks]
        time.sleep(0.1)


@pytest.mark.soak
@pytest.mark.parametrize("how, code", [("kill", -9), ("term", -15)])
def test_a_group_lost_right_after_the_lane_roll_call_leaves_the_other_training_to_the_end(groups, how, code):
    b = groups.start("B", 2, steps=STEPS, min_groups=2, lost_in_lane=how)  # waits for a second group
    wait_until_heartbeating(groups.coordinator.port, "B", b)
    a = groups.start("A", 2, steps=STEPS, min_groups=1)  # its first quorum holds B, which is lost as lanes form
    codes = wait(a + b, timeout=200)
    logs = [log(out)[-3000:] for _, out in a + b]
    assert codes == [0, 0, code, code], logs
    assert all(not records(out) for _, out in b), logs  # B never committed a step
    runs = [records(out) for _, out in a]
    assert all(sorted(run) == list(range(STEPS)) for run in runs), logs
    members = check_against_reference(runs, STEPS)
    assert members == [["A"]] * STEPS, members
    said = "replica group 'A', rank 0: lane 'A/lane/0' of quorum group 1: replica group(s) B lost during the lane's " \
        "rendezvous (heartbeat stopped); the step is asked again"
    assert said in log(a[0][1]), logs[0]  # in one line, at once: not at a gloo timeout
