"""One replica of the fault-tolerance tests, run as its own process: `python -m tests.spmd.ft.replica CONFIG_JSON`.

It trains a float64 MLP on synthetic regression batches: batch b is the same on every replica
(`batch(b)`), and replica `index` trains on its fixed third of it (`my_shard`). The config
says when to fail: `kill_forward` / `stop_forward` (SIGKILL / SIGSTOP itself in forward at
batch `at`), `kill_allreduce` / `stop_allreduce` (SIGKILL / SIGSTOP itself right after its
first message of that batch's allreduce: a stopped one holds its connections open, a network
partition), `fail_allreduce` (that message fails, and the replica lives on), `kill_receive`
(SIGKILL itself in its first recovery, the state received but not loaded), `kill_send`
(SIGKILL itself while sending the state at step `at`, the bytes written but not their
checksum: the receiver never sees a whole state; `skip`: that many messages go first, so that a
later bucket's is the one), `bucket_cap_mb` (FaultTolerantDDP's), `grads` (record this replica's own
gradients and the averages backward left in `.grad`), and when to
pause (after committing step `pause_after`, until the test writes `go` to the store; a list of
steps pauses at each, the k-th until `go` + k for k > 0; `hold`: before its first step, until `start`). It
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


def die_in_first_send(sig, skip: int = 0):
    """From now on, the first message this process sends (after `skip` more) is its last: `sig` to itself."""
    import inspect

    import torch.distributed as dist
    original, raw = dist.ProcessGroup.send, inspect.getattr_static(dist.ProcessGroup, "send")
    left = [skip]

    def send(self, *args, **kwargs):
        work = original(self, *args, **kwargs)
        left[0] -= 1
        if left[0] >= 0:  # a later bucket's message is the one
            return work
        dist.ProcessGroup.send = raw  # once: a stopped replica that wakes sends as usual (the method, still bound)
        os.kill(os.getpid(), sig)
        return work

    dist.ProcessGroup.send = send


def fail_first_send(skip: int = 0):
    """The next message this process sends (after `skip` more) fails with a gloo-like error; it lives on and votes."""
    import torch.distributed as dist
    original, armed, left = dist.ProcessGroup.send, [True], [skip]

    def send(self, *args, **kwargs):
        left[0] -= 1
        if armed and left[0] < 0:
            armed.clear()
            raise RuntimeError("[injected] Connection reset by peer")
        return original(self, *args, **kwargs)

    dist.ProcessGroup.send = send


def die_in_recovery(fault: str, at, sig=signal.SIGKILL):
    """`kill_receive`: die in the first state received, before loading it; `kill_send`: die in sending at step `at`."""
    from manualdp.spmd.ft import keys, manager

    if fault == "kill_receive":
        receive = manager.receive_state

        def receive_then_die(*args, **kwargs):
            receive(*args, **kwargs)
            os.kill(os.getpid(), sig)

        manager.receive_state = receive_then_die
    else:
        send = manager.send_state

        def send_and_die(store, round_, source, state):
            if state["step"] != at:
                return send(store, round_, source, state)
            import io
            buffer = io.BytesIO()
            torch.save(state, buffer)
            store.set(keys.state(round_, source), buffer.getvalue())  # the bytes, not yet their checksum
            os.kill(os.getpid(), sig)

        manager.send_state = send_and_die


def wait_for_key(store, key: str, timeout: float = 60) -> None:
    """Until the test writes `key` to the store (or `timeout` s pass: the test has failed, and ends this process)."""
    deadline = time.monotonic() + timeout
    while not store.check([key]) and time.monotonic() < deadline:
        time.sleep(0.02)


def main(config: dict) -> None:
    torch.set_num_threads(1)
    from manualdp.spmd.ft import DiLoCo, FaultTolerantDDP, LocalSGD, Manager
    index, fault, at = config["index"], config.get("fault"), config.get("at")
    manager = Manager(config["id"], "127.0.0.1", config["port"], min_replicas=config.get("min_replicas", 2),
                      timeout=config.get("timeout", 20), quorum_timeout=config.get("quorum_timeout", 5),
                      heartbeat_interval=0.1, heartbeat_timeout=config.get("heartbeat_timeout", 1.0),
                      async_quorum=config.get("async_quorum", False))
    model = build(config.get("seed", index))
    optimizer = make_optimizer(model.parameters(), config)
    if fault in ("kill_receive", "kill_send"):
        die_in_recovery(fault, at)
    mode = config.get("mode", "ddp")
    if mode == "ddp":
        ft = FaultTolerantDDP(model, optimizer, manager, **({"bucket_cap_mb": config["bucket_cap_mb"]}
                                                            if "bucket_cap_mb" in config else {}))
    elif mode == "local_sgd":
        ft = LocalSGD(model, optimizer, manager, config["sync_every"])
    else:
        ft = DiLoCo(model, optimizer, manager, config["sync_every"], outer_lr=config["outer_lr"],
                    outer_momentum=config["outer_momentum"])
    if config.get("hold"):  # every replica registered before any asks: its first quorum waits for them all
        wait_for_key(manager.store, "start")
    records = []
    pauses = config.get("pause_after")
    pauses = [] if pauses is None else [pauses] if isinstance(pauses, int) else list(pauses)
    keys = ["go" if k == 0 else f"go{k}" for k in range(len(pauses))]
    while manager.step < config["steps"]:
        started = time.monotonic()
        quorum = ft.start_step()
        waited = time.monotonic() - started
        b = ft.batch_index
        sent_before = sent()  # FaultTolerantDDP's buckets go during backward
        X, y = my_shard(b, index)
        hidden = model[1](model[0](X))
        if fault in ("kill_forward", "stop_forward") and b == at:
            at = None  # once: a stopped replica that comes back goes on
            os.kill(os.getpid(), signal.SIGKILL if fault == "kill_forward" else signal.SIGSTOP)
        if fault in ("kill_allreduce", "stop_allreduce") and b == at:
            at = None  # once: a stopped replica that comes back goes on
            die_in_first_send(signal.SIGKILL if fault == "kill_allreduce" else signal.SIGSTOP, config.get("skip", 0))
        if fault == "fail_allreduce" and b == at:
            at = None
            fail_first_send(config.get("skip", 0))
        out = model[4](model[3](model[2](hidden)))
        loss = ((out - y) ** 2).mean()
        mine = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True) if config.get("grads") else None
        loss.backward()  # FaultTolerantDDP's buckets are averaged during it: .grad holds the averages
        averaged = [p.grad.reshape(-1).tolist() for p in model.parameters()] if mine is not None else None
        committed = ft.step()
        if committed is None:  # inside a block of local SGD or DiLoCo: nothing was sent
            continue
        q = manager.quorum
        record = {"batch": b, "round": q.round, "members": q.ids, "group": q.group, "committed": committed,
                  "step": manager.step, "waited": waited, "loss": loss.item()}
        if mine is not None:
            record["grads"] = {"mine": [g.reshape(-1).tolist() for g in mine], "averaged": averaged}
        if committed:
            record["sent"] = sent() - sent_before  # the bytes this replica's allreduces sent for the step
            record["sha256"] = sha(model)
            if mode != "ddp":
                record["params"] = flat_params(model).tolist()
        records.append(record)
        with open(config["out"] + "l", "a") as f:  # line by line: a replica killed later leaves what it did
            f.write(json.dumps(record) + "\n")
        if pauses and manager.step == pauses[0]:
            pauses.pop(0)
            wait_for_key(manager.store, keys.pop(0))
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
