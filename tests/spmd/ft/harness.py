"""Starting, watching and killing the replicas of `replica.py`, the single-process reference they must equal, and
`member`, a replica as it asks for a quorum."""
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import torch

from manualdp.spmd.ft import Coordinator, Member, keys
from manualdp.spmd.ft.keys import PREFIX
from tests.spmd.ft.replica import build, make_optimizer, my_shard

ROOT = pathlib.Path(__file__).resolve().parents[3]
FAST = {"timeout": 20, "quorum_timeout": 5, "heartbeat_timeout": 1.0}


def guard_bytes(members: int) -> float:
    """What the contribution guard's exchange sends per average: one float64 norm a member, by the ring."""
    return 2 * (members - 1) / members * 8 * members


def member(rid: str, step: int = 0, synced: bool = True, group=None, min_replicas: int = 1, since: int = 0) -> Member:
    """What replica `rid` says of itself when it asks for a quorum."""
    return Member(rid, step, synced, group, min_replicas, since)


class Replicas:
    """A coordinator in this process and replica processes, each killed at the end whatever happened."""

    def __init__(self, tmp_path: pathlib.Path) -> None:
        self.tmp = tmp_path
        self.coordinator = Coordinator(0)
        self.store = torch.distributed.TCPStore("127.0.0.1", self.coordinator.port, is_master=False)
        self.procs: list[subprocess.Popen] = []
        self.outs: dict[str, list[pathlib.Path]] = {}

    def start(self, **config) -> subprocess.Popen:
        n = len(self.outs.setdefault(config["id"], []))
        out = self.tmp / f"{config['id']}-{n}.json"
        self.outs[config["id"]].append(out)
        config = {**FAST, **config, "port": self.coordinator.port, "out": str(out)}
        log = open(self.tmp / f"{config['id']}-{n}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "tests.spmd.ft.replica", json.dumps(config)], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def start_together(self, configs: list[dict]) -> None:
        """Start a replica for each config, held until all have registered: their first quorum is them all.

        Started one by one, a replica slow to start registers after the others have asked, and
        they form the first quorum without it (they wait only for replicas registered and live).
        """
        before = self.registrations()
        for config in configs:
            self.start(**config, hold=True)
        self.wait("every replica registered", lambda: self.registrations() == before + len(configs))
        self.set("start", "1")

    def key(self, key: str) -> bytes | None:
        """A key of the fault-tolerant room's store, or None."""
        key = f"{PREFIX}/{key}"
        return self.store.get(key) if self.store.check([key]) else None

    def records(self, rid: str, n: int = 0) -> list[dict]:
        """What the `n`-th process of replica `rid` has done so far: its records, written line by line."""
        path = self.outs[rid][n].with_suffix(".jsonl")
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def set(self, key: str, value: str) -> None:
        self.store.set(f"{PREFIX}/{key}", value)

    def registrations(self) -> int:
        """How many times a replica has registered (a restarted one counts again)."""
        raw = self.key("replicas")
        return len(raw.decode().split()) if raw else 0

    def asking(self, rid: str) -> bool:
        """Whether the process now beating as `rid` has asked in the first round not yet decided: it waits there.

        Registered is not enough: a replica is in a quorum only once it has asked (quorum.py), and the
        others wait for a live one that has not asked only `quorum_timeout` s, which a loaded machine may
        spend between its registration and its first ask. Nothing is decided while the others are paused,
        so they ask in the same round, and `decide` waits for every live replica there: it is in.
        """
        beat = self.key(keys.heartbeat(rid))
        latest = self.key(keys.LATEST)
        round_ = int(latest) + 1 if latest else 1
        while self.key(keys.quorum(round_)) is not None:
            round_ += 1
        asks = self.key(keys.asks(round_))
        if beat is None or asks is None:
            return False
        nonce = beat.decode().split()[0]
        lines = [json.loads(line) for line in asks.decode().splitlines() if line.strip()]
        return any(x.get("id") == rid and x.get("nonce") == nonce for x in lines)

    def wait(self, what: str, condition, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} within {timeout} s; logs: {self.logs()}")
            time.sleep(0.05)

    def finish(self, timeout: float = 60.0) -> dict[str, list[dict]]:
        """Wait for every replica to end; return each id's results, one per start, in order ."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"a replica did not finish within {timeout} s; logs: {self.logs()}") from None
        return {r: [read(o) for o in outs] for r, outs in self.outs.items()}

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("*.log")))

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # also a stopped one: SIGKILL needs no SIGCONT
                proc.wait(timeout=10)
        self.store = None
        self.coordinator.close()


def read(out: pathlib.Path) -> dict:
    """What a replica wrote: its summary (or {} if it was killed) with the records it wrote line by line."""
    lines = pathlib.Path(str(out) + "l")
    records = [json.loads(x) for x in lines.read_text().splitlines()] if lines.exists() else []
    return {**(json.loads(out.read_text()) if out.exists() else {}), "records": records}


@contextlib.contextmanager
def replicas(tmp_path):
    run = Replicas(tmp_path)
    try:
        yield run
    finally:
        run.close()


def committed_steps(results: dict[str, list[dict]]) -> dict[int, dict]:
    """batch -> {members, sha256 per replica} of every committed DDP step, checked to agree across the replicas."""
    steps: dict[int, dict] = {}
    for rid, runs in results.items():
        for result in runs:
            for r in result["records"]:
                if not r["committed"]:
                    continue
                seen = steps.setdefault(r["batch"], {"members": r["members"], "sha256": {}})
                assert seen["members"] == r["members"], (r["batch"], seen["members"], r["members"])
                seen["sha256"][rid] = r["sha256"]
    return steps


def agreed_steps(results: dict[str, list[dict]], total: int | None = None) -> dict[int, dict]:
    """`committed_steps`, each checked bitwise alike on every member that took it; with `total`, steps 0 to total-1."""
    steps = committed_steps(results)
    if total is not None:
        assert sorted(steps) == list(range(total)), sorted(steps)
    for s, seen in steps.items():
        assert len(set(seen["sha256"].values())) == 1, (s, seen)
        assert set(seen["sha256"]) == set(seen["members"]), (s, seen)
    return steps


def reference_ddp(steps: dict[int, dict], seed: int, config: dict) -> torch.Tensor:
    """One process, one model: at each committed step, the mean over that step's members of their shards' gradients."""
    model = build(seed)
    optimizer = make_optimizer(model.parameters(), config)
    index = {"a": 0, "b": 1, "c": 2}
    for b in range(len(steps)):
        grads = []
        for member in steps[b]["members"]:
            model.zero_grad()
            X, y = my_shard(b, index[member])
            ((model(X) - y) ** 2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for k, p in enumerate(model.parameters()):
            p.grad = sum(g[k] for g in grads) / len(grads)
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
