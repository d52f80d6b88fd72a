"""`bench/ft_chaos.py --group-size 2` (`bench/ft_chaos_groups.py`): its check on runs written by hand, and a short
chaos of 2 groups of 2 ranks, a random rank of a random group SIGKILLed 4 times (soak, about 2 minutes).
"""
import json
import signal

import pytest

from bench.ft_chaos import STEPS_PER_EPOCH, reference_run
from bench.ft_chaos_groups import GROUPS, check_groups, group_chaos


def _run(tmp_path, shas=("ab", "ab"), last_line: str = "another rank of the group failed (gloo)") -> dict:
    """One epoch, every step committed once by A and B; B's rank 1 killed once, its rank 0 leaving with `last_line`."""
    for gid, sha in zip(GROUPS, shas):
        recoveries = [{"source": "A/lane/0", "round": 9, "sha256": "ef"}] if gid == "B" else []
        record = {"config": {"fault_tolerant": {"parameters_sha256": sha, "recoveries": recoveries}},
                  "train_loss": [1.0], "test_acc": 0.5}
        (tmp_path / f"{gid}.json").write_text(json.dumps(record))
        for n in range(2 if gid == "B" else 1):
            for rank in (0, 1):
                (tmp_path / f"{gid}{n}-{rank}.log").write_text("quorum of 2\n" + (last_line if n == 0 else ""))
    return {"dir": str(tmp_path), "total": STEPS_PER_EPOCH, "killed": [["B", 0, 1]],
            "committed": {str(s + 1): [s, list(GROUPS)] for s in range(STEPS_PER_EPOCH)},
            "procs": {"A": [[0, 0]], "B": [[1, -signal.SIGKILL], [0, 0]]}}


def test_a_clean_group_run_passes_the_check(tmp_path):
    assert check_groups(_run(tmp_path)) == []


def test_a_step_committed_in_two_rounds_and_a_step_never_committed_are_named(tmp_path):
    summary = _run(tmp_path)
    summary["committed"]["99"] = [3, ["A"]]
    del summary["committed"]["6"]
    assert check_groups(summary) == ["step 3 was committed in 2 rounds: [4, 99]", "steps not committed: [5]"]


def test_a_peer_of_the_killed_rank_that_did_not_name_the_broken_group_is_named(tmp_path):
    problems = check_groups(_run(tmp_path, last_line="Traceback: something else"))
    assert problems == ["group B's rank 0 (start 0) ended with 1, not naming the broken group: "
                        "Traceback: something else"]


def test_a_group_started_again_that_received_no_state_is_named(tmp_path):
    summary = _run(tmp_path)
    record = json.loads((tmp_path / "B.json").read_text())
    record["config"]["fault_tolerant"]["recoveries"] = [{"source": "B/lane/0", "round": 9, "sha256": "ef"}]
    (tmp_path / "B.json").write_text(json.dumps(record))
    assert check_groups(summary) == ["group B was started again but its rank 0 received no state from another "
                                     "group's rank 0: ['B/lane/0']"]


def test_groups_ending_on_other_parameters_are_named(tmp_path):
    assert check_groups(_run(tmp_path, shas=("ab", "cd"))) == [
        "the groups' final parameters differ: {'A': 'ab', 'B': 'cd'}"]


@pytest.mark.soak
def test_the_short_group_chaos_commits_every_step_once_and_ends_as_one_process(tmp_path):
    epochs = 4
    summary = group_chaos(str(tmp_path), kills=4, epochs=epochs, size=2, seed=1, timeout=240)
    assert summary["kills"] >= 3 and summary["rounds"]["discard"] >= 1, summary["kills"]
    assert len(summary["recoveries"]) >= 3
    assert check_groups(summary, reference_run(str(tmp_path), epochs)) == []
