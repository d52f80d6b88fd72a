"""The faults of issue 33 that the first tests left out: kill -9 in a recovery (of the joiner, of the source), two
failures in one step, and a partition (a replica stopped in its allreduce, its connections held open).

Each ends well: nothing waits past its deadline (every wait here is bounded), every committed step was taken by
the same members with bitwise the same parameters on each, and the survivors end equal to the one-process run
of the steps' members (no state lost). bench/faults.py shows each as a row of "ft replicas".
"""
import os
import signal

import pytest
import torch

from tests.spmd.ft.harness import agreed_steps, reference_ddp, replicas

pytestmark = pytest.mark.soak  # replica processes: a few minutes

STEPS, AT, PAUSE = 7, 2, 3


def test_a_joiner_killed_in_its_recovery_costs_the_others_one_round_and_rejoins_when_started_again(tmp_path):
    # a and b pause at step PAUSE for c to join, which dies having received the state, before loading it; a and b
    # lose that round (no step), go on without c, and pause again at PAUSE + 1 for c started again
    with replicas(tmp_path) as run:
        for i, rid in enumerate("ab"):
            run.start(id=rid, index=i, steps=STEPS, pause_after=[PAUSE, PAUSE + 1], timeout=4)
        run.wait("a committed step PAUSE", lambda: any(r["step"] == PAUSE for r in run.records("a")))
        joiner = run.start(id="c", index=2, steps=STEPS, fault="kill_receive", timeout=4)
        run.wait("c registered", lambda: run.registrations() == 3)
        run.wait("c asked for its first quorum", lambda: run.asking("c"))  # registered is not yet asked
        run.set("go", "1")
        run.wait("c killed in its recovery", lambda: joiner.poll() is not None)
        assert joiner.returncode == -9, run.logs()
        run.wait("a committed step PAUSE + 1", lambda: any(r["step"] == PAUSE + 1 for r in run.records("a")))
        run.start(id="c", index=2, steps=STEPS, timeout=4)  # the same command again
        run.wait("c registered again", lambda: run.registrations() == 4)
        run.wait("c asked again", lambda: run.asking("c"))
        run.set("go1", "1")
        results = run.finish()
    a, b, c = results["a"][0], results["b"][0], results["c"][1]
    assert results["c"][0]["records"] == []  # the killed joiner took no step
    assert all(r["committed"] for r in a["records"] + b["records"])  # the failed round was no step
    steps = agreed_steps(results, STEPS)
    assert [steps[s]["members"] for s in range(STEPS)] == [["a", "b"]] * (PAUSE + 1) + \
        [["a", "b", "c"]] * (STEPS - PAUSE - 1)
    assert len(c["recoveries"]) == 1 and c["recoveries"][0]["source"] in ("a", "b")
    assert c["recoveries"][0]["step"] == PAUSE + 1 and c["records"][0]["batch"] == PAUSE + 1
    assert a["sha256"] == b["sha256"] == c["sha256"]
    expected = reference_ddp(steps, seed=0, config={})
    torch.testing.assert_close(torch.tensor(c["final"], dtype=torch.float64), expected, rtol=0, atol=1e-12)


def test_a_source_killed_while_sending_the_state_leaves_the_joiner_to_receive_it_from_another(tmp_path):
    # a and b at step PAUSE; c joins and is planned to receive from a (the first source by id), which dies having
    # written the state's bytes but not their checksum: c must not load them, and receives b's state next round
    with replicas(tmp_path) as run:
        run.start(id="a", index=0, steps=STEPS, pause_after=PAUSE, timeout=4, fault="kill_send", at=PAUSE)
        run.start(id="b", index=1, steps=STEPS, pause_after=PAUSE, timeout=4)
        run.wait("a committed step PAUSE", lambda: any(r["step"] == PAUSE for r in run.records("a")))
        run.start(id="c", index=2, steps=STEPS, timeout=4)
        run.wait("c registered", lambda: run.registrations() == 3)
        run.wait("c asked for its first quorum", lambda: run.asking("c"))  # registered is not yet asked
        run.set("go", "1")
        source = run.procs[0]
        run.wait("a killed while sending", lambda: source.poll() is not None)
        assert source.returncode == -9, run.logs()
        results = run.finish()
    b, c = results["b"][0], results["c"][0]
    assert all(r["committed"] for r in b["records"] + c["records"])
    assert [r["source"] for r in c["recoveries"]] == ["b"] and c["recoveries"][0]["step"] == PAUSE
    steps = agreed_steps(results, STEPS)
    assert [steps[s]["members"] for s in range(STEPS)] == [["a", "b"]] * PAUSE + [["b", "c"]] * (STEPS - PAUSE)
    assert b["sha256"] == c["sha256"]
    expected = reference_ddp(steps, seed=0, config={})
    torch.testing.assert_close(torch.tensor(b["final"], dtype=torch.float64), expected, rtol=0, atol=1e-12)


def test_two_replicas_killed_in_one_step_cost_the_last_one_that_step_and_both_rejoin(tmp_path):
    with replicas(tmp_path) as run:
        run.start_together([dict(id="a", index=0, steps=STEPS, pause_after=PAUSE + 1, min_replicas=1),
                            dict(id="b", index=1, steps=STEPS, min_replicas=1, fault="kill_forward", at=AT),
                            dict(id="c", index=2, steps=STEPS, min_replicas=1, fault="kill_allreduce", at=AT)])
        run.wait("b and c killed", lambda: all(p.poll() is not None for p in run.procs[1:]))
        assert [p.returncode for p in run.procs[1:]] == [-9, -9], run.logs()
        for i, rid in enumerate("bc", start=1):
            run.start(id=rid, index=i, steps=STEPS, min_replicas=1)
        run.wait("b and c registered again", lambda: run.registrations() == 5)
        run.wait("b and c asked for their first quorum", lambda: run.asking("b") and run.asking("c"))
        run.set("go", "1")
        results = run.finish()
    a, b, c = results["a"][0], results["b"][1], results["c"][1]
    attempts = [x for x in a["records"] if x["batch"] == AT]
    assert [(x["members"], x["committed"]) for x in attempts] == [(["a", "b", "c"], False), (["a"], True)]
    assert sum(not x["committed"] for x in a["records"]) == 1
    steps = agreed_steps(results, STEPS)
    assert [steps[s]["members"] for s in range(STEPS)] == \
        [["a", "b", "c"]] * AT + [["a"]] * (PAUSE + 1 - AT) + [["a", "b", "c"]] * (STEPS - PAUSE - 1)
    for r in (b, c):
        assert [x["step"] for x in r["recoveries"]] == [PAUSE + 1] and r["recoveries"][0]["source"] == "a"
    assert a["sha256"] == b["sha256"] == c["sha256"]
    expected = reference_ddp(steps, seed=0, config={})
    torch.testing.assert_close(torch.tensor(a["final"], dtype=torch.float64), expected, rtol=0, atol=1e-12)


def test_a_partitioned_replica_is_dropped_past_the_deadline_and_finds_its_step_discarded_when_it_returns(tmp_path):
    # c stops (SIGSTOP) right after its first message of step AT: its connections stay open, so the others see
    # silence, not a reset, as across a partition. They discard the step at their deadline and go on; when the
    # partition heals (SIGCONT), c's step fails too, and c takes the state of the majority
    with replicas(tmp_path) as run:
        run.start_together([dict(id=rid, index=i, steps=STEPS, pause_after=PAUSE + 1, timeout=4,
                                 **({"fault": "stop_allreduce", "at": AT} if rid == "c" else {}))
                            for i, rid in enumerate("abc")])
        run.wait("a committed step PAUSE + 1 without c", lambda: any(r["step"] == PAUSE + 1 for r in run.records("a")))
        assert run.procs[2].poll() is None  # c is stopped, not dead
        os.kill(run.procs[2].pid, signal.SIGCONT)
        run.wait("c saw its step fail", lambda: len(run.records("c")) > AT)
        run.set("go", "1")
        results = run.finish()
    a, b, c = (results[r][0] for r in "abc")
    for r in (a, b):
        attempts = [x for x in r["records"] if x["batch"] == AT]
        assert [(x["members"], x["committed"]) for x in attempts] == [(["a", "b", "c"], False), (["a", "b"], True)]
    assert [(x["batch"], x["committed"]) for x in c["records"]][AT:AT + 2] == [(AT, False), (PAUSE + 1, True)]
    assert [x["step"] for x in c["recoveries"]] == [0, PAUSE + 1]
    steps = agreed_steps(results, STEPS)
    assert a["sha256"] == b["sha256"] == c["sha256"]
    expected = reference_ddp(steps, seed=0, config={})
    torch.testing.assert_close(torch.tensor(c["final"], dtype=torch.float64), expected, rtol=0, atol=1e-12)
