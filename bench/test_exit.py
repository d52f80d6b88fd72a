"""A script that trains with the drop-in and just ends aborts at the interpreter's exit no more often than
a plain torch script that does one all_reduce and ends (a soak: `bash bench/soak_tests.sh`).

torch 2.13's gloo itself aborts now and then at the exit of a process that never called
`destroy_process_group` ("terminate called without an active exception"): 9 of 120 processes of
PLAIN below on a busy 2-core machine, so no count of runs proves a script of ours never does.
"""
import os
import socket
import subprocess
import sys

RANK = r'''
import torch, torch.distributed as dist
from torch import nn
torch.set_num_threads(1)
dist.init_process_group("gloo")
from manualdp.spmd import DistributedDataParallel
net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
model = DistributedDataParallel(net)
model(torch.randn(4, 8)).sum().backward()
model(torch.randn(4, 8))  # the last call: the forward's buffer broadcast; then the script ends
'''

PLAIN = r'''
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(8))
'''
RUNS = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _aborts(script, runs: int) -> list:
    """The (return code, stderr tail) of every process of `runs` two-rank runs of `script` that failed."""
    failed = []
    for _ in range(runs):
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                      MASTER_PORT=str(port), OMP_NUM_THREADS="1"))
                 for r in range(2)]
        for p in procs:
            _, err = p.communicate(timeout=120)
            if p.returncode != 0:
                failed.append((p.returncode, err[-300:]))
    return failed


def test_a_script_that_ends_right_after_a_forward_pass_aborts_no_more_than_plain_torch(tmp_path):
    # gloo's thread lets go of a finished broadcast a moment after the wait returns; when its
    # reference to the buffer was the last, freeing it during the interpreter's exit aborted the
    # process in 12 of 100 processes before `broadcast_from_rank0` held it (torch's own DDP: 4 of 40).
    ours, plain = tmp_path / "rank.py", tmp_path / "plain.py"
    ours.write_text(RANK)
    plain.write_text(PLAIN)
    failed, baseline = _aborts(ours, RUNS), _aborts(plain, RUNS)
    assert all(rc == -6 and "terminate called" in err for rc, err in failed + baseline), failed + baseline
    assert len(failed) <= max(2, 2 * len(baseline)), (len(failed), len(baseline), 2 * RUNS)
