"""`manualdp train --fault-tolerant` under torchrun: a replica group of ranks (`runners/ft_group_train.py`).

What a group cannot do yet is refused in one line (in this process); 2 groups of 2 ranks, started as
torchrun starts them (its environment variables), end on equal parameters and on the one-process run
(soak: 4 rank processes).
"""
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest
import torch

from manualdp.runners.cli import build_parser, check_train_args
from manualdp.runners.ft_group_train import init_group, train_group_rank
from manualdp.spmd.ft import Coordinator
from tests.spmd.ft.cli_harness import RUN, check_against_reference, committed, reference

ROOT = pathlib.Path(__file__).resolve().parents[3]
FT = ["train", "--fault-tolerant", "127.0.0.1:29510", "--replica-id", "A"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("extra, words", [
    (["--local-sgd", "2"], ["--local-sgd with --fault-tolerant under torchrun"]),
    (["--diloco", "2"], ["--diloco with --fault-tolerant under torchrun"]),
    (["--zero", "2"], ["--zero with --fault-tolerant under torchrun", "by --zero 3"]),
    (["--devices", "2"], ["--devices with --fault-tolerant under torchrun"]),
    (["--algorithm", "ring"], ["--algorithm with --fault-tolerant under torchrun"]),
    (["--bucket-mb", "1"], ["--bucket-mb with --fault-tolerant"]),
])
def test_what_a_replica_group_cannot_do_yet_is_refused_in_one_line(extra, words, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    problem = check_train_args(build_parser().parse_args([*FT, *extra]))
    assert problem and "\n" not in problem and all(w in problem for w in words), problem


def test_a_replica_group_still_needs_its_id_and_is_otherwise_let_through(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "--fault-tolerant needs --replica-id" in check_train_args(build_parser().parse_args(FT[:3]))
    for guard in ("off", "raise", "skip"):  # the contribution guard works in a group (test_ft_group_guard.py)
        assert check_train_args(build_parser().parse_args([*FT, "--nonfinite", guard, "--min-replicas", "2"])) is None


@pytest.mark.parametrize("kwargs, error, words", [
    ({"manager": "A"}, TypeError, ["manager must be a manualdp.spmd.ft.group.GroupManager", "str"]),
    ({"lr": -1.0}, ValueError, ["lr", "-1"]),
    ({"num_epochs": 0}, ValueError, ["num_epochs", "0"]),
    ({"train_iter": [(torch.zeros(2, 4), torch.zeros(2).long())]}, TypeError, ["train_iter", "DataLoader"]),
])
def test_train_group_rank_names_a_bad_argument_before_it_trains(kwargs, error, words):
    net = torch.nn.Linear(4, 2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.zeros(8).long()),
                                         batch_size=4)
    given = {"net": net, "train_iter": loader, "test_iter": loader, "num_epochs": 1, "lr": 0.1, "manager": None,
             **kwargs}
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(error) as info:
        train_group_rank(**given, progress=False, log=None)
    assert "\n" not in str(info.value) and all(w in str(info.value) for w in words), info.value
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    with pytest.raises(ValueError, match="timeout .* got -1"):
        init_group(-1)


def start_group(gid: str, size: int, coordinator_port: int, tmp: pathlib.Path, epochs: int,
                extra: dict | None = None) -> list:
    """The ranks of replica group `gid`, started as `torchrun --nproc-per-node SIZE -m manualdp train ...` would;
    `extra[rank]`: more arguments for that rank alone."""
    master, procs = free_port(), []
    for rank in range(size):
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size),
                   LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master))
        argv = ["train", "--fault-tolerant", f"127.0.0.1:{coordinator_port}", "--replica-id", gid, *RUN,
                "--epochs", str(epochs), "--timeout", "20", "--min-replicas", "2", "--json", str(tmp / f"{gid}.json"),
                *(extra or {}).get(rank, [])]
        with open(tmp / f"{gid}-{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "manualdp", *argv], cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    return procs


@pytest.mark.soak
def test_two_groups_of_two_ranks_from_the_command_line_equal_the_one_process_run(tmp_path):
    coordinator = Coordinator(0)
    procs = []
    (tmp_path / "late").mkdir()
    try:
        for gid in "AB":
            procs += start_group(gid, 2, coordinator.port, tmp_path, epochs=1)
        codes = [p.wait(timeout=240) for p in procs]
        late = start_group("A", 2, coordinator.port, tmp_path / "late", epochs=1)  # the run has ended meanwhile
        procs += late
        told = [p.wait(timeout=120) for p in late]
    finally:
        for p in procs:
            p.kill()  # nothing, for a rank that ended (its exit status was read)
            p.wait()
        coordinator.close()
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("**/*.log")))
    assert codes == [0, 0, 0, 0], logs
    assert told == [0, 0], logs
    assert "the run ended" in (tmp_path / "late" / "A-0.log").read_text().strip().splitlines()[-1], logs
    assert not (tmp_path / "late" / "A.json").exists()
    results = {gid: json.loads((tmp_path / f"{gid}.json").read_text()) for gid in "AB"}
    for gid, h in results.items():
        ft = h["config"]["fault_tolerant"]
        assert (ft["replica_id"], ft["group_size"], ft["group_rank"]) == (gid, 2, 0)
    steps = committed(results)
    assert sorted(steps) == list(range(8)) and all(m == ["A", "B"] for m in steps.values()), steps
    check_against_reference(results, reference(tmp_path, 1))


@pytest.mark.soak
def test_ranks_of_one_group_given_other_settings_each_refuse_in_one_line_naming_the_field(tmp_path):
    procs = start_group("A", 2, free_port(), tmp_path, epochs=1, extra={1: ["--lr", "0.2"]})  # before any coordinator
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for rank in (0, 1):
        last = (tmp_path / f"A-{rank}.log").read_text().strip().splitlines()[-1]
        assert last.startswith("manualdp train: error: replica group 'A', rank") and "lr" in last, last
    assert codes == [1, 1]


@pytest.mark.soak
def test_a_group_joining_a_run_of_one_process_replicas_is_refused_alone_in_one_line(tmp_path):
    coordinator = Coordinator(0)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = ["train", "--fault-tolerant", f"127.0.0.1:{coordinator.port}", "--replica-id", "a", *RUN, "--epochs",
            "1000", "--timeout", "20", "--min-replicas", "1"]  # far longer than the test: stopped at its end
    with open(tmp_path / "a.log", "w") as log:
        alone = subprocess.Popen([sys.executable, "-m", "manualdp", *argv], cwd=ROOT, env=env, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    procs = [alone]
    try:
        while "quorum of" not in (tmp_path / "a.log").read_text() and alone.poll() is None:
            time.sleep(0.2)  # a is in the run: B comes to a run under way
        procs += start_group("B", 2, coordinator.port, tmp_path, epochs=1000)
        codes = [p.wait(timeout=240) for p in procs[1:]]
        still = alone.poll()
    finally:
        for p in procs:
            p.kill()
            p.wait()
        coordinator.close()
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("*.log")))
    assert still is None and codes == [2, 2], logs  # a trains on
    for rank in (0, 1):
        last = (tmp_path / f"B-{rank}.log").read_text().strip().splitlines()[-1]
        assert last.startswith("manualdp train: error:") and "group_size" in last, last
