"""Two machines, simulated: two torchrun invocations (--nnodes 2, --node-rank 0/1) on 127.0.0.1, c10d rendezvous."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
SMALL = ["--no-progress", "--num-train", "256", "--num-test", "64", "--batch-size", "32", "--model", "mlp"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(port, *train_args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    common = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"faults{port}", "--max-restarts", "0"]
    procs = []
    for n in (0, 1):
        procs.append(subprocess.Popen([*common, "--node-rank", str(n), "-m", "manualdp", "train", *SMALL, *train_args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
        time.sleep(3)  # node 0 first: its agent hosts the c10d store, as the machine named in --rdzv-endpoint would
    return procs


def _end(procs, timeout):
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            # torchrun's workers may sit in their own groups: end the whole tree, children first.
            tree = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
            for pid in [*map(int, tree), p.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            outs.append(p.communicate())
    return outs


def test_two_nodes_of_two_ranks_train_end_to_end():
    procs = _nodes(_free_port(), "--epochs", "1", "--timeout", "20")
    (out0, err0), (out1, err1) = _end(procs, 150)
    assert [p.returncode for p in procs] == [0, 0], err0[-2000:] + err1[-2000:]
    assert "sec/epoch on 4 processes" in out0 + out1 and "on 4 ranks" in out0 + out1



@pytest.mark.soak  # about 20 s: bench/soak_tests.sh runs it
def test_a_node_killed_mid_run_is_named_by_the_other_and_both_resume_bitwise(tmp_path):
    """Two nodes of one rank (bench/faults.py runs two of two): node 1's agent and worker get SIGKILL after a
    checkpoint."""
    import re

    from bench.nodes import kill_node_and_resume

    r = kill_node_and_resume(str(tmp_path), nproc=1, num_train=512, every=4)
    assert len(r["lost"]) == 1, r
    lost, survivor = r["lost"][0], 1 - r["lost"][0]
    # The surviving worker: one line, naming the dead peer as dead (not its timeout), and a failed exit.
    assert r["survivor_rc"] not in (0, None), r
    assert len(r["survivor_errors"]) == 1, r
    lines = r["survivor_errors"][0].strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"manualdp train: error: rank {survivor}: step "), lines
    assert f"no answer from rank {lost}: the connection was closed" in lines[0], lines
    assert r["seconds_to_exit"] < 30, r  # --timeout is 30 s: the death was seen, not waited out
    # Both nodes again with --resume: from a step mid-run, ending bitwise where the straight run ends.
    assert r["rcs"] == [0, 0, 0, 0], r
    step = int(re.search(r"\(epoch \d+, step (\d+)\)", r["resumed_from"]).group(1))
    assert 0 < step < r["steps"] == 32, r
    assert r["history_equal"] and r["state_equal"], r


def test_the_two_node_harness_refuses_bad_arguments_before_starting_anything(tmp_path):
    import pytest

    from bench.nodes import kill_node_and_resume, start_nodes
    with pytest.raises(ValueError, match="nproc must be an int >= 1 and <= 2, got 3"):
        start_nodes(["--epochs", "1"], 3, str(tmp_path))
    with pytest.raises(ValueError, match="log_dir must not be empty"):
        start_nodes(["--epochs", "1"], 1, "")
    with pytest.raises(ValueError, match="every"):
        kill_node_and_resume(str(tmp_path), nproc=1, every=0)
    with pytest.raises(ValueError, match="limit"):
        kill_node_and_resume(str(tmp_path), nproc=1, limit=float("inf"))
    assert list(tmp_path.iterdir()) == []  # nothing was started, nothing written
