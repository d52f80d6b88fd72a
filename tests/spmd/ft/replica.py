"""One replica of the fault-tolerance tests, run as its own process: `python -m tests.spmd.ft.replica CONFIG_JSON`.

It trains a float64 MLP on synthetic regression batches: batch b is the same on every replica
(`batch(b)`), and replica `index` trains on its fixed third of it (`my_shard`). The config
says when to fail: `kill_forward` / `stop_forward` (SIGKILL / SIGSTOP itself in forward at
batch `at`), `kill_allreduce` (SIGKILL itself right after its first message of that batch's
allreduce), `fail_allreduce` (that message fails, and the replica lives on), and when to
pause (after committing step `pause_after`, until the test writes `go` to the store). It
writes what it did as JSON: every attempt (round, members, committed, the parameters' SHA-256
after a committed step, and the bytes its allreduces sent) one line each as it goes (OUT + "l"),
then at the end its recoveries and final parameters (OUT).
"""
import hashlib
import json
import os
import signal
import sys
import time

import torch
from torch import nn

SHARDS = 3          # a global batch holds a shard for each of 3 replica indices
SHARD_ROWS = 4


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + b)
    X = torch.randn(SHARDS * SHARD_ROWS, 6, generator=g, dtype=torch.float64)
    return X, torch.randn(SHARDS * SHARD_ROWS, 4, generator=g, dtype=torch.float64)


def my_shard(b: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    X, y = batch(b)
    return X[index * SHARD_ROWS:(index + 1) * SHARD_ROWS], y[index * SHARD_ROWS:(index + 1) * SHARD_ROWS]


def make_optimizer(params, config):
    return torch.optim.SGD(params, lr=config.get("lr", 0.1), momentum=config.get("momentum", 0.9))


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def sha(model: nn.Module) -> str:
    return hashlib.sha256(flat_params(model).numpy().tobytes()).hexdigest()


def sent() -> int:
    """The bytes the executor has sent on the quorum's group so far (0 without a group)."""
    import torch.distributed as dist
    from manualdp.spmd.transport.p2p import traffic
    return sum(traffic().sent().values()) if dist.is_initialized() else 0


def die_in_first_send(sig):
    """From now on, the first message this process sends is its last: `sig` to itself right after posting it."""
    import torch.distributed as dist
    original = dist.ProcessGroup.send

    def send(self, *args, **kwargs):
        work = original(self, *args, **kwargs)
        os.kill(os.getpid(), sig)
        return work

    dist.ProcessGroup.send = send


def fail_first_send():
    """The next message this process sends fails with a gloo-like error; it stays alive and votes."""
    import torch.distributed as dist
    original, armed = dist.ProcessGroup.send, [True]

    def send(self, *args, **kwargs):
        if armed:
            armed.clear()
            raise RuntimeError("[injected] Connection reset by peer")
        return original(self, *args, **kwargs)

    dist.ProcessGroup.send = send


def main(config: dict) -> None:
    torch.set_num_threads(1)
    from manualdp.spmd.ft import DiLoCo, FaultTolerantDDP, LocalSGD, Manager
    index, fault, at = config["index"], config.get("fault"), config.get("at")
    manager = Manager(config["id"], "127.0.0.1", config["port"], min_replicas=config.get("min_replicas", 2),
                      timeout=config.get("timeout", 20), quorum_timeout=config.get("quorum_timeout", 5),
                      heartbeat_interval=0.1, heartbeat_timeout=config.get("heartbeat_timeout", 1.0))
    model = build(config.get("seed", index))
    optimizer = make_optimizer(model.parameters(), config)
    mode = config.get("mode", "ddp")
    if mode == "ddp":
        ft = FaultTolerantDDP(model, optimizer, manager)
    elif mode == "local_sgd":
        ft = LocalSGD(model, optimizer, manager, config["sync_every"])
    else:
        ft = DiLoCo(model, optimizer, manager, config["sync_every"], outer_lr=config["outer_lr"],
                    outer_momentum=config["outer_momentum"])
    records, paused = [], False
    while manager.step < config["steps"]:
        started = time.monotonic()
        quorum = ft.start_step()
        waited = time.monotonic() - started
        b = ft.batch_index
        X, y = my_shard(b, index)
        hidden = model[1](model[0](X))
        if fault in ("kill_forward", "stop_forward") and b == at:
            at = None  # once: a stopped replica that comes back goes on
            os.kill(os.getpid(), signal.SIGKILL if fault == "kill_forward" else signal.SIGSTOP)
        if fault == "kill_allreduce" and b == at:
            die_in_first_send(signal.SIGKILL)
        if fault == "fail_allreduce" and b == at:
            at = None
            fail_first_send()
        out = model[4](model[3](model[2](hidden)))
        loss = ((out - y) ** 2).mean()
        loss.backward()
        sent_before = sent()
        committed = ft.step()
        if committed is None:  # inside a block of local SGD or DiLoCo: nothing was sent
            continue
        q = manager.quorum
        record = {"batch": b, "round": q.round, "members": q.ids, "group": q.group, "committed": committed,
                  "step": manager.step, "waited": waited, "loss": loss.item()}
        if committed:
            record["sent"] = sent() - sent_before  # the bytes this replica's allreduces sent for the step
            record["sha256"] = sha(model)
            if mode != "ddp":
                record["params"] = flat_params(model).tolist()
        records.append(record)
        with open(config["out"] + "l", "a") as f:  # line by line: a replica killed later leaves what it did
            f.write(json.dumps(record) + "\n")
        if config.get("pause_after") is not None and manager.step == config["pause_after"] and not paused:
            paused = True
            store = manager.store
            deadline = time.monotonic() + 60
            while not store.check(["go"]) and time.monotonic() < deadline:
                time.sleep(0.02)
    result = {"id": config["id"], "records": records, "recoveries": manager.recoveries,
              "final": flat_params(model).tolist(), "sha256": sha(model), "step": manager.step}
    with open(config["out"], "w") as f:
        json.dump(result, f)
    manager.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as spmd.launch does: no gloo teardown racing a peer's


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
