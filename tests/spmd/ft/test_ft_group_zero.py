"""Fault-tolerant HSDP from the command line: replica groups of 2 ranks sharded within by `--zero 3` (fully_shard).

Two groups end on the one-process run (each rank's shard on disk, put together, equals its parameters to float32
rounding: the gradient is summed in another order, reduce-scatter in the group then the lane's sum); a group
killed mid-run and started again receives its shards from the live group's ranks and ends there too; a group
started with `--zero 3` into a run without it is refused alone, in one line.

    python -m pytest -q -m soak tests/spmd/ft/test_ft_group_zero.py      (a few minutes)
"""
import contextlib
import io
import json
import os
import signal

import pytest
import torch

from manualdp.runners.cli import main
from manualdp.spmd.ft import keys
from manualdp.spmd.ft.group_disk import GroupDisk
from manualdp.support.checkpoint import load_latest
from tests.spmd.ft.cli_harness import RUN, check_against_reference, committed, reference, run
from tests.spmd.ft.test_ft_group_cli import start_group
from tests.spmd.ft.test_ft_group_durable import exit_codes, kill_all, signal_all

EPOCHS = 2  # 16 steps
KILLED_EPOCHS = 3  # 24 steps
ZERO = ["--zero", "3"]


def reference_parameters(tmp_path, epochs: int = EPOCHS) -> dict[str, torch.Tensor]:
    """The one-process run's final parameters (`manualdp train --devices 1`, its last checkpoint)."""
    folder = tmp_path / "reference-ckpt"
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["train", "--devices", "1", "--cpu", *RUN, "--epochs", str(epochs), "--checkpoint-dir",
                         str(folder)]) == 0
    finally:
        torch.set_num_threads(threads)
    return load_latest(str(folder))["model"]


def whole_from_shards(ckpt, gid: str) -> dict[str, torch.Tensor]:
    """Group `gid`'s newest model on disk, each parameter its ranks' shards (rows) put together in rank order."""
    shards = [load_latest(str(ckpt / f"rank{rank}" / gid))["state"]["model"] for rank in (0, 1)]
    return {name: torch.cat([s[name] for s in shards]) for name in shards[0]}


def check_parameters(ckpt, gids: str, expected: dict[str, torch.Tensor]) -> None:
    """Each group's parameters equal the others' bitwise and `expected` to float32 rounding."""
    wholes = {gid: whole_from_shards(ckpt, gid) for gid in gids}
    first = wholes[gids[0]]
    assert sorted(first) == sorted(expected)
    for gid, whole in wholes.items():
        assert all(torch.equal(whole[k], first[k]) for k in first), gid
        for name, value in expected.items():
            torch.testing.assert_close(whole[name], value, rtol=1e-5, atol=1e-6, msg=f"{gid} {name}")


def test_a_folder_saved_without_zero3_is_refused_by_a_sharded_group_naming_zero(tmp_path):
    saved = GroupDisk(str(tmp_path), "A", 0, 2)
    saved.lane.save(3, saved.identity({"lr": 0.1, "zero": 0}), {"model": {}}, [])  # whole models on its lanes
    sharded = GroupDisk(str(tmp_path), "A", 0, 2)
    with pytest.raises(ValueError) as info:
        sharded.held(sharded.identity({"lr": 0.1, "zero": 3}))
    assert "\n" not in str(info.value) and "zero 0 here 3" in str(info.value), info.value


@pytest.mark.soak
def test_two_groups_sharded_by_zero3_end_on_the_one_process_run(tmp_path):
    extra = {rank: [*ZERO, "--checkpoint-dir", str(tmp_path / "ckpt")] for rank in (0, 1)}
    procs = []
    with run(tmp_path, epochs=EPOCHS) as r:
        try:
            for gid in "AB":
                procs += start_group(gid, 2, r.port, tmp_path, EPOCHS, extra)
            codes = exit_codes(procs, 300)
        finally:
            kill_all(procs)
        logs = r.logs()
    assert codes == [0, 0, 0, 0], logs
    results = {gid: json.loads((tmp_path / f"{gid}.json").read_text()) for gid in "AB"}
    assert all(h["config"]["fault_tolerant"]["zero"] == 3 for h in results.values())
    steps = committed(results)
    assert sorted(steps) == list(range(8 * EPOCHS)) and all(m == ["A", "B"] for m in steps.values()), steps
    check_against_reference(results, reference(tmp_path, EPOCHS))  # the gathered parameters' digests too
    check_parameters(tmp_path / "ckpt", "AB", reference_parameters(tmp_path))


@pytest.mark.soak
def test_a_sharded_group_killed_mid_run_receives_its_shards_and_ends_on_the_one_process_run(tmp_path):
    EPOCHS = KILLED_EPOCHS  # noqa: N806 - room for B to train alone before A comes back
    # A's first process never commits without B (--min-replicas 2): a step A took alone, before B came, would live
    # only in the history of the process the test kills (CI: steps 0-9 in no --json). B, which lives throughout,
    # trains alone (--min-replicas 1) whenever A is not there, so its --json holds every step up to A's return.
    extra = {rank: [*ZERO, "--checkpoint-dir", str(tmp_path / "ckpt")] for rank in (0, 1)}
    alone = {rank: [*extra[rank], "--min-replicas", "1"] for rank in (0, 1)}
    again, procs = tmp_path / "again", []
    again.mkdir()
    with run(tmp_path, epochs=EPOCHS) as r:
        try:
            procs += start_group("A", 2, r.port, tmp_path, EPOCHS, extra)
            procs += start_group("B", 2, r.port, tmp_path, EPOCHS, alone)
            r.wait("3 steps committed by A and B", lambda: r.committed_with(["A", "B"]) >= 3, timeout=180)
            signal_all(procs, signal.SIGSTOP)  # so that the run cannot end before the kill lands
            os.killpg(procs[1].pid, signal.SIGKILL)  # rank 1 of A: the whole group leaves
            procs[1].wait(timeout=10)
            signal_all([procs[0], *procs[2:]], signal.SIGCONT)
            assert exit_codes(procs[:2], 120)[0] == 1, r.logs()  # A's rank 0 names its lost rank and exits
            r.wait("a step committed by B alone", lambda: r.committed_with(["B"]) >= 1, timeout=180)
            signal_all(procs[2:], signal.SIGSTOP)  # B waits for A: A comes back before the run ends
            gone = {rank: [*ZERO, "--min-replicas", "1"] for rank in (0, 1)}  # no disk: its shards come from B's
            procs += start_group("A", 2, r.port, again, EPOCHS, gone)
            # its new process holds no state yet: it waits for B, which holds the run's (no quorum below it)
            r.wait("A started again", lambda: r.key(keys.held("A")) == b"", timeout=120)
            signal_all(procs[2:4], signal.SIGCONT)
            codes = exit_codes(procs[2:], 300)
        finally:
            kill_all(procs)
        logs = r.logs() + "".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(again.glob("*.log")))
        rounds = r.committed_steps()  # what the coordinator decided, whoever recorded it
    assert codes == [0, 0, 0, 0], logs
    results = {"A": json.loads((again / "A.json").read_text()), "B": json.loads((tmp_path / "B.json").read_text())}
    got = results["A"]["config"]["fault_tolerant"]
    assert got["recoveries"] and all(x["source"] == "B/lane/0" for x in got["recoveries"]), got["recoveries"]
    steps = committed(results)
    assert sorted(steps) == list(range(8 * KILLED_EPOCHS)), steps  # every step once, whoever took it
    assert sorted(rounds) == sorted(steps.items()), (rounds, steps)  # each committed once, by the members recorded
    assert got["steps"][0]["step"] >= 4, got["steps"][:2]  # A went on from B's step, never from step 0
    assert any(m == ["B"] for m in steps.values()) and steps[8 * KILLED_EPOCHS - 1] == ["A", "B"], steps
    check_against_reference(results, reference(tmp_path, KILLED_EPOCHS))
    expected = reference_parameters(tmp_path, KILLED_EPOCHS)
    check_parameters(tmp_path / "ckpt", "B", expected)
    # the bytes its lanes received, measured (the store's replies): each lane its half, so at least the model's
    said = [line for line in (again / "A-0.log").read_text().splitlines() if "received its state over its 2" in line]
    assert len(said) == 1 and int(said[0].split(": ")[-1].split()[0]) >= sum(
        4 * v.numel() for v in expected.values()), said


@pytest.mark.soak
def test_a_group_with_zero3_coming_into_a_run_without_it_is_refused_alone_in_one_line(tmp_path):
    procs = []
    with run(tmp_path, epochs=1000, min_replicas=1) as r:  # far longer than the test: stopped at its end
        try:
            procs += start_group("A", 2, r.port, tmp_path, 1000, {rank: ["--min-replicas", "1"] for rank in (0, 1)})
            r.wait("a step committed by A", lambda: r.committed_with(["A"]) >= 1, timeout=180)
            procs += start_group("B", 2, r.port, tmp_path, 1000, {rank: [*ZERO, "--min-replicas", "1"]
                                                                 for rank in (0, 1)})
            codes = exit_codes(procs[2:], 180)
            still = [p.poll() for p in procs[:2]]
        finally:
            kill_all(procs)
        logs = r.logs()
    assert codes == [2, 2] and still == [None, None], logs  # A trains on
    for rank in (0, 1):
        last = (tmp_path / f"B-{rank}.log").read_text().strip().splitlines()[-1]
        assert last.startswith("manualdp train: error:") and "zero" in last, last
