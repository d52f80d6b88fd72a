"""Chaos for a fault-tolerant run: replicas killed (SIGKILL) at random while they train, the coordinator once.

    python bench/ft_chaos.py                 # about 100 kills
    python bench/ft_chaos.py --quick         # about 10 kills, under 2 minutes
    python bench/ft_chaos.py --kills 40 --epochs 30 --json chaos.json
    python bench/ft_chaos.py --group-size 2 --kills 100   # 2 groups of 2 ranks: bench/ft_chaos_groups.py
    python bench/ft_chaos.py --group-size 2 --kills 3 --epochs 2 --plot groups.png  # the membership, drawn
    python bench/ft_chaos.py --group-size 2 --zero 3 --kills 100   # groups sharded within (fault-tolerant HSDP)

Starts `manualdp coordinator` and 3 replicas (`manualdp train --fault-tolerant ... --checkpoint-dir`)
as processes, then kills a random replica every 0.3-2.5 s (two at once one time in five) and
starts it again at once with the same command; half-way it kills the coordinator, starts it
again on the same port, and starts again the replicas that left when they lost it. The kills
stop when `--kills` are done or the run has ended; then every replica runs to its end. A kill picks
among the replicas that have joined the run or have had about the time to (a process still starting
has nothing to lose), so kills land in steps, votes and recoveries.

Checked at the end (a line each, and the exit status 1 if one fails):
- every step of the run was committed exactly once: the replicas' histories (`DIR/ID/steps.jsonl`,
  one JSON line per committed step) hold each step, and for each step the same round and members;
- the last process of every replica ended with 0, and each earlier one was killed or left naming
  the lost coordinator (or that it could not reach it while it was down);
- the replicas' final parameters are bitwise equal, and their losses equal the one-process run on
  the same batches (`manualdp train --devices 1`; the split among members rounds differently).

Reported: kills, rounds committed and discarded (read from the store before each coordinator
goes), recovery time (from a kill to the first step the replica's new process commits) p50 and
p99, and the bytes a recovery moves (a committed state's size; for groups, what the store handed the
lanes of the group started again, as its rank 0 says it: with `--zero 3` each lane carries its shard).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from manualdp.support.files import output_problem

__all__ = ["main", "chaos", "check", "against_reference", "start_coordinator"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPLICAS = ("a", "b", "c")
# 64 global batches an epoch of a small float32 MLP; short deadlines, so that a fault costs seconds
RUN = ["--model", "mlp", "--num-train", "2048", "--num-test", "256", "--batch-size", "32", "--lr", "0.05",
       "--no-progress", "--min-replicas", "1", "--timeout", "20"]
STEPS_PER_EPOCH = 64


def _manualdp(args: list[str], log: str, env: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **(env or {}))
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "manualdp", *args], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]  # a line being written is not whole yet
    except FileNotFoundError:
        return []


def start_coordinator(workdir: str, port: int) -> subprocess.Popen:
    """`manualdp coordinator --port PORT`, once it listens (its log: WORKDIR/coordinator.log, appended)."""
    log = os.path.join(workdir, "coordinator.log")
    proc = _manualdp(["coordinator", "--port", str(port)], log)
    deadline = time.monotonic() + 60
    while "listening" not in open(log).read().split("coordinator stopped")[-1]:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the coordinator did not start: {open(log).read()[-2000:]}")
        time.sleep(0.05)
    return proc


class Chaos:
    """The coordinator and replica processes of one run, their kills and restarts, and what the store said."""

    def __init__(self, workdir: str, epochs: int, rng: random.Random) -> None:
        self.dir, self.rng, self.port = workdir, rng, _free_port()
        os.makedirs(workdir, exist_ok=True)
        self.ckpt = os.path.join(workdir, "ckpt")
        self.options = [*RUN, "--epochs", str(epochs), "--checkpoint-dir", self.ckpt]
        self.procs: dict[str, list[subprocess.Popen]] = {r: [] for r in REPLICAS}
        self.coordinators: list[subprocess.Popen] = []
        self.kills, self.rounds = 0, {"commit": 0, "discard": 0}
        self.pending: list[tuple[str, float, int]] = []  # (replica, killed at, its history's length then)
        self.started: dict[str, float] = {}  # when each replica's current process started
        self.startup = 30.0  # seconds a process takes to join, about: measured from the first one
        self.recoveries: list[float] = []
        self.start_coordinator()
        for rid in REPLICAS:
            self.start(rid)

    def start_coordinator(self) -> None:
        self.coordinators.append(start_coordinator(self.dir, self.port))

    def start(self, rid: str) -> None:
        n = len(self.procs[rid])
        args = ["train", "--fault-tolerant", f"127.0.0.1:{self.port}", "--replica-id", rid, *self.options,
                "--json", os.path.join(self.dir, f"{rid}.json")]
        self.procs[rid].append(_manualdp(args, os.path.join(self.dir, f"{rid}-{n}.log")))
        self.started[rid] = time.monotonic()

    def up(self, rid: str) -> bool:
        """Whether replica `rid`'s process has joined the run (or has had time to): a kill then hits its work."""
        log = os.path.join(self.dir, f"{rid}-{len(self.procs[rid]) - 1}.log")
        with open(log, errors="replace") as f:
            joined = "quorum of" in f.read()
        age = time.monotonic() - self.started[rid]
        if joined:
            self.startup = min(self.startup, age)
        return self.procs[rid][-1].poll() is None and (joined or age > self.rng.uniform(0.5, 1.5) * self.startup)

    def history(self, rid: str) -> list[dict]:
        return _lines(os.path.join(self.ckpt, rid, "steps.jsonl"))

    def kill(self, rid: str) -> None:
        proc = self.procs[rid][-1]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            self.kills += 1
            self.pending.append((rid, time.monotonic(), len(self.history(rid))))
            self.start(rid)

    def tally(self) -> None:
        """Count the rounds the store decided (before its coordinator goes: a new one starts empty)."""
        store = torch.distributed.PrefixStore("manualdp-ft", torch.distributed.TCPStore(
            "127.0.0.1", self.port, is_master=False, timeout=datetime.timedelta(seconds=10)))
        latest = int(store.get("latest")) if store.check(["latest"]) else 0
        for r in range(1, latest + 1):
            key = f"round/{r}/outcome"
            if store.check([key]):
                outcome = "commit" if b"commit" in store.get(key) else "discard"
                self.rounds[outcome] += 1

    def kill_coordinator(self) -> None:
        self.tally()
        coordinator = self.coordinators[-1]
        os.killpg(coordinator.pid, signal.SIGKILL)
        coordinator.wait()
        for rid in REPLICAS:  # those that lost it leave, naming it; started again, they go on from the disk
            try:
                self.procs[rid][-1].wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill(rid)
        self.start_coordinator()
        for rid in REPLICAS:
            if self.procs[rid][-1].poll() is not None and self.procs[rid][-1].returncode != 0:
                self.start(rid)

    def watch(self) -> None:
        """Note recoveries; start again a replica that left with an error (a lost coordinator, a failed join)."""
        for rid, killed, before in list(self.pending):
            if len(self.history(rid)) > before:
                self.recoveries.append(time.monotonic() - killed)
                self.pending.remove((rid, killed, before))
        for rid in REPLICAS:
            code = self.procs[rid][-1].poll()
            if code not in (None, 0):
                self.start(rid)

    def ended(self) -> bool:
        return any(os.path.exists(os.path.join(self.ckpt, r, "finished.json")) for r in REPLICAS)

    def finish(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(self.procs[r][-1].poll() is None for r in REPLICAS) and time.monotonic() < deadline:
            self.watch()
            time.sleep(0.1)
        self.watch()

    def close(self) -> None:
        for proc in [p for ps in self.procs.values() for p in ps] + self.coordinators:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def chaos(workdir: str, kills: int, epochs: int, seed: int = 0, progress: bool = True,
          coordinator: bool = True, timeout: float = 600) -> dict:
    """Run the chaos in `workdir`; a summary: counts, recovery times, and what `check` needs."""
    from tqdm.auto import tqdm

    rng, started = random.Random(seed), time.monotonic()
    c = Chaos(workdir, epochs, rng)
    try:
        bar = tqdm(total=kills, desc="kills", disable=not progress, dynamic_ncols=True)
        while not any(c.history(r) for r in REPLICAS) and time.monotonic() - started < timeout / 2:
            time.sleep(0.1)  # the first step committed: the run is under way
        while c.kills < kills and not c.ended() and time.monotonic() - started < timeout:
            time.sleep(rng.uniform(0.3, 2.5))
            c.watch()
            if coordinator and c.kills >= kills // 2 and len(c.coordinators) == 1:
                c.kill_coordinator()
                continue
            up = [r for r in REPLICAS if c.up(r)]  # a process still importing torch has nothing to lose
            for rid in rng.sample(up, min(len(up), 2 if rng.random() < 0.2 else 1)):
                c.kill(rid)
            bar.n = min(c.kills, kills)
            bar.refresh()
        bar.close()
        c.finish(max(60.0, timeout - (time.monotonic() - started)))
        c.tally()
    finally:
        c.close()
    return {"kills": c.kills, "coordinator_kills": len(c.coordinators) - 1, "rounds": c.rounds,
            "recoveries": sorted(c.recoveries), "seconds": time.monotonic() - started,
            "procs": {r: [p.returncode for p in ps] for r, ps in c.procs.items()},
            "histories": {r: c.history(r) for r in REPLICAS}, "dir": workdir,
            "state_bytes": max((os.path.getsize(os.path.join(c.ckpt, r, f)) for r in REPLICAS
                                for f in os.listdir(os.path.join(c.ckpt, r)) if f.endswith(".pt")), default=0)}


def check(summary: dict, epochs: int, reference: dict | None = None) -> list[str]:
    """What is wrong with the run `summary` describes (an empty list: nothing)."""
    problems, total, workdir = [], epochs * STEPS_PER_EPOCH, summary["dir"]
    taken: dict[int, tuple] = {}
    for rid, lines in summary["histories"].items():
        for line in lines:
            first = taken.setdefault(line["step"], (line["round"], line["members"]))
            if first != (line["round"], line["members"]):
                problems.append(f"step {line['step']} was committed twice: round {first[0]} by {first[1]}, "
                                f"round {line['round']} by {line['members']} ({rid}'s history)")
    missing = sorted(set(range(total)) - set(taken))
    if missing or max(taken, default=-1) >= total:
        problems.append(f"steps missing from every history: {missing[:10]}{'...' if len(missing) > 10 else ''}")
    for rid, codes in summary["procs"].items():
        if codes[-1] != 0:
            problems.append(f"replica {rid}'s last process ended with {codes[-1]}")
        for n, code in enumerate(codes[:-1]):
            log = open(os.path.join(workdir, f"{rid}-{n}.log")).read()
            if code != -signal.SIGKILL and not any(w in log for w in ("lost the coordinator",
                                                                       "cannot reach the coordinator")):
                problems.append(f"replica {rid}'s process {n} ended with {code}: {log.strip().splitlines()[-1:]}")
    finals = {}
    for rid in REPLICAS:
        path = os.path.join(workdir, f"{rid}.json")
        if not os.path.exists(path):
            # killed near the end and started again after another replica finished: told so, it exits 0
            last = os.path.join(workdir, f"{rid}-{len(summary['procs'][rid]) - 1}.log")
            if "the run ended at step" not in open(last, errors="replace").read():
                problems.append(f"replica {rid} wrote no --json: its last process did not train to the end")
            continue
        with open(path) as f:
            finals[rid] = json.load(f)
    if not finals:
        problems.append("no replica wrote its --json: none trained to the end")
    shas = {rid: h["config"]["fault_tolerant"]["parameters_sha256"] for rid, h in finals.items()}
    if len(set(shas.values())) > 1:
        problems.append(f"the replicas' final parameters differ: {shas}")
    if reference is not None and finals:
        problems += against_reference(next(iter(finals.values())), reference)
    return problems


def against_reference(first: dict, reference: dict) -> list[str]:
    """What differs between a replica's --json and the one-process run's: losses to float32 rounding, accuracy."""
    got, want = torch.tensor(first["train_loss"]), torch.tensor(reference["train_loss"])
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=0):
        return [f"the losses differ from the one-process run: {first['train_loss']} != {reference['train_loss']}"]
    if first["test_acc"] != reference["test_acc"]:
        return [f"test accuracy differs from the one-process run: {first['test_acc']} != {reference['test_acc']}"]
    return []


def reference_run(workdir: str, epochs: int) -> dict:
    """The same run in one process on one device: its --json."""
    out = os.path.join(workdir, "reference.json")
    run = [a for a in RUN if a not in ("--min-replicas", "1", "--timeout", "20")]
    subprocess.run([sys.executable, "-m", "manualdp", "train", "--devices", "1", "--cpu", *run, "--epochs",
                    str(epochs), "--json", out], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), check=True,
                   stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def report(summary: dict) -> str:
    r, rec = summary["rounds"], summary["recoveries"]
    return (f"kills {summary['kills']} (+ coordinator {summary['coordinator_kills']}), rounds committed "
            f"{r.get('commit', 0)} and discarded {r.get('discard', 0)}, {len(rec)} recoveries: p50 "
            f"{_percentile(rec, 50):.2f} s, p99 {_percentile(rec, 99):.2f} s, "
            f"{_bytes_per_recovery(summary)}, {summary['seconds']:.0f} s in all")


def _bytes_per_recovery(summary: dict) -> str:
    """One-process replicas: a committed state's size; groups: the bytes their lanes received per recovery."""
    got = summary.get("recovery_bytes")
    if got is None:
        return (f"{summary['state_bytes'] if summary['state_bytes'] is not None else 'unmeasured'} bytes per "
                f"recovery (the state)")
    mode = "--zero 3: each lane its shard" if summary.get("zero") == 3 else "each lane the whole model"
    if not got:
        return f"no recovery's bytes said ({mode})"
    return (f"bytes per recovery (received over the lanes, {mode}): p50 {_percentile(got, 50):.0f}, "
            f"max {max(got)} over {len(got)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=100, help="replica kills (default 100)")
    p.add_argument("--epochs", type=int, default=None, help=f"epochs of {STEPS_PER_EPOCH} steps (default: by kills)")
    p.add_argument("--quick", action="store_true", help="about 10 kills, under 2 minutes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=None, help="seconds for the whole run (default: by kills)")
    p.add_argument("--workdir", default=None, help="where the logs and checkpoints go (default: a new temp folder)")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--group-size", type=int, default=1,
                   help="ranks per replica: 2 groups of that many ranks, started as torchrun starts them, one rank "
                        "of one killed at a time (default 1: 3 replicas of one process, the coordinator killed once)")
    p.add_argument("--min-groups", type=int, default=2, choices=(1, 2),
                   help="with --group-size: the groups a step needs (default 2: the survivor waits; 1: it trains on)")
    p.add_argument("--zero", type=int, default=None, choices=(3,),
                   help="with --group-size 2 or more: each group shards the model by fully_shard (fault-tolerant HSDP)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="with --group-size 2 or more: draw the groups in each step's quorum, and the kills, here")
    args = p.parse_args(argv)
    kills = 10 if args.quick else args.kills
    if args.plot is not None and (args.group_size < 2 or output_problem(args.plot) or not args.plot.endswith(".png")):
        p.error(f"--plot {args.plot!r}: " + (output_problem(args.plot) or ("draws replica groups: add --group-size 2"
                                              if args.group_size < 2 else "a PNG: end the name in .png")))
    if args.zero is not None and args.group_size < 2:
        p.error(f"--zero {args.zero}: shards a replica group's model: add --group-size 2")
    if kills < 0:
        p.error(f"--kills must be >= 0, got {kills}")
    if not 1 <= args.group_size <= 4:
        p.error(f"--group-size must be from 1 to 4, got {args.group_size}")
    workdir = args.workdir or tempfile.mkdtemp(prefix="ft-chaos-")
    if args.group_size > 1:  # a group restarts all its ranks (imports included): kills come more slowly
        if not __package__:  # run as `python bench/ft_chaos.py`: `import bench.*` needs the repository root
            sys.path.insert(0, ROOT)
        from bench.ft_chaos_groups import check_groups, group_chaos
        epochs = args.epochs or max(4, kills)
        summary = group_chaos(workdir, kills, epochs, args.group_size, args.seed, min_groups=args.min_groups,
                              timeout=args.timeout or 120 + 20 * kills + 4 * epochs, zero=args.zero)
        problems = check_groups(summary, reference_run(workdir, epochs))
    else:
        epochs = args.epochs or max(2, kills // 4)  # a kill every 1.4 s on average; a quiet epoch takes about 2 s
        summary = chaos(workdir, kills, epochs, args.seed, progress=not args.no_progress,
                        timeout=args.timeout or 60 + 6 * kills + 4 * epochs)
        problems = check(summary, epochs, reference_run(workdir, epochs))
    if args.plot:
        from bench.ft_chaos_plot import plot_membership
        plot_membership(summary, args.plot)
    print(report(summary))
    for line in problems:
        print(f"FAILED: {line}")
    print("every committed step once, replicas equal to each other and to the one-process run, rc 0 everywhere"
          if not problems else f"{len(problems)} problem(s); logs in {workdir}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in summary.items() if k != "histories"} | {"problems": problems}, f, indent=1)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
