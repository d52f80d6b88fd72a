"""A replica stopped (SIGSTOP) past the deadline is dropped and taken back when it wakes; too few replicas wait."""
import os
import signal
import time

import pytest
import torch

from manualdp.cost import bytes_per_step
from tests.spmd.ft.harness import agreed_steps, committed_steps, guard_bytes, reference_ddp, replicas
from tests.spmd.ft.replica import build

pytestmark = pytest.mark.soak  # replica processes: about a minute


def test_a_stopped_replica_is_dropped_past_the_deadline_and_rejoins_when_it_wakes(tmp_path):
    steps, at, pause = 7, 2, 4
    with replicas(tmp_path) as run:
        run.start_together([dict(id=rid, index=i, steps=steps, pause_after=pause, timeout=4,
                                 **({"fault": "stop_forward", "at": at} if rid == "c" else {}))
                            for i, rid in enumerate("abc")])
        run.wait("a committed step 4 without c", lambda: any(r["step"] == pause for r in run.records("a")))
        assert run.procs[2].poll() is None  # c is stopped, not dead
        os.kill(run.procs[2].pid, signal.SIGCONT)
        run.wait("c saw its step fail", lambda: len(run.records("c")) > at)
        run.set("go", "1")
        results = run.finish()
    a, b, c = (results[r][0] for r in "abc")
    for r in (a, b):
        attempts = [x for x in r["records"] if x["batch"] == at]
        assert [(x["members"], x["committed"]) for x in attempts] == [(["a", "b", "c"], False), (["a", "b"], True)]
    assert [(x["batch"], x["committed"]) for x in c["records"]][at:at + 2] == [(at, False), (pause, True)]
    assert [x["step"] for x in c["recoveries"]] == [0, pause]  # a's fresh model at the start, then step 4
    steps_seen = agreed_steps(results)
    assert a["sha256"] == b["sha256"] == c["sha256"]
    expected = reference_ddp(steps_seen, seed=0, config={})
    torch.testing.assert_close(torch.tensor(c["final"], dtype=torch.float64), expected, rtol=0, atol=1e-12)


def test_an_allreduce_that_fails_on_a_live_replica_is_discarded_everywhere_and_taken_again(tmp_path):
    with replicas(tmp_path) as run:
        # timeout 4: a waits that long for b's part (gloo keeps a group's connections open after b leaves it)
        run.start(id="a", index=0, steps=4, timeout=4)
        run.start(id="b", index=1, steps=4, fault="fail_allreduce", at=2, timeout=4)
        results = run.finish()
    a, b = results["a"][0], results["b"][0]
    for r in (a, b):
        assert [(x["batch"], x["members"], x["committed"]) for x in r["records"]] == [
            (0, ["a", "b"], True), (1, ["a", "b"], True), (2, ["a", "b"], False), (2, ["a", "b"], True),
            (3, ["a", "b"], True)]
    assert a["sha256"] == b["sha256"]
    expected = reference_ddp(committed_steps(results), seed=0, config={})
    torch.testing.assert_close(torch.tensor(a["final"], dtype=torch.float64), expected, rtol=0, atol=1e-12)


def test_below_min_replicas_the_first_waits_then_both_go_on(tmp_path):
    with replicas(tmp_path) as run:
        run.start(id="a", index=0, steps=3, min_replicas=2)
        run.wait("a asked for a quorum", lambda: run.key("round/1/asks") is not None)
        time.sleep(1.0)
        assert run.key("round/1/quorum") is None  # alone, below its minimum: no quorum
        run.start(id="b", index=1, steps=3, min_replicas=2)
        results = run.finish()
    a, b = results["a"][0], results["b"][0]
    assert a["records"][0]["waited"] >= 1.0 and a["records"][0]["members"] == ["a", "b"]
    assert all(r["committed"] for r in a["records"] + b["records"])
    assert a["sha256"] == b["sha256"]
    assert b["recoveries"][0]["source"] == "a" and b["recoveries"][0]["step"] == 0  # a's fresh model is everyone's
    nbytes = sum(p.numel() for p in build(0).parameters()) * 8  # DDP: the float64 gradients, every step
    for rank, r in enumerate((a, b)):
        # the gradients, and the contribution guard's norms
        assert [x["sent"] for x in r["records"]] == [bytes_per_step("ddp", nbytes, 2, 1, "ring", 8)[rank]
                                                     + guard_bytes(2)] * 3
    expected = reference_ddp(committed_steps(results), seed=0, config={})
    torch.testing.assert_close(torch.tensor(b["final"], dtype=torch.float64), expected, rtol=0, atol=1e-12)
