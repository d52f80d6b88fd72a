"""Two machines, simulated: two torchrun agents on 127.0.0.1 (c10d rendezvous), one of them killed whole.

    python bench/faults.py --only node     # the full case: 2 nodes of 2 ranks

`kill_node_and_resume` runs `manualdp train` three times on two "nodes" sharing one
checkpoint folder: straight through; again until every rank has saved a checkpoint, when
the second node's agent and workers get SIGKILL together (a machine gone); then both nodes
with `--resume`. It reports what the surviving node's workers said and whether
the resumed run ends bitwise where the straight one does.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

import torch

from manualdp.support.checkpoint import read_checkpoint
from manualdp.validate import int_between, non_empty_path, positive_int, positive_number

__all__ = ["start_nodes", "kill_node", "end_nodes", "worker_stderr", "kill_node_and_resume", "classify"]

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(train_args: list[str], nproc: int, log_dir: str) -> list[subprocess.Popen]:
    """Start `manualdp train train_args` as two torchrun nodes of `nproc` ranks; each worker's output goes
    under `log_dir`.

    Node 0 hosts the c10d store (`is_host=1`), as the machine named in `--rdzv-endpoint`
    would; node 1 only connects to it (`is_host=0`), so both start at once and killing node 1
    never takes the store down. Each agent leads a session of its own, and its workers lead
    theirs (torchrun starts them so), as on separate machines.
    """
    int_between("nproc", nproc, 1, 2)
    non_empty_path("log_dir", log_dir)
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    for node in (0, 1):
        cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"nodes{port}", "--rdzv-conf",
               f"is_host={int(node == 0)}", "--max-restarts", "0",
               "--log-dir", os.path.join(log_dir, f"node{node}"), "--redirects", "3",
               "-m", "manualdp", "train", *train_args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    return procs


def _workers(agent: subprocess.Popen) -> dict[int, int]:
    """The agent's worker processes: pid -> global rank."""
    found = {}
    for pid in subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split():
        with contextlib.suppress(OSError):
            env = dict(v.split("=", 1) for v in open(f"/proc/{pid}/environ").read().split("\0") if "=" in v)
            if "RANK" in env:
                found[int(pid)] = int(env["RANK"])
    return found


def kill_node(agent: subprocess.Popen) -> list[int]:
    """A machine gone: stop the agent and its workers at once, then SIGKILL them; their global ranks."""
    workers = _workers(agent)
    pids = [agent.pid, *workers]
    for sig in (signal.SIGSTOP, signal.SIGKILL):  # stopped first: none of them sees the others die
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    agent.communicate()
    return sorted(workers.values())


def end_nodes(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """Each node's (stdout, stderr); a node still running after `timeout` seconds is killed whole."""
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            kill_node(p)
            outs.append(("", "killed: still running after the timeout"))
    return outs


def worker_stderr(log_dir: str, node: int) -> list[str]:
    """The stderr of each worker of `node` (in local-rank order), from torchrun's --log-dir."""
    files = glob.glob(os.path.join(log_dir, f"node{node}", "**", "stderr.log"), recursive=True)
    return [open(f).read() for f in sorted(files, key=lambda f: int(os.path.basename(os.path.dirname(f))))]


def _final_state(ckpt: str) -> dict:
    """Rank 0's last checkpoint: the model and optimizer a run ended with."""
    newest = max(glob.glob(os.path.join(ckpt, "rank0", "ckpt-*-epoch.pt")))
    state = read_checkpoint(newest)
    return {"model": state["model"], "optimizer": state["optimizer"]["state"], "step": state["global_step"]}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def kill_node_and_resume(tmp: str, nproc: int = 2, num_train: int = 512, every: int = 4, limit: float = 120.0) -> dict:
    """Straight run, node 1 killed after its first checkpoint, resume on both nodes: what each showed.

    Returns `lost` (the killed ranks), `survivor_rc` and `survivor_errors` (node 0's agent exit
    status and each of its workers' stderr), `seconds_to_exit` (kill to node 0's exit),
    `resumed_from` (the resumed run's line saying so), `rcs` (straight and resumed runs, both
    nodes), `history_equal` and `state_equal` (bitwise, the JSON histories and rank 0's final
    model and optimizer state), `steps` (the straight run's).
    """
    non_empty_path("tmp", tmp)
    int_between("nproc", nproc, 1, 2)
    positive_int("num_train", num_train)
    positive_int("every", every)
    positive_number("limit", limit, finite=True)
    args = ["--no-progress", "--model", "mlp", "--num-train", str(num_train), "--num-test", "64", "--batch-size", "32",
            "--epochs", "2", "--algorithm", "ring", "--threads", "1", "--timeout", "30",
            "--checkpoint-every", str(every)]
    straight_dir, ckpt = os.path.join(tmp, "straight"), os.path.join(tmp, "ckpt")
    straight_json, resumed_json = os.path.join(tmp, "straight.json"), os.path.join(tmp, "resumed.json")
    out: dict = {}

    straight = start_nodes([*args, "--checkpoint-dir", straight_dir, "--json", straight_json], nproc,
                           os.path.join(tmp, "logs-straight"))
    # The victim starts beside the straight run: the two share the cores, which only slows both.
    victim_logs = os.path.join(tmp, "logs-victim")
    victim = start_nodes([*args, "--checkpoint-dir", ckpt], nproc, victim_logs)
    deadline = time.monotonic() + limit
    # c10d hands out the ranks in order of arrival: wait until every rank has saved, whichever node it is on.
    while len({os.path.dirname(f) for f in glob.glob(os.path.join(ckpt, "rank*", "ckpt-*.pt"))}) < 2 * nproc:
        if victim[1].poll() is not None or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    out["lost"] = kill_node(victim[1])
    killed = time.monotonic()
    try:
        victim[0].communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_node(victim[0])
    out["seconds_to_exit"] = time.monotonic() - killed
    out["survivor_rc"] = victim[0].returncode
    out["survivor_errors"] = worker_stderr(victim_logs, 0)
    end_nodes(straight, limit)
    straight_rcs = [p.returncode for p in straight]

    resumed_logs = os.path.join(tmp, "logs-resumed")
    resumed = start_nodes([*args, "--checkpoint-dir", ckpt, "--resume", "--json", resumed_json], nproc, resumed_logs)
    end_nodes(resumed, limit)
    out["rcs"] = straight_rcs + [p.returncode for p in resumed]
    stdout = "".join(open(f).read() for f in glob.glob(os.path.join(resumed_logs, "**", "stdout.log"), recursive=True))
    out["resumed_from"] = next((line for line in stdout.splitlines() if line.startswith("resumed from")), None)
    if out["rcs"] != [0, 0, 0, 0]:
        out["history_equal"] = out["state_equal"] = False
        out["errors"] = [e[-1000:] for n in (0, 1) for e in worker_stderr(resumed_logs, n)]
        return out
    with open(straight_json) as f, open(resumed_json) as g:
        a, b = json.load(f), json.load(g)
    out["history_equal"] = all(a[k] == b[k] for k in ("train_loss", "train_acc", "test_acc"))
    x, y = _final_state(straight_dir), _final_state(ckpt)
    out["steps"] = x["step"]
    out["state_equal"] = _equal(x, y)
    return out


def classify(result: dict) -> str:
    """The fault table's word for `kill_node_and_resume`'s result."""
    if result["survivor_rc"] is None or result["seconds_to_exit"] > 60:
        return "hang"
    errors = [e.strip().splitlines() for e in result["survivor_errors"]]
    named = all(len(lines) == 1 and "error:" in lines[0] and any(f"rank {r}" in lines[0] for r in result["lost"])
                for lines in errors)
    if result["survivor_rc"] == 0 or not errors or not named:
        return "crash" if any("Traceback" in e for e in result["survivor_errors"]) else "silent"
    if result["rcs"] != [0, 0, 0, 0]:
        return "crash"
    return "handled" if result["history_equal"] and result["state_equal"] else "silent"
