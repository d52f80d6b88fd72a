"""`manualdp coordinator` and `manualdp train --fault-tolerant` replicas as subprocesses, watched through the store."""
import contextlib
import io
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import torch

from manualdp.spmd.ft import keys
from manualdp.spmd.ft.keys import PREFIX
from manualdp.spmd.ft.quorum import Quorum

ROOT = pathlib.Path(__file__).resolve().parents[3]
# a tiny run: 8 steps an epoch, float32 MLP; short deadlines, so that a fault costs seconds
RUN = ["--model", "mlp", "--num-train", "256", "--num-test", "64", "--batch-size", "32", "--lr", "0.1",
       "--no-progress"]


def manualdp(args: list[str], log: pathlib.Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "manualdp", *args], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


class Run:
    """A coordinator process, replica processes started by the same command line, and a view of the store."""

    def __init__(self, tmp: pathlib.Path, epochs: int, timeout: float = 20, min_replicas: int = 2):
        self.tmp, self.procs, self.replicas = tmp, [], {}
        self.coordinator = manualdp(["coordinator", "--port", "0"], tmp / "coordinator.log")
        self.procs.append(self.coordinator)
        line = self.wait("the coordinator's first line", lambda: (tmp / "coordinator.log").read_text())
        self.port = int(line.split("127.0.0.1:")[1].split(";")[0])
        client = torch.distributed.TCPStore("127.0.0.1", self.port, is_master=False)
        self.store = torch.distributed.PrefixStore(PREFIX, client)
        self.options = [*RUN, "--epochs", str(epochs), "--timeout", str(timeout), "--min-replicas", str(min_replicas)]

    def command(self, rid: str) -> list[str]:
        return ["train", "--fault-tolerant", f"127.0.0.1:{self.port}", "--replica-id", rid, *self.options,
                "--json", str(self.tmp / f"{rid}.json")]

    def start(self, rid: str) -> subprocess.Popen:
        n = sum(1 for r in self.replicas.get(rid, []))
        proc = manualdp(self.command(rid), self.tmp / f"{rid}-{n}.log")
        self.replicas.setdefault(rid, []).append(proc)
        self.procs.append(proc)
        return proc

    def key(self, key: str) -> bytes | None:
        return self.store.get(key) if self.store.check([key]) else None

    def rounds(self) -> list[tuple[list[str], str | None]]:
        """Every decided round so far: (its members, its outcome or None)."""
        latest = self.key("latest")
        out = []
        for r in range(1, int(latest) + 1 if latest else 1):
            quorum = self.key(f"round/{r}/quorum")
            if quorum is not None:
                outcome = self.key(f"round/{r}/outcome")
                out.append((json.loads(quorum)["members"], outcome.decode() if outcome else None))
        return [([m["id"] for m in members], outcome) for members, outcome in out]

    def committed_steps(self) -> list[tuple[int, list[str]]]:
        """(step, members) of every round the coordinator's store says was committed, in round order."""
        out, r = [], 1
        latest = int(self.key("latest") or 0)
        while r <= latest or self.key(f"round/{r}/quorum") is not None:
            raw = self.key(f"round/{r}/quorum")
            if raw is not None and self.key(f"round/{r}/outcome") == b"commit":
                quorum = Quorum.from_json(raw)
                out.append((quorum.step, quorum.ids))
            r += 1
        return out

    def committed_with(self, members: list[str]) -> int:
        return sum(1 for ids, outcome in self.rounds() if ids == members and outcome == "commit")

    @contextlib.contextmanager
    def a_and_b_held(self):
        """Start a and b, let them commit 2 steps together, and hold both (SIGSTOP) for the block: a joiner comes
        before the run ends."""
        for rid in "ab":
            self.start(rid)
        self.wait("2 steps committed by a and b", lambda: self.committed_with(["a", "b"]) >= 2)
        held = [self.replicas[rid][0] for rid in "ab"]
        for p in held:
            os.kill(p.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for p in held:
                os.kill(p.pid, signal.SIGCONT)

    def kill_while_held(self, victims: list[subprocess.Popen], held: list[subprocess.Popen], what: str,
                        condition) -> None:
        """Once `condition` holds, stop `held` (SIGSTOP) at once, kill `victims` (SIGKILL), then let the rest go on.

        With the replicas held the run cannot end before the kill lands, however loaded the machine
        (a kill that came after the last step would test nothing: the run ended, and a replica started
        again is told so).
        """
        deadline = time.monotonic() + 60.0
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} within 60 s; logs:\n{self.logs()}")
            time.sleep(0.005)
        for p in held:
            os.kill(p.pid, signal.SIGSTOP)
        try:
            assert self.key(keys.FINISHED) is None, f"the run ended before the kill ({what}); logs:\n{self.logs()}"
            for p in victims:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=10)
        finally:
            for p in held:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGCONT)

    def registrations(self) -> int:
        raw = self.key("replicas")
        return len(raw.decode().split()) if raw else 0

    def wait(self, what: str, condition, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} within {timeout} s; logs:\n{self.logs()}")
            time.sleep(0.05)

    def finish(self, timeout: float = 90.0) -> dict[str, dict]:
        """Wait for the replicas' last processes to end with 0; each replica's --json."""
        deadline = time.monotonic() + timeout
        for rid, procs in self.replicas.items():
            try:
                code = procs[-1].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"replica {rid} did not finish within {timeout} s; logs:\n{self.logs()}") from None
            assert code == 0, f"replica {rid} exited with {code}; logs:\n{self.logs()}"
        missing = [rid for rid in self.replicas if not (self.tmp / f"{rid}.json").exists()]
        assert not missing, f"replica(s) {missing} exited 0 without writing --json; logs:\n{self.logs()}"
        return {rid: json.loads((self.tmp / f"{rid}.json").read_text()) for rid in self.replicas}

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("*.log")))

    def close(self) -> None:
        for proc in self.procs[1:]:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.store = None
        if self.coordinator.poll() is None:
            self.coordinator.send_signal(signal.SIGTERM)  # the command's own way to end
            try:
                self.coordinator.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.coordinator.pid, signal.SIGKILL)
                self.coordinator.wait(timeout=10)


@contextlib.contextmanager
def run(tmp: pathlib.Path, **kw):
    r = Run(tmp, **kw)
    try:
        yield r
    finally:
        r.close()


def reference(tmp: pathlib.Path, epochs: int) -> dict:
    """The same run in one process on one device (`manualdp train --devices 1`): its --json."""
    from manualdp.runners.cli import main

    out = tmp / "reference.json"
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["train", "--devices", "1", "--cpu", *RUN, "--epochs", str(epochs), "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)  # the command sets it for its process
    return json.loads(out.read_text())


def check_against_reference(results: dict[str, dict], ref: dict) -> None:
    """Every replica ends bitwise like the others, and like the one-process run to float rounding."""
    first = next(iter(results.values()))
    for rid, h in results.items():
        ft = h["config"]["fault_tolerant"]
        assert ft["parameters_sha256"] == first["config"]["fault_tolerant"]["parameters_sha256"], rid
        assert (h["train_loss"], h["train_acc"], h["test_acc"]) == (
            first["train_loss"], first["train_acc"], first["test_acc"]), rid
    torch.testing.assert_close(torch.tensor(first["train_loss"]), torch.tensor(ref["train_loss"]), rtol=1e-5, atol=0)
    assert first["test_acc"] == ref["test_acc"]


def committed(results: dict[str, dict]) -> dict[int, list[str]]:
    """step -> its members, for every committed step of any replica, checked to agree across them."""
    steps: dict[int, list[str]] = {}
    for rid, h in results.items():
        for r in h["config"]["fault_tolerant"]["steps"]:
            if r["committed"]:
                assert steps.setdefault(r["step"], r["members"]) == r["members"], (rid, r)
    return steps
