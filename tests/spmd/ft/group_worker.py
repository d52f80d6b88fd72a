"""One rank of a replica group in the replica-group tests: `python -m tests.spmd.ft.group_worker CONFIG_JSON`.

Groups "A" and "B" of `size` ranks train a float64 MLP with momentum SGD; step s's global batch
holds a shard per (group, rank) (`shard`), the same whichever groups commit it. Inside a group
the gradients are summed and divided by the group size (plain data parallelism), then averaged
over the lane (`GroupManager.average`). The config: `kill_at` (rank `kill_rank`, the last by default,
SIGKILLs itself in the step of two groups of that index (0: the first), right before the cross-group
average: its peers are in it), `together` (train on until `steps` are committed and this many of them
with two groups after a step alone, or from the start when `rejoin`: a group started again), `sleep`
(seconds per step alone), `pace` (seconds per step, always), `with_group` ([GROUP, N]: train on until N steps
were committed in a quorum with GROUP too), `twice_at` (the last rank runs one backward more in the first
try of that step; `watch`: the manager counts them), `die_on_send` (SIGKILL itself as its lane is about to
send its state for the n-th time: a sender lost during recovery). Each committed step appends a line
to OUT: the step, the member groups, the parameters; the end writes the recoveries (OUT + ".end").
"""
import datetime
import faulthandler
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

GROUPS = ("A", "B", "C")
ROWS = 3  # rows per (group, rank) shard


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def shard(step: int, group: str, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    n = len(GROUPS) * size * ROWS
    X, y = torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64)
    k = (GROUPS.index(group) * size + rank) * ROWS
    return X[k:k + ROWS], y[k:k + ROWS]


def shard_grads(model: nn.Module, step: int, group: str, rank: int, size: int) -> list[torch.Tensor]:
    """This rank's gradients on its shard (the loss summed, divided by the shard's rows)."""
    X, y = shard(step, group, rank, size)
    model.zero_grad()
    ((model(X) - y) ** 2).sum().div(ROWS).backward()
    return [p.grad.clone() for p in model.parameters()]


def die_on_send(n: int) -> None:
    """Make this process SIGKILL itself as its lane is about to send its state for the `n`-th time."""
    from manualdp.spmd.ft.group_lanes import Lane
    send, sent = Lane.send, [0]

    def dying(self, round_, state):
        sent[0] += 1
        if sent[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return send(self, round_, state)
    Lane.send = dying


def main(config: dict) -> None:
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1)  # a hung rank tells where, when the test asks
    from manualdp.spmd.ft.group import GroupManager
    gid, rank, size = config["group"], config["rank"], config["size"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{config['group_port']}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=120))
    model = build()
    opt = optimizer(model)
    if config.get("die_on_send"):
        die_on_send(config["die_on_send"])
    manager = GroupManager(gid, "127.0.0.1", config["port"], timeout=20, quorum_timeout=5, heartbeat_timeout=1.0,
                           **({"min_groups": config["min_groups"]} if "min_groups" in config else {}))
    manager.register_state("model", model.state_dict, model.load_state_dict)
    if config.get("watch"):
        manager.watch(model)
    manager.register_state("optim", opt.state_dict, opt.load_state_dict)
    out = open(config["out"], "a")
    alone, together, joint, twice = False, 0, -1, False
    other, need = config.get("with_group", [None, 0])
    while manager.step < config["steps"] or together < config.get("together", 0) or need > 0:
        quorum = manager.start_step()
        step = manager.step
        joint += len(quorum.members) == 2
        if len(quorum.members) == 1:
            # alone after the groups met: the other left (a step alone before the other came is a slow start,
            # and counting the steps together before it would end this group before the other counts enough)
            alone = alone or joint >= 0
            time.sleep(config.get("sleep", 0))
        time.sleep(config.get("pace", 0))
        grads = shard_grads(model, step, gid, rank, size)
        if step == config.get("twice_at") and rank == size - 1 and not twice:  # one backward too many, once
            twice = True
            X, y = shard(step, gid, rank, size)
            ((model(X) - y) ** 2).sum().div(ROWS).backward()
            grads = [p.grad.clone() for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)  # inside the group: plain data parallelism
        flat.div_(size)
        if len(quorum.members) == 2 and config.get("kill_at") == joint and rank == config.get("kill_rank", size - 1):
            os.kill(os.getpid(), signal.SIGKILL)
        ok = manager.average(flat)
        if manager.should_commit(ok):
            for p, g in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()])):
                p.grad = g.view_as(p).clone()
            opt.step()
            if len(quorum.members) == 2 and (alone or config.get("rejoin")):
                together += 1
            need -= other in quorum.ids
            params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            out.write(json.dumps({"step": step, "members": quorum.ids, "params": params.tolist()}) + "\n")
            out.flush()
    manager.close()
    with open(config["out"] + ".end", "w") as end:
        json.dump({"recoveries": manager.recoveries, "step": manager.step}, end)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    # its outputs are written: end here, not at the interpreter's exit, where torch 2.13's gloo threads may still
    # hold a group's tensors and abort the process ("terminate called without an active exception")
    sys.stdout.flush()
    os._exit(0)
