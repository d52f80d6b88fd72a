"""3 replicas; one killed (SIGKILL) in the middle of training, the other two go on; restarted, it rejoins."""
import pytest
import torch

from tests.spmd.ft.harness import agreed_steps, reference_ddp, replicas

pytestmark = pytest.mark.soak  # replica processes: about a minute

STEPS, AT, PAUSE = 8, 3, 5


@pytest.mark.parametrize("fault, ahead", [("kill_forward", False), ("kill_allreduce", False), ("kill_forward", True)])
def test_a_killed_replica_costs_one_step_and_rejoins_with_the_state(tmp_path, fault, ahead):
    """`ahead`: the quorum asked ahead (`async_quorum`): c's return costs the survivors one more step, voted down."""
    with replicas(tmp_path) as run:
        run.start_together([dict(id=rid, index=i, steps=STEPS, pause_after=PAUSE, async_quorum=ahead,
                                 **({"fault": fault, "at": AT} if rid == "c" else {})) for i, rid in enumerate("abc")])
        victim = run.procs[2]
        run.wait("c killed", lambda: victim.poll() is not None)
        assert victim.returncode == -9, run.logs()
        run.start(id="c", index=2, steps=STEPS, async_quorum=ahead)
        run.wait("c registered again", lambda: run.registrations() == 4)
        run.wait("c asked for its first quorum", lambda: run.asking("c"))  # registered is not yet asked
        run.set("go", "1")  # the survivors, paused after step PAUSE, go on: c is in their next quorum
        results = run.finish()
    a, b, c = results["a"][0], results["b"][0], results["c"][1]
    # the step the kill interrupted was discarded on both survivors, and nothing else was lost
    for r in (a, b):
        attempts = [x for x in r["records"] if x["batch"] == AT]
        assert [x["committed"] for x in attempts] == [False, True], attempts
        # asked ahead, c may die before its thread asks: then the step's quorum is a and b's, voted down (ahead.py)
        assert attempts[0]["members"] in ([["a", "b", "c"], ["a", "b"]] if ahead else [["a", "b", "c"]])
        assert attempts[1]["members"] == ["a", "b"]
        rejoined = [x for x in r["records"] if x["batch"] == PAUSE]
        assert [x["committed"] for x in rejoined] == ([False, True] if ahead else [True]), rejoined
        assert sum(not x["committed"] for x in r["records"]) == 1 + ahead
    # every committed step: the same members and bitwise the same parameters on every replica that took it
    steps = agreed_steps(results, STEPS)
    assert [steps[s]["members"] for s in range(STEPS)] == [["a", "b", "c"]] * AT + [["a", "b"]] * (PAUSE - AT) + \
        [["a", "b", "c"]] * (STEPS - PAUSE)
    # the restarted replica received the state at step PAUSE from a member at that step, checksummed
    assert len(c["recoveries"]) == 1 and c["recoveries"][0]["step"] == PAUSE
    assert c["recoveries"][0]["source"] in ("a", "b") and len(c["recoveries"][0]["sha256"]) == 64
    assert c["records"][0]["batch"] == PAUSE and c["records"][0]["committed"] is not ahead
    assert a["sha256"] == b["sha256"] == c["sha256"]
    # and all that equals one process training on each step's members' shards (a's model: the first quorum's source)
    expected = reference_ddp(steps, seed=0, config={})
    torch.testing.assert_close(torch.tensor(a["final"], dtype=torch.float64), expected, rtol=0, atol=1e-12)
