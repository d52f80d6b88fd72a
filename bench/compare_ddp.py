"""Training throughput of manualdp's DistributedDataParallel against torch's, in the same processes.

    python bench/compare_ddp.py --model lenet --world-size 2
    python bench/compare_ddp.py --model resnet18 --batch-size 32 --json ddp.json --plot ddp.png
    python bench/compare_ddp.py --model resnet18 --world-size 2 --backend nccl    # a GPU per rank

Spawns `--world-size` processes on gloo (127.0.0.1). Every rank builds one model, copies it
into torch's DDP and into manualdp's wrapper (each on its own process group), and trains both
with SGD on the same global batches, each rank on its slice. After a warm-up the two run in
turns, a block of `--steps` steps each, the order flipping every round (A B, B A, ...), so
that machine noise hits both alike. Reported: samples/s (median over rounds), step time
p50/p90 (rank 0), the ratio manualdp/DDP, and the largest difference between the two models'
parameters after the same steps. With `--backend nccl` both train on GPUs over NCCL (one GPU
per rank), timed by CUDA events (`bench.common.Stopwatch`).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import BACKENDS, Stopwatch, check_backend, check_output_paths, save_outputs
from manualdp.runners.cli import positive

__all__ = ["main", "run", "format_table", "plot", "DEFAULT_BATCH", "NAMES"]

DEFAULT_BATCH = {"lenet": 256, "mlp": 256, "resnet18": 32}
NAMES = ("torch DDP", "manualdp")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _rank_main(config: dict) -> dict | None:
    """One rank: build both wrappers, warm up, run the interleaved rounds; rank 0 returns the measurements."""
    from manualdp.spmd import DistributedDataParallel, rank_device
    from manualdp.support.models import get_model
    from manualdp.spmd import shard

    rank, world_size = dist.get_rank(), dist.get_world_size()
    backend, device = config.get("backend", "gloo"), rank_device()
    torch.manual_seed(config["seed"])
    net = get_model(config["model"]).to(device)
    gpu = [device.index] if device.type == "cuda" else None
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(net), device_ids=gpu,
                                                       bucket_cap_mb=config["bucket_mb"])
    ours = DistributedDataParallel(copy.deepcopy(net), bucket_cap_mb=config["bucket_mb"], algorithm=config["algorithm"],
                                   process_group=dist.new_group(backend=backend), segment_bytes=config["segment_bytes"])
    models = dict(zip(NAMES, (theirs, ours)))
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=config["lr"]) for name, m in models.items()}
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    batch = config["batch_size"]
    g = torch.Generator().manual_seed(config["seed"] + 1)
    total_steps = config["warmup"] + config["rounds"] * config["steps"]
    # a few batches, cycled: both models see the same sequence
    data = [shard(torch.rand(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g),
                  rank, world_size)
            for _ in range(min(total_steps, 16))]
    data = [(X.to(device), y.to(device)) for X, y in data]
    step_clock, block_clock = Stopwatch(device), Stopwatch(device)

    done = dict.fromkeys(NAMES, 0)  # steps each model has taken: both walk the data in the same order

    def step(name: str) -> float:
        X, y = data[done[name] % len(data)]
        step_clock.start()
        optimizers[name].zero_grad(set_to_none=True)
        (loss_fn(models[name](X), y) / batch * world_size).backward()
        optimizers[name].step()
        done[name] += 1
        return step_clock.stop()

    for _ in range(config["warmup"]):
        for name in NAMES:
            step(name)
    step_times = {name: [] for name in NAMES}
    samples_per_s = {name: [] for name in NAMES}
    for r in range(config["rounds"]):
        for name in (NAMES if r % 2 == 0 else NAMES[::-1]):
            dist.barrier()
            block_clock.start()
            step_times[name] += [step(name) for _ in range(config["steps"])]
            samples_per_s[name].append(config["steps"] * batch / block_clock.stop())
    diff = max((a - b).abs().max().item() for a, b in zip(theirs.module.parameters(), ours.module.parameters()))
    if rank != 0:
        return None
    return {"step_times": step_times, "samples_per_s": samples_per_s, "max_param_diff": diff,
            "steps_per_model": done["manualdp"], "num_buckets": len(ours._buckets)}


def run(config: dict) -> dict:
    """Spawn the ranks, run the comparison; return config, per-implementation statistics and the ratio."""
    from manualdp.spmd import launch

    raw = launch(_rank_main, config["world_size"], (config,), threads=config["threads"], timeout=config["timeout"],
                 backend=config.get("backend", "gloo"))[0]
    stats = {}
    for name in NAMES:
        times = raw["step_times"][name]
        stats[name] = {"samples_per_s": statistics.median(raw["samples_per_s"][name]),
                       **{f"p{q}_ms": 1e3 * _percentile(times, q / 100) for q in (50, 75, 90, 95)},
                       "rounds_samples_per_s": raw["samples_per_s"][name], "step_times_s": times}
    paired = [ours / theirs for ours, theirs in zip(raw["samples_per_s"]["manualdp"],
                                                    raw["samples_per_s"]["torch DDP"])]
    return {"config": dict(config, torch=torch.__version__), "results": stats,
            "ratio": stats["manualdp"]["samples_per_s"] / stats["torch DDP"]["samples_per_s"],
            "paired_ratio": statistics.median(paired),
            "max_param_diff": raw["max_param_diff"], "steps_per_model": raw["steps_per_model"],
            "num_buckets": raw["num_buckets"]}


def format_table(result: dict) -> str:
    """The comparison as text."""
    c = result["config"]
    fmt = "{:<10} {:>11} {:>10} {:>10}".format
    lines = [
        f"{c['model']}, world size {c['world_size']} ({c.get('backend', 'gloo')}, {c['threads']} thread(s) per rank), "
        f"global batch "
        f"{c['batch_size']}, {c['rounds']} rounds x {c['steps']} steps after {c['warmup']} warm-up, "
        f"manualdp {c['algorithm']} with {result['num_buckets']} bucket(s) of <= {c['bucket_mb']} MiB",
        fmt("", "samples/s", "p50 (ms)", "p90 (ms)"),
    ]
    for name in NAMES:
        s = result["results"][name]
        lines.append(fmt(name, f"{s['samples_per_s']:.1f}", f"{s['p50_ms']:.2f}", f"{s['p90_ms']:.2f}"))
    ok = "met" if result["ratio"] >= 1.0 else "NOT met"  # at least as fast as torch's DDP on the same engine
    lines += [f"ratio manualdp/DDP (samples/s): {result['ratio']:.3f}  (target >= 1.00: {ok}); "
              f"median of per-round ratios {result['paired_ratio']:.3f}",
              f"max |parameter difference| after {result['steps_per_model']} steps each: "
              f"{result['max_param_diff']:.3g}"]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Samples/s per round and the step-time distribution of both, to a PNG at `path` (atomically)."""
    from manualdp.support.plot import new_figure, save_figure

    fig, (ax_rate, ax_time) = new_figure(1, 2, width=10, height=4)
    for name in NAMES:
        rates = result["results"][name]["rounds_samples_per_s"]
        ax_rate.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
    ax_rate.set_xlabel("round")
    ax_rate.set_ylabel("samples/s")
    ax_rate.legend()
    ax_time.boxplot([[1e3 * t for t in result["results"][name]["step_times_s"]] for name in NAMES], whis=(10, 90))
    ax_time.set_xticks([1, 2], NAMES)
    ax_time.set_ylabel("step time (ms), whiskers p10-p90")
    for ax in (ax_rate, ax_time):
        ax.grid(True, alpha=0.3)
    c = result["config"]
    fig.suptitle(f"{c['model']}, world size {c['world_size']}, batch {c['batch_size']}: "
                 f"manualdp/DDP = {result['ratio']:.3f}")
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """`python bench/compare_ddp.py`: print the comparison; optionally write JSON and a PNG."""
    from manualdp.support.models import MODELS
    from manualdp.schedule import ALGORITHMS

    parser = argparse.ArgumentParser(prog="bench/compare_ddp.py", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="lenet")
    parser.add_argument("--world-size", type=positive(int), default=2, help="processes (default 2)")
    parser.add_argument("--batch-size", type=positive(int), help="global batch (default: 256, resnet18 32)")
    parser.add_argument("--steps", type=positive(int), default=2, help="steps per timed block (default 2)")
    parser.add_argument("--rounds", type=positive(int), default=20, help="timed blocks per model (default 20)")
    parser.add_argument("--warmup", type=positive(int), default=3, help="untimed steps per model first (default 3)")
    parser.add_argument("--algorithm", choices=[*sorted(ALGORITHMS), "auto"], default="auto")
    parser.add_argument("--bucket-mb", type=positive(float), default=25.0, help="bucket cap of both (default 25)")
    parser.add_argument("--segment-bytes", type=positive(int), default=1 << 20, help="manualdp's message segments")
    parser.add_argument("--lr", type=positive(float), default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=positive(int), help="torch threads per rank (default: cores / world size)")
    parser.add_argument("--timeout", type=positive(float), default=1800.0, help="give up after this many seconds")
    parser.add_argument("--backend", choices=BACKENDS, default="gloo",
                        help="gloo (CPUs, default) or nccl (a GPU per rank)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="plot samples/s per round and step times to a PNG")
    args = parser.parse_args(argv)
    check_output_paths(parser, args)
    check_backend(parser, args.backend, args.world_size)
    batch = args.batch_size or DEFAULT_BATCH[args.model]
    if batch < args.world_size:
        parser.error(f"--batch-size {batch} is smaller than --world-size {args.world_size}")
    config = {
        "model": args.model, "world_size": args.world_size, "batch_size": batch, "steps": args.steps,
        "rounds": args.rounds, "warmup": args.warmup, "algorithm": args.algorithm, "bucket_mb": args.bucket_mb,
        "segment_bytes": args.segment_bytes, "lr": args.lr, "seed": args.seed, "timeout": args.timeout,
        "backend": args.backend,
        "threads": args.threads or max(1, (os.cpu_count() or 1) // args.world_size),
    }
    result = run(config)
    print(format_table(result))
    save_outputs(result, args.json, args.plot, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
