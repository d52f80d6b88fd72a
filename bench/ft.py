"""Fault-tolerant steps against the drop-in DDP: `FaultTolerantDDP` and `DistributedDataParallel` on the same replicas.

    python bench/ft.py
    python bench/ft.py --models lenet mlp --rounds 10 --json ft.json
    python bench/ft.py --load    # with one busy process per core
    python bench/ft.py --sync-quorum    # each quorum asked in start_step, not ahead
    python bench/ft.py --models mlp --profile 200    # and CPU per step by thread, store accesses per step

Starts a coordinator here and 2 replica processes (`--replicas`). Each replica holds one
`manualdp.spmd.ft.Manager`; after the first fault-tolerant step, the quorum's process group (the
process's default group) also carries manualdp's drop-in `DistributedDataParallel`, on a group
of its own. Both train copies of one model with SGD on the same global batches, each replica
on its shard, in blocks of `--steps` steps taking turns (A B, B A, ...). No replica fails. Both
average their gradients in the same buckets during backward (the drop-in's reducer: a first bucket
of 1 MiB, then 25 MiB), the fault-tolerant one through its manager, on a thread of its own.

Reported per model: steps/s of each (median over rounds), the ratio fault-tolerant/DDP with
its min/median/max over the rounds, and the share of a fault-tolerant step spent in the
quorum (`start_step`, and the wait for the quorum asked ahead during forward, taken as backward
starts: `Manager(async_quorum=True)`, unless `--sync-quorum`) and in the vote (`should_commit`),
each as min/median/max over rounds; the 1-minute load average during the run. Target: the
ratio at least 0.9. With `--profile N`, after the rounds, N more steps of each: replica 0's CPU
microseconds per step by thread (from /proc: gloo's and torch's own threads as "other"), which load
changes little, and the fault-tolerant step's accesses to the coordinator's store by thread and call.
"""
from __future__ import annotations

import argparse
import collections
import copy
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import check_output_paths, save_outputs
from bench.compare_ddp import DEFAULT_BATCH
from bench.spread import add_load_option, format_load, format_spread, measured_load, spread
from manualdp.runners.cli import positive

__all__ = ["main", "run", "format_table", "NAMES", "TARGET"]

NAMES = ("DDP", "FaultTolerantDDP")
TARGET = 0.9  # fault-tolerant steps/s over the drop-in DDP's, on the same replicas


class _Timed:
    """`fn`, adding the seconds of each call to `total`."""

    def __init__(self, fn) -> None:
        self.fn, self.total = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - start


def _thread_cpu() -> dict[str, float]:
    """Seconds of CPU so far of each thread of this process, by name (threads not Python's: "other"); {} off Linux."""
    names, out = {t.native_id: t.name for t in threading.enumerate()}, collections.Counter()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[names.get(int(tid), "other")] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return dict(out)


class _CountingClient:
    """A store client that counts its calls by (thread, call): what one replica asks of the coordinator."""

    def __init__(self, inner, counts: collections.Counter) -> None:
        self._inner, self._counts = inner, counts

    def __getattr__(self, name: str):
        attribute = getattr(self._inner, name)
        if not callable(attribute) or name == "clone":  # a clone (the heartbeat's connection) is not counted
            return attribute

        def counted(*args, **kwargs):
            self._counts[f"{threading.current_thread().name.removeprefix('manualdp-')}:{name}"] += 1
            return attribute(*args, **kwargs)
        return counted


def _profile(steps: dict, done: dict, n: int, store=None) -> dict:
    """CPU us per step by thread of `n` more steps of each wrapper; the fault-tolerant one's store calls per step."""
    out = {}
    for name, step in steps.items():
        counts: collections.Counter = collections.Counter()
        if name == NAMES[1] and store is not None:
            raw, store._client = store._client, _CountingClient(store._client, counts)
        before, cpu = _thread_cpu(), time.process_time()
        for _ in range(n):
            step(done[name])
            done[name] += 1
        after, cpu = _thread_cpu(), time.process_time() - cpu
        if name == NAMES[1] and store is not None:
            store._client = raw
        threads = {k: round((v - before.get(k, 0.0)) * 1e6 / n) for k, v in after.items()}
        out[name] = {"cpu_us_per_step": round(cpu * 1e6 / n), "threads": {k: v for k, v in threads.items() if v},
                     "store_per_step": {k: round(v / n, 2) for k, v in sorted(counts.items())}}
    return out


def _replica(config: dict, port: int) -> dict | None:
    """One replica: both wrappers over one model, interleaved blocks; replica 0 returns the measurements."""
    from manualdp.spmd import DistributedDataParallel, shard
    from manualdp.spmd.ft import FaultTolerantDDP, Manager
    from manualdp.support.models import get_model

    index, replicas = int(os.environ["RANK"]), config["replicas"]
    torch.manual_seed(config["seed"])
    net = get_model(config["model"])
    manager = Manager(f"replica{index}", "127.0.0.1", port, min_replicas=replicas, timeout=config["timeout"],
                      async_quorum=config["async_quorum"])
    ft_model = copy.deepcopy(net)
    ft = FaultTolerantDDP(ft_model, torch.optim.SGD(ft_model.parameters(), lr=config["lr"]), manager)
    quorum, vote = _Timed(ft.start_step), _Timed(manager.should_commit)
    manager.should_commit = vote  # what ft.step() calls to vote
    settle = manager._settle = _Timed(manager._settle)  # the wait for a quorum asked ahead, where the step needs it
    batch, loss_fn = config["batch_size"], nn.CrossEntropyLoss(reduction="sum")
    g = torch.Generator().manual_seed(config["seed"] + 1)
    data = [shard(torch.rand(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g),
                  index, replicas) for _ in range(8)]

    def ft_step(k: int) -> None:
        quorum()
        X, y = data[k % len(data)]
        (loss_fn(ft(X), y) / batch * replicas).backward()
        if not ft.step():
            raise RuntimeError(f"replica {index}: step {k} was not committed, and no replica failed")

    ft_step(0)  # the first quorum forms the group that the drop-in then shares
    ddp = DistributedDataParallel(copy.deepcopy(net), process_group=dist.new_group(backend="gloo"))
    group = ddp.process_group
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=config["lr"])

    def ddp_step(k: int) -> None:
        X, y = data[k % len(data)]
        ddp_opt.zero_grad(set_to_none=True)
        (loss_fn(ddp(X), y) / batch * replicas).backward()
        ddp_opt.step()

    steps = {NAMES[0]: ddp_step, NAMES[1]: ft_step}
    done = dict.fromkeys(NAMES, 0)
    for _ in range(config["warmup"]):
        for name in NAMES:
            steps[name](done[name])
            done[name] += 1
    rates = {name: [] for name in NAMES}
    quorum_share, vote_share = [], []
    for r in range(config["rounds"]):
        for name in (NAMES if r % 2 == 0 else NAMES[::-1]):
            dist.barrier(group=group)
            quorum.total = vote.total = settle.total = 0.0
            start = time.perf_counter()
            for _ in range(config["steps"]):
                steps[name](done[name])
                done[name] += 1
            seconds = time.perf_counter() - start
            rates[name].append(config["steps"] / seconds)
            if name == NAMES[1]:
                quorum_share.append((quorum.total + settle.total) / seconds)
                vote_share.append(vote.total / seconds)
    profile = _profile(steps, done, config["profile"], manager.store) if config["profile"] else None
    dist.barrier(group=group)
    manager.close()
    if index != 0:
        return None
    return {"steps_per_s": rates, "quorum_share": quorum_share, "vote_share": vote_share,
            "committed": manager.step, "profile": profile}


def run(config: dict) -> dict:
    """Start the coordinator and the replicas; the measurements for one model, with the ratio's spread."""
    from manualdp.spmd import launch
    from manualdp.spmd.ft import Coordinator

    with Coordinator(0) as coordinator:
        raw = launch(_replica, config["replicas"], (config, coordinator.port), threads=config["threads"],
                     timeout=config["timeout"], init=False)[0]
    rates = raw["steps_per_s"]
    rounds = [f / d for f, d in zip(rates[NAMES[1]], rates[NAMES[0]])]
    return {"model": config["model"], "batch_size": config["batch_size"],
            "steps_per_s": {n: statistics.median(rates[n]) for n in NAMES},
            "rounds_steps_per_s": rates, "ratio": spread(rounds), "quorum_share": spread(raw["quorum_share"]),
            "vote_share": spread(raw["vote_share"]), "committed": raw["committed"], "profile": raw["profile"]}


def format_table(result: dict) -> str:
    """One line per model (and its global batch); the load average below."""
    c = result["config"]
    fmt = "{:<12} | {:>9} {:>9} | {:>17} | {:>17} {:>17}".format
    lines = [f"{c['replicas']} replicas, {c['threads']} thread(s) each, {c['rounds']} rounds x {c['steps']} steps "
             f"after {c['warmup']} warm-up; median (min-max) over rounds",
             fmt("", "steps/s", "", "ratio FT/DDP", "share of an FT step", ""),
             fmt("model", NAMES[0], "FT", "median (min-max)", "quorum", "vote")]
    for r in result["rows"]:
        rates = [f"{r['steps_per_s'][name]:.1f}" for name in NAMES]
        lines.append(fmt(f"{r['model']}/{r['batch_size']}", *rates, format_spread(r["ratio"]),
                         format_spread(r["quorum_share"]), format_spread(r["vote_share"])))
    worst = min(r["ratio"]["min"] for r in result["rows"])
    met = "met" if worst >= TARGET else "NOT met"
    lines.append(f"target FT/DDP >= {TARGET} in every round: worst {worst:.2f} -> {met}")
    lines.append(format_load(result["load"]))
    for r in result["rows"]:
        for name, p in (r.get("profile") or {}).items():
            threads = ", ".join(f"{k} {v}" for k, v in sorted(p["threads"].items(), key=lambda kv: -kv[1]))
            lines.append(f"{r['model']} {name}: CPU {p['cpu_us_per_step']} us per step, replica 0 ({threads})")
            if p["store_per_step"]:
                calls = ", ".join(f"{k} {v:g}" for k, v in p["store_per_step"].items())
                lines.append(f"  store calls per step: {sum(p['store_per_step'].values()):.1f} ({calls})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python bench/ft.py`: the comparison as a table; optionally JSON."""
    parser = argparse.ArgumentParser(prog="bench/ft.py", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(DEFAULT_BATCH), default=["lenet", "mlp"])
    parser.add_argument("--replicas", type=positive(int), default=2, help="replica processes (default 2)")
    parser.add_argument("--batch-size", type=positive(int), help="global batch (default: 256, resnet18 32)")
    parser.add_argument("--steps", type=positive(int), default=5, help="steps per timed block (default 5)")
    parser.add_argument("--rounds", type=positive(int), default=10, help="timed blocks per wrapper (default 10)")
    parser.add_argument("--warmup", type=positive(int), default=3, help="untimed steps per wrapper first (default 3)")
    parser.add_argument("--lr", type=positive(float), default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=positive(int), help="torch threads per replica (default: cores / replicas)")
    parser.add_argument("--timeout", type=positive(float), default=600.0, help="give up on one model after this many s")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--sync-quorum", action="store_true",
                        help="ask for each quorum in start_step (default: ahead, during forward and backward)")
    parser.add_argument("--profile", type=positive(int), metavar="N",
                        help="after the rounds, N steps of each: CPU per step by thread, store calls per step")
    add_load_option(parser)
    args = parser.parse_args(argv)
    check_output_paths(parser, args)
    if args.replicas < 2:
        parser.error(f"--replicas must be at least 2 (a quorum to average over), got {args.replicas}")
    base = {"replicas": args.replicas, "batch_size": args.batch_size, "steps": args.steps, "rounds": args.rounds,
            "warmup": args.warmup, "lr": args.lr, "seed": args.seed, "timeout": args.timeout,
            "async_quorum": not args.sync_quorum, "profile": args.profile or 0,
            "threads": args.threads or max(1, (os.cpu_count() or 1) // args.replicas)}
    rows = []
    with measured_load(args.load) as load:
        for model in args.models:
            batch = args.batch_size or DEFAULT_BATCH[model]
            if batch < args.replicas:
                parser.error(f"--batch-size {batch} is smaller than --replicas {args.replicas}")
            rows.append(run(dict(base, model=model, batch_size=batch)))
    result = {"config": dict(base, models=args.models, torch=torch.__version__), "rows": rows, "load": load}
    print(format_table(result))
    save_outputs(result, args.json, None, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
