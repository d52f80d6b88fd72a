"""Durable commits by the commands: every replica and the coordinator killed at once, all started again by the same
commands, go on from the checkpoint folder; a replica started after the run ended says so and exits 0.

    python -m pytest -q -m soak tests/spmd/ft/test_ft_durable_cli.py      (about a minute; bench/soak_tests.sh runs it)
"""
import json

import pytest
import torch

from manualdp.spmd.ft.keys import PREFIX
from tests.spmd.ft.cli_harness import check_against_reference, manualdp, reference, run

pytestmark = pytest.mark.soak  # replica processes started by the command line

EPOCHS = 3  # 24 steps


def test_a_run_whose_replicas_and_coordinator_all_died_goes_on_from_disk_and_ends_once(tmp_path):
    ckpt = tmp_path / "ckpt"
    with run(tmp_path, epochs=EPOCHS) as r:
        r.options += ["--checkpoint-dir", str(ckpt)]
        for rid in "ab":
            r.start(rid)
        replicas = [r.replicas["a"][0], r.replicas["b"][0]]
        r.kill_while_held([*replicas, r.coordinator], replicas, "5 steps committed by a and b",
                          lambda: r.committed_with(["a", "b"]) >= 5)
        r.coordinator = manualdp(["coordinator", "--port", str(r.port)], tmp_path / "coordinator-1.log")
        r.procs.append(r.coordinator)
        r.wait("the coordinator again", lambda: "listening" in (tmp_path / "coordinator-1.log").read_text())
        r.store = torch.distributed.PrefixStore(PREFIX, torch.distributed.TCPStore("127.0.0.1", r.port,
                                                                                   is_master=False))
        for rid in "ab":
            r.start(rid)
        results = r.finish()
        late = r.start("c")  # the run has ended: c is told so, and trains nothing
        assert late.wait(timeout=90) == 0, r.logs()
        ref = reference(tmp_path, EPOCHS)
    assert "the run ended at step 24: nothing left to train" in (tmp_path / "c-0.log").read_text()
    for rid in "ab":
        log = (tmp_path / f"{rid}-1.log").read_text()
        assert "resumed from " in log and not (tmp_path / f"{rid}-1.log").read_text().count("step 0,"), log
        assert results[rid]["config"]["fault_tolerant"]["steps"][0]["step"] >= 4  # never from step 0
    for rid in "ab":  # a step taken twice (a round restarted at 1 looks the same) is two lines of one history
        mine = [json.loads(line)["step"] for line in (ckpt / rid / "steps.jsonl").read_text().splitlines()]
        assert len(mine) == len(set(mine)), (rid, mine)
    steps = [json.loads(line) for rid in "ab" for line in (ckpt / rid / "steps.jsonl").read_text().splitlines()]
    taken = {}
    for s in steps:  # every step of the run once: in one round, by the same members, in every history
        assert taken.setdefault(s["step"], (s["round"], s["members"])) == (s["round"], s["members"]), s
    assert sorted(taken) == list(range(8 * EPOCHS))
    check_against_reference(results, ref)
