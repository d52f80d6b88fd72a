"""Replica groups under fault tolerance (`ft/group.py`): groups of 2 ranks, averaged per lane, one killed and back.

The process tests (soak: each starts up to 4 rank processes, `group_worker.py`) compare every
committed step with a one-process reference on the same global batches, each step's gradient
averaged over the groups that committed it, computed here in the ranks' order of operations.
"""
import json
import pathlib
import socket
import subprocess
import sys
import time

import pytest
import torch

from manualdp.spmd.ft import Coordinator
from manualdp.spmd.ft.group import GroupManager
from tests.spmd.ft.group_worker import build, optimizer, shard_grads

ROOT = pathlib.Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Groups:
    """A coordinator in this process, and rank processes started by group, each killed at the end."""

    worker = "tests.spmd.ft.group_worker"  # the module each rank runs

    def __init__(self, tmp: pathlib.Path) -> None:
        self.tmp, self.coordinator, self.procs, self.starts = tmp, Coordinator(0), [], {}

    def start(self, group: str, size: int, **config) -> list[tuple[subprocess.Popen, pathlib.Path]]:
        n = self.starts[group] = self.starts.get(group, -1) + 1
        port, started = free_port(), []
        for rank in range(size):
            out = self.tmp / f"{group}{n}-{rank}.jsonl"
            cfg = {"group": group, "rank": rank, "size": size, "group_port": port,
                   "port": self.coordinator.port, "out": str(out), **config}
            log = open(out.with_suffix(".log"), "w")
            proc = subprocess.Popen([sys.executable, "-m", self.worker, json.dumps(cfg)], cwd=ROOT,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            self.procs.append(proc)
            started.append((proc, out))
        return started

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.coordinator.close()


@pytest.fixture
def groups(tmp_path):
    g = Groups(tmp_path)
    yield g
    g.close()


def wait(ranks, timeout: float = 240) -> list[int]:
    deadline = time.monotonic() + timeout
    for proc, _ in ranks:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    return [proc.returncode for proc, _ in ranks]


def records(out: pathlib.Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, out.read_text().splitlines())} if out.exists() else {}


def log(out: pathlib.Path) -> str:
    return out.with_suffix(".log").read_text()


def reference(members_per_step: list[list[str]], size: int = 2) -> list[torch.Tensor]:
    """The parameters after each step: each group's ranks' gradients summed and halved, then averaged over groups."""
    torch.set_num_threads(1)
    model, after = build(), []
    opt = optimizer(model)
    for step, members in enumerate(members_per_step):
        total = None
        for group in members:  # gloo's sum of 2 is a + b on every rank
            flats = [torch.cat([g.reshape(-1) for g in shard_grads(model, step, group, r, size)]) for r in range(size)]
            mean = (flats[0] + flats[1]) if size == 2 else flats[0]
            mean = mean.div(size)
            total = mean if total is None else total + mean
        total = total.div(len(members))
        for p, g in zip(model.parameters(), total.split([p.numel() for p in model.parameters()])):
            p.grad = g.view_as(p).clone()
        opt.step()
        after.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return after


def check_against_reference(runs: list[dict[int, dict]], steps: int, size: int = 2) -> list[list[str]]:
    """Every rank's committed steps agree and equal the reference bitwise; the members of each step."""
    members = []
    for step in range(steps):
        seen = [run[step] for run in runs if step in run]
        assert seen, f"step {step} committed by nobody"
        assert all(r["members"] == seen[0]["members"] and r["params"] == seen[0]["params"] for r in seen), step
        members.append(seen[0]["members"])
    expected = reference(members, size)
    for run in runs:
        for step, record in run.items():
            assert torch.equal(torch.tensor(record["params"], dtype=torch.float64), expected[step]), (step, record)
    return members


# ---------------------------------------------------------------- in this process


def test_group_manager_refuses_a_bad_group_id_and_a_missing_process_group():
    with pytest.raises(ValueError, match="group_id must be a non-empty name .* got 'a b'"):
        GroupManager("a b", "127.0.0.1", 1)
    with pytest.raises(ValueError, match="min_groups"):
        GroupManager("a", "127.0.0.1", 1, min_groups=0)
    with pytest.raises(RuntimeError, match="call dist.init_process_group first"):
        GroupManager("a", "127.0.0.1", 1)


# ---------------------------------------------------------------- rank processes (soak)


@pytest.mark.soak
def test_two_groups_of_two_ranks_equal_the_one_process_reference(groups):
    # both groups in every quorum: under load one group could otherwise take all 4 steps alone and leave
    ranks = groups.start("A", 2, steps=4, min_groups=2) + groups.start("B", 2, steps=4, min_groups=2)
    assert wait(ranks) == [0, 0, 0, 0], [log(out)[-2000:] for _, out in ranks]
    runs = [records(out) for _, out in ranks]
    assert all(sorted(run) == [0, 1, 2, 3] for run in runs)
    members = check_against_reference(runs, 4)
    assert ["A", "B"] in members  # the groups averaged together (a late group recovers, and is still right)


@pytest.mark.soak
def test_a_rank_killed_mid_average_its_group_leaves_and_comes_back_with_its_lanes(groups):
    first = groups.start("A", 2, steps=5, kill_at=1, together=2)  # dies in the second step of both groups
    others = groups.start("B", 2, steps=5, together=2, sleep=0.3)
    codes = wait(first, timeout=120)
    assert codes[1] == -9, log(first[1][1])
    assert codes[0] != 0 and "GroupBroken: replica group 'A', rank 0: another rank of the group failed" in \
        log(first[0][1]), log(first[0][1])[-2000:]
    again = groups.start("A", 2, steps=5, together=2, rejoin=True)  # torchrun's restart: all the group's ranks
    assert wait(again + others) == [0, 0, 0, 0], [log(out)[-2000:] for _, out in again + others]
    b_runs = [records(out) for _, out in others]
    killed = max(records(first[1][1])) + 1  # the step A's rank died in
    assert all(records(out)[killed - 1]["members"] == ["A", "B"] for _, out in first)  # before it: together
    assert all(run[killed]["members"] == ["B"] for run in b_runs)  # discarded, then taken again by B alone
    runs = [records(out) for _, out in first + again] + b_runs
    steps = max(b_runs[0]) + 1
    members = check_against_reference(runs, steps)
    assert members[-1] == ["A", "B"]  # and together again at the end
    for rank, (_, out) in enumerate(again):
        end = json.loads(pathlib.Path(str(out) + ".end").read_text())
        sources = [r["source"] for r in end["recoveries"]]
        assert sources[:1] == [f"B/lane/{rank}"] and len(end["recoveries"][0]["sha256"]) == 64, end
        assert end["step"] == steps


@pytest.mark.soak
def test_a_group_of_another_size_is_refused_on_each_of_its_ranks(groups):
    running = groups.start("A", 1, steps=40, sleep=0.05)
    deadline = time.monotonic() + 60
    while not records(running[0][1]) and time.monotonic() < deadline:
        time.sleep(0.2)
    misfit = groups.start("B", 2, steps=3)
    assert wait(misfit, timeout=90) != [0, 0]
    for _, out in misfit:
        last = log(out).strip().splitlines()[-1]
        assert "group_size" in last and "2" in last and "1" in last, last
        assert not records(out)
    assert wait(running) == [0]
    assert len(records(running[0][1])) == 40
