"""One `FaultTolerantDDP` replica whose gradients are set exactly (test_ft_overflow.py's soak).

    python -m tests.spmd.ft.overflow_worker ID PORT DTYPE G OUT [MIN_REPLICAS]
"""
import json
import sys

import torch

from manualdp.spmd.ft import FaultTolerantDDP, Manager
from tests.spmd.ft.test_ft_overflow import Pair
from tests.spmd.ft.test_ft_leave_group import gloo_threads


def main(rid: str, port: int, dtype: str, g: float, out: str, min_replicas: int = 2) -> None:
    """Up to 3 attempts at one step whose gradients are `g` and 1; what happened into `out`."""
    torch.set_num_threads(1)
    dt = getattr(torch, dtype)
    net = Pair(dt)
    committed = []
    with Manager(rid, "127.0.0.1", port, min_replicas=min_replicas, timeout=60, quorum_timeout=60) as manager:
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=1.0), manager, bucket_cap_mb=None)
        while len(committed) < 3 and True not in committed:
            ft.start_step()
            ft(torch.tensor([[g] * 3, [1.0] * 3], dtype=dt)).backward()
            committed.append(ft.step())
        step = manager.step
    threads = gloo_threads()  # after the Manager closed: none, or one left for the exit
    with open(out, "w") as f:
        json.dump({"gloo_threads": threads, "committed": committed, "step": step, "p0": net.p0.tolist(),
                   "p1": net.p1.tolist()}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5], *map(int, sys.argv[6:]))
