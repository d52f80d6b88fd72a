"""One `LocalSGD` replica whose parameters the local step sets to V exactly (test_ft_overflow.py's soak).

    python -m tests.spmd.ft.local_overflow_worker ID PORT DTYPE V OUT MIN_REPLICAS
"""
import json
import sys

import torch
from torch import nn

from manualdp.spmd.ft import LocalSGD, Manager
from tests.spmd.ft.test_ft_leave_group import gloo_threads


def main(rid: str, port: int, dtype: str, v: float, out: str, min_replicas: int) -> None:
    """Up to 3 attempts at one synced step whose parameters are `v`; what happened into `out`."""
    torch.set_num_threads(1)
    dt = getattr(torch, dtype)
    net = nn.Linear(4, 1, bias=False).to(dt)
    committed = []
    with Manager(rid, "127.0.0.1", port, min_replicas=min_replicas, timeout=60, quorum_timeout=60) as manager:
        local = LocalSGD(net, torch.optim.SGD(net.parameters(), lr=0.0), manager, 1)
        while len(committed) < 3 and True not in committed:
            local.start_step()
            local(torch.ones(2, 4, dtype=dt)).sum().backward()
            with torch.no_grad():
                net.weight.fill_(v)  # what the local steps made of the parameters
            committed.append(local.step())
    threads = gloo_threads()  # after the Manager closed: none, or one left for the exit
    with open(out, "w") as f:
        json.dump({"gloo_threads": threads, "committed": committed, "weight": net.weight.flatten().tolist()}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
