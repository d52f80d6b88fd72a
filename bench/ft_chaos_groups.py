"""Chaos for replica groups (`python bench/ft_chaos.py --group-size 2`): a random rank of a random group SIGKILLed.

Starts `manualdp coordinator` and groups A and B of `--group-size` ranks, each group as torchrun
starts it (`manualdp train --fault-tolerant ... --replica-id A` with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set). Every 0.5-2.5 s, once every group is in the run and the last group killed has
committed a step again, it kills one rank of a random group (SIGKILL), waits for the group's other
ranks to exit by themselves (GroupBroken), and starts the whole group again. Never two groups down
at once, and never the coordinator: a group keeps no checkpoint yet (`--checkpoint-dir` is refused),
so the run's state lives in the live groups. Each step's quorum is both groups (`--min-replicas 2`):
the survivor waits for the group started again, whose ranks receive their state from the survivor's
ranks (rank i from rank i); with `--min-groups 1` the survivor trains on alone meanwhile. The kills
stop once `--kills` are done or most of the run is committed; then both groups run to the end.

Checked at the end (a line each; the exit status 1 if one fails): every step of the run was
committed in exactly one round (the coordinator's store: each committed round's step); the last
ranks of every group ended with 0, a killed rank with SIGKILL and its group's other ranks naming
the broken group; a group started again received its rank 0's state from another group's rank 0 (its
--json's recoveries); the groups' final parameters are bitwise equal, and their losses equal the
one-process run on the same batches (each step is the whole global batch's, whoever is in).
"""
from __future__ import annotations

import datetime
import json
import os
import random
import signal
import subprocess
import time

import torch

from bench.ft_chaos import RUN, STEPS_PER_EPOCH, _free_port, _manualdp, against_reference, start_coordinator

__all__ = ["GROUPS", "group_chaos", "check_groups"]

GROUPS = ("A", "B")


class GroupChaos:
    """The coordinator and the groups' rank processes, by generation; kills, restarts, and the store's rounds."""

    def __init__(self, workdir: str, epochs: int, size: int, rng: random.Random, min_groups: int = 2,
                 zero: int | None = None) -> None:
        self.dir, self.size, self.rng, self.port = workdir, size, rng, _free_port()
        os.makedirs(workdir, exist_ok=True)
        # a quorum of both groups: the survivor waits for the group started again (its imports and data take
        # longer than what is left of a short run alone, and a run that ended cannot take a group back in)
        run = RUN[:RUN.index("--min-replicas")] + RUN[RUN.index("--timeout") + 2:]
        self.options = [*run, "--min-replicas", str(min_groups), "--timeout", "90", "--epochs", str(epochs)]
        self.options += ["--zero", str(zero)] if zero else []  # 3: each group shards the model (fault-tolerant HSDP)
        self.total = epochs * STEPS_PER_EPOCH
        self.procs: dict[str, list[list[subprocess.Popen]]] = {g: [] for g in GROUPS}  # a generation: its ranks
        self.killed: list[tuple[str, int, int]] = []  # (group, generation, rank killed)
        self.kill_rounds: list[int] = []  # for each kill, the last round decided then
        self.pending: list[tuple[str, float, int]] = []  # (group, killed at, the last round decided then)
        self.recoveries: list[float] = []
        self.rounds: dict[int, tuple[str, int, list[str]]] = {}  # round -> (outcome, step, members)
        self.coordinator = start_coordinator(workdir, self.port)
        self.store = torch.distributed.PrefixStore("manualdp-ft", torch.distributed.TCPStore(
            "127.0.0.1", self.port, is_master=False, timeout=datetime.timedelta(seconds=10)))
        for gid in GROUPS:
            self.start(gid)

    def log(self, gid: str, generation: int, rank: int) -> str:
        return os.path.join(self.dir, f"{gid}{generation}-{rank}.log")

    def start(self, gid: str) -> None:
        """Start every rank of group `gid`, as `torchrun --nproc-per-node SIZE` would."""
        n, master = len(self.procs[gid]), _free_port()
        args = ["train", "--fault-tolerant", f"127.0.0.1:{self.port}", "--replica-id", gid, *self.options,
                "--json", os.path.join(self.dir, f"{gid}.json")]
        self.procs[gid].append([
            _manualdp(args, self.log(gid, n, rank), {"RANK": str(rank), "LOCAL_RANK": str(rank),
                                                     "WORLD_SIZE": str(self.size), "LOCAL_WORLD_SIZE": str(self.size),
                                                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)})
            for rank in range(self.size)])

    def up(self, gid: str) -> bool:
        """Whether group `gid`'s ranks all run and its rank 0 has joined a quorum: a kill then hits its work."""
        n = len(self.procs[gid]) - 1
        with open(self.log(gid, n, 0), errors="replace") as f:
            joined = "quorum of" in f.read()
        return joined and all(p.poll() is None for p in self.procs[gid][-1])

    def kill(self, gid: str, timeout: float = 90) -> None:
        """SIGKILL a random rank of `gid`; wait for its other ranks to leave by themselves; start the group again."""
        ranks, n = self.procs[gid][-1], len(self.procs[gid]) - 1
        rank = self.rng.randrange(self.size)
        # the store's newest decided round, not the newest this harness has read: a commit of the group in a round
        # decided before the kill but read after it was counted as its recovery (1.4 s recoveries in the profile)
        before = int(self.store.get("latest")) if self.store.check(["latest"]) else 0
        os.killpg(ranks[rank].pid, signal.SIGKILL)
        self.killed.append((gid, n, rank))
        self.kill_rounds.append(before)  # the last round decided before it: for --plot
        self.pending.append((gid, time.monotonic(), before))
        deadline = time.monotonic() + timeout
        for p in ranks:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # told in `check_groups`: a rank that did not leave by itself
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.start(gid)

    def watch(self) -> None:
        """Read the rounds decided since the last look; note each killed group's first commit after it came back."""
        latest = int(self.store.get("latest")) if self.store.check(["latest"]) else 0
        for r in range(max(self.rounds, default=0) + 1, latest + 1):
            quorum, outcome = f"round/{r}/quorum", f"round/{r}/outcome"
            if not self.store.check([outcome]):
                break  # decided rounds only; this one is read next time
            members = json.loads(self.store.get(quorum))["members"] if self.store.check([quorum]) else []
            self.rounds[r] = ("commit" if b"commit" in self.store.get(outcome) else "discard",
                              max((m["step"] for m in members), default=-1), [m["id"] for m in members])
        for gid, killed, before in list(self.pending):
            if any(o == "commit" and gid in ids and r > before for r, (o, _, ids) in self.rounds.items()):
                self.recoveries.append(time.monotonic() - killed)
                self.pending.remove((gid, killed, before))

    def committed(self) -> int:
        return sum(1 for o, _, _ in self.rounds.values() if o == "commit")

    def running(self) -> bool:
        return any(p.poll() is None for g in GROUPS for p in self.procs[g][-1])

    def close(self) -> None:
        for proc in [p for g in GROUPS for gen in self.procs[g] for p in gen] + [self.coordinator]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def group_chaos(workdir: str, kills: int, epochs: int, size: int = 2, seed: int = 0, timeout: float = 600,
                min_groups: int = 2, zero: int | None = None) -> dict:
    """Run the chaos of replica groups in `workdir`; a summary for `check_groups` and `ft_chaos.report`."""
    rng, started = random.Random(seed), time.monotonic()
    c = GroupChaos(workdir, epochs, size, rng, min_groups, zero)  # 1: the survivor trains on alone
    try:
        while c.committed() == 0 and time.monotonic() - started < timeout / 2:
            time.sleep(0.2)
            c.watch()
        while len(c.killed) < kills and c.committed() < 0.8 * c.total and time.monotonic() - started < timeout:
            time.sleep(rng.uniform(0.5, 2.5))
            c.watch()
            # never two groups down at once: a group keeps no checkpoint, so the run's state lives in the groups
            if not c.pending and all(c.up(g) for g in GROUPS):
                c.kill(rng.choice(GROUPS))
        while c.running() and time.monotonic() - started < timeout:
            time.sleep(0.2)
            c.watch()
        c.watch()
    finally:
        c.close()
    outcomes = [o for o, _, _ in c.rounds.values()]
    return {"kills": len(c.killed), "coordinator_kills": 0, "killed": c.killed, "recoveries": sorted(c.recoveries),
            "rounds": {"commit": outcomes.count("commit"), "discard": outcomes.count("discard")},
            "committed": {str(r): (s, ids) for r, (o, s, ids) in c.rounds.items() if o == "commit"},
            "discarded": {str(r): (s, ids) for r, (o, s, ids) in c.rounds.items() if o != "commit"},
            "kill_rounds": c.kill_rounds,
            "procs": {g: [[p.returncode for p in gen] for gen in c.procs[g]] for g in GROUPS},
            "seconds": time.monotonic() - started, "dir": workdir, "total": c.total, "state_bytes": None,
            "recovery_bytes": received_bytes(c), "zero": zero or 0}


def received_bytes(c: GroupChaos) -> list[int]:
    """Each recovery's bytes, as its group's rank 0 said them: what the store handed its lanes (measured, not sized)."""
    said = []
    for gid in GROUPS:
        for n in range(len(c.procs[gid])):
            with open(c.log(gid, n, 0), errors="replace") as f:
                said += [int(line.rsplit(": ", 1)[1].split()[0]) for line in f
                         if "received its state over its" in line and line.rstrip().endswith(" bytes")]
    return said


def check_groups(summary: dict, reference: dict | None = None) -> list[str]:
    """What is wrong with the group run `summary` describes (an empty list: nothing)."""
    problems, total, workdir = [], summary["total"], summary["dir"]
    steps: dict[int, list[int]] = {}
    for r, (step, _) in summary["committed"].items():
        steps.setdefault(step, []).append(int(r))
    problems += [f"step {s} was committed in {len(rs)} rounds: {sorted(rs)}" for s, rs in sorted(steps.items())
                 if len(rs) > 1]
    missing = sorted(set(range(total)) - set(steps))
    if missing or max(steps, default=-1) >= total:
        problems.append(f"steps not committed: {missing[:10]}{'...' if len(missing) > 10 else ''}")
    killed = {(g, n, rank) for g, n, rank in summary["killed"]}
    for gid, generations in summary["procs"].items():
        for n, codes in enumerate(generations):
            for rank, code in enumerate(codes):
                with open(os.path.join(workdir, f"{gid}{n}-{rank}.log"), errors="replace") as f:
                    last = (f.read().strip().splitlines() or [""])[-1]
                if n == len(generations) - 1:
                    if code != 0:
                        problems.append(f"group {gid}'s last rank {rank} ended with {code}: {last}")
                elif (gid, n, rank) in killed:
                    if code != -signal.SIGKILL:
                        problems.append(f"group {gid}'s killed rank {rank} (start {n}) ended with {code}")
                elif code == 0 or "another rank of the group failed" not in last:
                    problems.append(f"group {gid}'s rank {rank} (start {n}) ended with {code}, not naming the "
                                    f"broken group: {last}")
    finals = {}
    for gid in summary["procs"]:
        path = os.path.join(workdir, f"{gid}.json")
        if os.path.exists(path):
            with open(path) as f:
                finals[gid] = json.load(f)
        else:
            problems.append(f"group {gid} wrote no --json: its last ranks did not train to the end")
    for gid, h in finals.items():  # a group started again received rank 0's state from a survivor's rank 0
        sources = [r["source"] for r in h["config"]["fault_tolerant"]["recoveries"]]
        from_others = [s for s in sources if s.endswith("/lane/0") and not s.startswith(f"{gid}/")]
        if len(summary["procs"][gid]) > 1 and not from_others:
            problems.append(f"group {gid} was started again but its rank 0 received no state from another group's "
                            f"rank 0: {sources}")
    shas = {g: h["config"]["fault_tolerant"]["parameters_sha256"] for g, h in finals.items()}
    if len(set(shas.values())) > 1:
        problems.append(f"the groups' final parameters differ: {shas}")
    if reference is not None and finals:
        problems += against_reference(next(iter(finals.values())), reference)
    return problems
