"""Where a step of each DDP goes: CPU time per step by thread and counts, manualdp's drop-in against torch's.

    python bench/ddp_profile.py --models mlp lenet --steps 200
    python bench/ddp_profile.py --models mlp --world-size 2 --steps 100 --top 15

Starts `--world-size` ranks on gloo (as `bench/compare_ddp.py`: one model copied into both
wrappers, each on its own group, the same batches). After a warm-up, each wrapper runs `--steps`
steps, twice, in turns (A B B A), and rank 0 reports per step: CPU microseconds by thread (the main
thread's `time.thread_time`; the others from /proc, `bench/ft.py`'s helper: manualdp's worker by its
name, gloo's and torch's autograd threads as "other"), which load changes little; then, over
`--steps` more steps under cProfile (the main thread, and manualdp's worker): Python function calls,
hand-offs to the worker, copies into and out of buckets (`copy_`, `div`) and tensor-making torch
calls. No timing figure: CPU time and counts.
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import copy
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.compare_ddp import DEFAULT_BATCH, NAMES
from bench.ft import _thread_cpu
from manualdp.runners.cli import positive

__all__ = ["main", "run", "format_table"]

# torch calls that make a new tensor (an allocation, unless the caching allocator has one)
_MAKERS = ("tensor", "zeros", "empty", "zeros_like", "empty_like", "to_sparse", "clone", "stack", "cat",
           "new_zeros", "new_empty", "flatten", "contiguous")
# torch calls that copy a gradient into or out of a bucket (the reducer's copy out divides: `div(..., out=)`)
_COPIES = ("copy_", "div")


def _bare(name: str) -> str:
    """A builtin's own name from cProfile's label: "<method 'copy_' of ...>" or "<built-in method torch.zeros>"."""
    if name.startswith("<method '"):
        return name.split("'")[1]
    return name.removeprefix("<built-in method ").rstrip(">").split(".")[-1]


def _counts(stats: pstats.Stats, n: int, top: int) -> dict:
    """Per step: Python calls, copies, tensor-making calls, worker hand-offs; the `top` functions by calls."""
    calls, copies, makers, submits, by_name = 0, 0, 0, 0, collections.Counter()
    for (path, line, name), (_, total, *_rest) in stats.stats.items():
        calls += total
        label = f"{os.path.basename(path)}:{line}({name})" if line else name
        by_name[label] += total
        bare = _bare(name)
        copies += total if bare in _COPIES else 0
        makers += total if bare in _MAKERS else 0
        submits += total if name == "submit" and "worker" in path else 0
    per = lambda v: round(v / n, 1)  # noqa: E731
    return {"calls": per(calls), "copies": per(copies), "tensor_makers": per(makers), "submits": per(submits),
            "top": [(k, per(v)) for k, v in by_name.most_common(top)]}


def _rank_main(config: dict) -> dict | None:
    """One rank: both wrappers over one model; rank 0 returns CPU per step by thread and the counts."""
    from manualdp.spmd import DistributedDataParallel, shard
    from manualdp.support.models import get_model

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = get_model(config["model"])
    models = {NAMES[0]: torch.nn.parallel.DistributedDataParallel(copy.deepcopy(net)),
              NAMES[1]: DistributedDataParallel(copy.deepcopy(net), process_group=dist.new_group())}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in models.items()}
    loss_fn, batch = nn.CrossEntropyLoss(reduction="sum"), config["batch_size"]
    g = torch.Generator().manual_seed(1)
    data = [shard(torch.rand(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g),
                  rank, world_size) for _ in range(8)]
    done = dict.fromkeys(NAMES, 0)

    def steps(name: str, n: int) -> None:
        for _ in range(n):
            X, y = data[done[name] % len(data)]
            optimizers[name].zero_grad(set_to_none=True)
            (loss_fn(models[name](X), y) / batch * world_size).backward()
            optimizers[name].step()
            done[name] += 1

    for name in NAMES:
        steps(name, config["warmup"])
    cpu = {name: collections.Counter() for name in NAMES}
    for name in (*NAMES, *NAMES[::-1]):  # A B B A: a slow stretch of the machine falls on both
        dist.barrier()
        before, main = _thread_cpu(), time.thread_time()
        steps(name, config["steps"])
        main = time.thread_time() - main
        after = _thread_cpu()
        for k, v in after.items():
            if k != "MainThread":
                cpu[name][k] += v - before.get(k, 0.0)
        cpu[name]["MainThread"] += main
    counts = {}
    worker = models[NAMES[1]].reducer.worker
    for name in NAMES:
        dist.barrier()
        profile, on_worker = cProfile.Profile(), cProfile.Profile()
        if name == NAMES[1]:  # a profile is per thread: the worker turns its own on and off, in line with its work
            worker.submit(on_worker.enable).result()
        profile.enable()
        steps(name, config["steps"])
        profile.disable()
        counts[name] = _counts(pstats.Stats(profile), config["steps"], config["top"])
        if name == NAMES[1]:
            worker.submit(on_worker.disable).result()
            counts["worker"] = _counts(pstats.Stats(on_worker), config["steps"], config["top"])
    diff = max((a - b).abs().max().item() for a, b in zip(*(m.module.parameters() for m in models.values())))
    if rank != 0:
        return None
    n = 2 * config["steps"]
    us = {name: {k: round(v * 1e6 / n) for k, v in c.items() if round(v * 1e6 / n)} for name, c in cpu.items()}
    return {"model": config["model"], "world_size": world_size, "cpu_us": us, "counts": counts, "max_diff": diff}


def run(config: dict) -> dict:
    """Spawn the ranks; rank 0's profile."""
    from manualdp.spmd import launch

    return launch(_rank_main, config["world_size"], (config,), threads=config["threads"], timeout=config["timeout"])[0]


def format_table(result: dict) -> str:
    """CPU us per step by thread, each wrapper and ours minus torch's; then the counts per step."""
    us, counts = result["cpu_us"], result["counts"]
    threads = sorted(set().union(*us.values()), key=lambda k: (k != "MainThread", k))
    fmt = "{:<22} " + " {:>10}" * 3
    lines = [f"{result['model']} at {result['world_size']} ranks, rank 0, per step "
             f"(max |parameter difference| {result['max_diff']:.3g})",
             fmt.format("CPU us by thread", *NAMES, "ours-torch")]
    for k in [*threads, "total"]:
        a, b = ((sum(us[n].values()) if k == "total" else us[n].get(k, 0)) for n in NAMES)
        lines.append(fmt.format(k, a, b, b - a))
    for field in ("calls", "submits", "copies", "tensor_makers"):
        a, b = (counts[n][field] for n in NAMES)
        lines.append(fmt.format(f"main: {field}", a, b, round(b - a, 1)))
    w = counts["worker"]
    lines.append(f"manualdp's worker per step: {w['calls']:g} Python calls, {w['copies']:g} copies, "
                 f"{w['tensor_makers']:g} tensor-making calls")
    for name, where in ((NAMES[0], "the main thread"), (NAMES[1], "the main thread"), ("worker", "manualdp's worker")):
        if counts[name]["top"]:
            lines.append(f"{name}, most called on {where}: " + ", ".join(f"{k} {v:g}" for k, v in counts[name]["top"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python bench/ddp_profile.py`: one profile table per model."""
    parser = argparse.ArgumentParser(prog="bench/ddp_profile.py", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(DEFAULT_BATCH), default=["mlp", "lenet"])
    parser.add_argument("--world-size", type=positive(int), default=2)
    parser.add_argument("--steps", type=positive(int), default=200, help="steps per wrapper per half (default 200)")
    parser.add_argument("--warmup", type=positive(int), default=20, help="untimed steps first (default 20)")
    parser.add_argument("--batch-size", type=positive(int), help="global batch (default: 256, resnet18 32)")
    parser.add_argument("--threads", type=positive(int), help="torch threads per rank (default: cores / world size)")
    parser.add_argument("--top", type=int, default=12, help="most called functions shown per wrapper (default 12)")
    parser.add_argument("--timeout", type=positive(float), default=1800.0, help="give up on one run after this many s")
    args = parser.parse_args(argv)
    for model in args.models:
        config = {"model": model, "world_size": args.world_size, "steps": args.steps, "warmup": args.warmup,
                  "batch_size": args.batch_size or DEFAULT_BATCH[model], "top": max(0, args.top),
                  "threads": args.threads or max(1, (os.cpu_count() or 1) // args.world_size),
                  "timeout": args.timeout}
        print(format_table(run(config)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
