"""The issue's check, by the commands: replicas and a coordinator, one replica killed (SIGKILL) and started again.

    python -m pytest -q -m soak tests/spmd/ft/test_ft_cli_rejoin.py      (about 30 s; bench/soak_tests.sh runs it)
"""
import os
import signal

import pytest

from tests.spmd.ft.cli_harness import check_against_reference, committed, reference, run

pytestmark = pytest.mark.soak  # replica processes started by the command line

EPOCHS = 3  # 24 steps


def test_a_killed_replica_started_again_by_the_same_command_rejoins_and_all_end_as_one_process(tmp_path):
    with run(tmp_path, epochs=EPOCHS) as r:
        for rid in "abc":
            r.start(rid)
        r.wait("3 steps committed by a, b and c", lambda: r.committed_with(["a", "b", "c"]) >= 3)
        r.replicas["c"][0].send_signal(signal.SIGKILL)
        r.wait("a step committed by a and b alone", lambda: r.committed_with(["a", "b"]) >= 1)
        # Hold the survivors (a partition of their own) while c starts, so that it comes back before they end.
        for p in (r.replicas["a"][0], r.replicas["b"][0]):
            os.kill(p.pid, signal.SIGSTOP)
        r.start("c")
        try:
            r.wait("c registered again", lambda: r.registrations() == 4)
        finally:
            for p in (r.replicas["a"][0], r.replicas["b"][0]):
                os.kill(p.pid, signal.SIGCONT)
        results = r.finish()
        ref = reference(tmp_path, EPOCHS)
    assert r.replicas["c"][0].returncode == -signal.SIGKILL
    steps = committed(results)
    assert sorted(steps) == list(range(8 * EPOCHS))  # every batch committed once, by the same members everywhere
    alone = [s for s, m in steps.items() if m == ["a", "b"]]
    assert alone and steps[0] == ["a", "b", "c"] and steps[8 * EPOCHS - 1] == ["a", "b", "c"]
    for rid in "ab":  # the kill cost the survivors at most the step it interrupted (and the stop none)
        assert sum(not x["committed"] for x in results[rid]["config"]["fault_tolerant"]["steps"]) <= 1
    c = results["c"]["config"]["fault_tolerant"]
    assert c["steps"][0]["step"] > max(alone)  # the new c trained from where the others were
    assert c["recoveries"] and c["recoveries"][0]["step"] == c["steps"][0]["step"]
    assert c["recoveries"][0]["source"] in ("a", "b") and len(c["recoveries"][0]["sha256"]) == 64
    check_against_reference(results, ref)


def test_two_replicas_one_killed_and_started_again_end_as_one_process(tmp_path):
    """min 2: b killed after 2 steps, a waits for a second replica; b started again rejoins with a's state."""
    with run(tmp_path, epochs=1, min_replicas=2, timeout=10) as r:
        r.start("a")
        b = r.start("b")
        r.kill_while_held([b], [r.replicas["a"][0]], "2 steps committed by a and b",
                          lambda: r.committed_with(["a", "b"]) >= 2)
        r.start("b")
        results = r.finish()
        assert r.coordinator.poll() is None  # the coordinator serves until stopped
        r.close()
        assert r.coordinator.returncode == 0  # SIGTERM ends it cleanly
        assert "coordinator stopped" in (tmp_path / "coordinator.log").read_text()
    steps = committed(results)
    assert sorted(steps) == list(range(8)) and all(m == ["a", "b"] for m in steps.values())  # a never went alone
    a_ft, b_ft = (results[x]["config"]["fault_tolerant"] for x in "ab")
    assert sum(not x["committed"] for x in a_ft["steps"]) <= 1  # the kill cost a at most the step it interrupted
    assert b_ft["recoveries"][0]["source"] == "a" and b_ft["recoveries"][0]["step"] == b_ft["steps"][0]["step"] >= 2
    assert len(results["a"]["train_loss"]) == len(results["b"]["train_loss"]) == 1  # b received a's history too
    check_against_reference(results, reference(tmp_path, 1))


def test_diloco_by_the_commands_a_replica_killed_and_started_again_rejoins_at_a_block_with_the_outer_state(tmp_path):
    """--diloco 3, min 2, 2 epochs of 8 batches (blocks of 3, 3, 2 each): b killed after 2 blocks, started again."""
    with run(tmp_path, epochs=2, min_replicas=2, timeout=10) as r:
        r.options += ["--diloco", "3"]
        r.start("a")
        b = r.start("b")
        r.kill_while_held([b], [r.replicas["a"][0]], "2 blocks committed by a and b",
                          lambda: r.committed_with(["a", "b"]) >= 2)
        r.start("b")
        results = r.finish()
    blocks = committed(results)
    assert sorted(blocks) == list(range(6)) and all(m == ["a", "b"] for m in blocks.values())
    a_ft, b_ft = (results[x]["config"]["fault_tolerant"] for x in "ab")
    assert a_ft["sync"] == "diloco" and a_ft["sync_every"] == 3
    assert [x["local_steps"] for x in a_ft["steps"] if x["committed"]] == [3, 3, 2, 3, 3, 2]
    assert sum(not x["committed"] for x in a_ft["steps"]) <= 1  # the kill cost a at most the block it interrupted
    assert b_ft["recoveries"][0]["source"] == "a" and b_ft["recoveries"][0]["step"] == b_ft["steps"][0]["step"] >= 2
    assert a_ft["parameters_sha256"] == b_ft["parameters_sha256"]  # the outer momentum came with the state
    assert results["a"]["train_loss"] == results["b"]["train_loss"] and results["a"]["test_acc"] == \
        results["b"]["test_acc"]
    assert len(results["a"]["test_acc"]) == 2 and results["a"]["test_acc"][-1] > 0.5
