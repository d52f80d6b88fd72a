"""`bench/ft_chaos.py`'s `check` on runs written by hand: what it must accept and what it must refuse."""
import json

from bench.ft_chaos import REPLICAS, STEPS_PER_EPOCH, check


def _run(tmp_path, ended: dict[str, str]) -> dict:
    """A run of one epoch, every step committed once by a, b and c; `ended[rid]`: the last log of a replica
    that wrote no --json."""
    histories = {r: [{"step": s, "round": s + 1, "members": list(REPLICAS)} for s in range(STEPS_PER_EPOCH)]
                 for r in REPLICAS}
    for rid in REPLICAS:
        if rid in ended:
            (tmp_path / f"{rid}-0.log").write_text(ended[rid])
        else:
            (tmp_path / f"{rid}-0.log").write_text("quorum of 3\n")
            record = {"config": {"fault_tolerant": {"parameters_sha256": "ab"}}, "train_loss": [1.0], "test_acc": 0.5}
            (tmp_path / f"{rid}.json").write_text(json.dumps(record))
    return {"dir": str(tmp_path), "histories": histories, "procs": {r: [0] for r in REPLICAS}}


def test_a_replica_told_the_run_had_ended_is_not_a_problem(tmp_path):
    told = "replica 'b': the run ended at step 64 (ckpt says so): nothing left to train\n"
    assert check(_run(tmp_path, {"b": told, "c": told}), epochs=1) == []


def test_a_replica_that_ended_rc_0_without_training_to_the_end_or_being_told_is(tmp_path):
    problems = check(_run(tmp_path, {"b": "quorum of 2\n"}), epochs=1)
    assert problems == ["replica b wrote no --json: its last process did not train to the end"]


def test_a_run_where_no_replica_trained_to_the_end_is_refused(tmp_path):
    told = "the run ended at step 64\n"
    problems = check(_run(tmp_path, dict.fromkeys(REPLICAS, told)), epochs=1)
    assert problems == ["no replica wrote its --json: none trained to the end"]


def test_a_step_committed_twice_is_named(tmp_path):
    summary = _run(tmp_path, {})
    summary["histories"]["a"][3] = {"step": 3, "round": 99, "members": ["a"]}
    assert any("step 3 was committed twice" in p for p in check(summary, epochs=1))
