"""The DDP ladder against torch's DDP: step times, the ratio, and how much communication hides behind backward.

    python bench/ladder.py                                   # lenet, resnet18, mlp at 2 and 4 ranks
    python bench/ladder.py --models mlp --world-sizes 2 --rounds 5 --json ladder.json --plot ladder.png

In every rank, each wrapper (naive, flat, overlapped, bucketed, manualdp's drop-in and torch's
DDP) trains its own copy of the model on the same data. They take turns in blocks of `--steps`
steps, in an order that rotates every round, so that a busy moment of the machine falls on
all of them alike. Reported per model and world size, as torch's DDP benchmark reports:
- p50 and p90 of the step time (forward, backward, optimizer step), milliseconds;
- the ratio of torch's p50 to each wrapper's (above 1: faster than torch's DDP);
- `hidden`: the share of the wrapper's communication time that ran while backward still
  computed, measured in a separate, instrumented pass (the timed pass is not instrumented):
  every allreduce's start and end on the communication thread, and the moment backward's
  computation ended (when autograd runs the end-of-backward callback, or for torch's DDP when
  its last bucket was handed to its comm hook).
This is the table CS336's DDP assignment asks for, from one command.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

NAMES = ["naive", "flat", "overlapped", "bucketed", "manualdp", "torch"]
DEFAULT_BATCH = {"lenet": 256, "mlp": 256, "resnet18": 32}


def _wrappers(model: str, bucket_cap_mb: float) -> dict:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from manualdp.spmd import BucketedDDP, DistributedDataParallel, FlatDDP, NaiveDDP, OverlappedDDP
    from manualdp.support.models import get_model

    def fresh():
        torch.manual_seed(0)
        return get_model(model)

    return {"naive": NaiveDDP(fresh()), "flat": FlatDDP(fresh()), "overlapped": OverlappedDDP(fresh()),
            "bucketed": BucketedDDP(fresh(), bucket_cap_mb=bucket_cap_mb),
            "manualdp": DistributedDataParallel(fresh(), bucket_cap_mb=bucket_cap_mb),
            "torch": TorchDDP(fresh(), bucket_cap_mb=bucket_cap_mb)}


class _Clock:
    """The instrumented pass: allreduce intervals, and when backward's computation ended."""

    def __init__(self):
        self.comm: list[tuple[float, float]] = []
        self.compute_end = 0.0

    def hidden(self, backward_start: float) -> tuple[float, float]:
        """(communication seconds, of which during backward's computation)."""
        total = sum(b - a for a, b in self.comm)
        inside = sum(max(0.0, min(b, self.compute_end) - max(a, backward_start)) for a, b in self.comm)
        return total, inside


def _instrument(models: dict, clock: _Clock) -> None:
    """Wrap each rung's allreduce and end-of-backward, and torch's DDP in a timing comm hook."""
    from manualdp.spmd import collectives
    from manualdp.spmd.ladder import bucketed, flat, naive, overlapped

    def timed(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.comm.append((start, time.perf_counter()))
        return call

    for module in (naive, flat, overlapped, bucketed):
        module.allreduce = timed(collectives.allreduce)
    import manualdp.spmd.ddp.reducer as reducer
    reducer.run_allreduce = timed(reducer.run_allreduce)  # the drop-in's buckets, on its worker thread

    def stamp(_):  # backward's computation ends when the last gradient is accumulated
        clock.compute_end = time.perf_counter()
    for m in models.values():
        for p in m.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(stamp)

    def torch_hook(state, bucket):
        start = time.perf_counter()
        fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()

        def done(f):
            clock.comm.append((start, time.perf_counter()))
            return f.value()[0]
        return fut.then(done)

    models["torch"].register_comm_hook(None, torch_hook)


def _step(model, opt, X, y) -> tuple[float, float]:
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(X), y)
    backward_start = time.perf_counter()
    loss.backward()
    opt.step()
    return time.perf_counter() - start, backward_start


def _rank_main(config: dict) -> dict | None:
    torch.set_num_threads(config["threads"])
    rank, n = dist.get_rank(), dist.get_world_size()
    batch = config["batch_size"] // n
    g = torch.Generator().manual_seed(rank)
    shape = (batch, 1, 28, 28)
    X, y = torch.randn(shape, generator=g), torch.randint(0, 10, (batch,), generator=g)
    models = _wrappers(config["model"], config["bucket_cap_mb"])
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    times = {k: [] for k in models}
    for k in models:  # warm-up: first steps build buckets, caches and the algorithm's constants
        for _ in range(config["warmup"]):
            _step(models[k], opts[k], X, y)
    order = list(models)
    for r in range(config["rounds"]):
        for k in order[r % len(order):] + order[:r % len(order)]:
            for _ in range(config["steps"]):
                times[k].append(_step(models[k], opts[k], X, y)[0])
    clock = _Clock()
    _instrument(models, clock)
    hidden = {}
    for k in models:
        total = inside = 0.0
        for _ in range(config["hidden_steps"]):
            clock.comm, clock.compute_end = [], 0.0
            _, backward_start = _step(models[k], opts[k], X, y)
            if k == "torch":
                torch.distributed.barrier()
            t, i = clock.hidden(backward_start)
            total, inside = total + t, inside + i
        hidden[k] = inside / total if total > 0 else 0.0
    if rank != 0:
        return None
    out = {}
    for k in models:
        ms = sorted(1e3 * t for t in times[k])
        out[k] = {"p50_ms": statistics.median(ms), "p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
                  "hidden": hidden[k]}
    for k in models:
        out[k]["ratio"] = out["torch"]["p50_ms"] / out[k]["p50_ms"]
    return out


def sweep(models: list[str], world_sizes: list[int], base: dict, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    from manualdp.spmd import launch

    rows = []
    configs = [(m, w) for m in models for w in world_sizes]
    for model, world_size in tqdm(configs, desc="ladder", disable=not progress, leave=False):
        config = dict(base, model=model, batch_size=base["batch_size"] or DEFAULT_BATCH[model],
                      threads=base["threads"] or max(1, (os.cpu_count() or 1) // world_size))
        result = launch(_rank_main, world_size, args=(config,), timeout=config["timeout"])[0]
        rows.append({"model": model, "world_size": world_size, **{k: result[k] for k in NAMES}})
    return {"config": dict(base, models=models, world_sizes=world_sizes), "rows": rows}


def format_table(result: dict) -> str:
    head = "{:<9} {:>5} {:<11} {:>8} {:>8} {:>6} {:>7}"
    lines = [head.format("model", "ranks", "wrapper", "p50 ms", "p90 ms", "ratio", "hidden")]
    for r in result["rows"]:
        for k in NAMES:
            s = r[k]
            lines.append(head.format(r["model"], r["world_size"], k, f"{s['p50_ms']:.1f}", f"{s['p90_ms']:.1f}",
                                     f"{s['ratio']:.2f}", f"{100 * s['hidden']:.0f}%"))
    lines.append("ratio: torch DDP's p50 / the wrapper's (above 1: faster than torch's); hidden: share of the "
                 "communication time that ran during backward's computation")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(NAMES)
    labels = [f"{r['model']}\n{r['world_size']} ranks" for r in rows]
    for i, k in enumerate(NAMES):
        xs = [j + (i - len(NAMES) / 2 + 0.5) * width for j in range(len(rows))]
        axes[0].bar(xs, [r[k]["ratio"] for r in rows], width, label=k)
        axes[1].bar(xs, [100 * r[k]["hidden"] for r in rows], width, label=k)
    for ax, title in zip(axes, ["speed vs torch's DDP (p50 ratio, higher is faster)",
                                "communication hidden behind backward (%)"]):
        ax.set_xticks(range(len(rows)), labels)
        ax.set_title(title)
    axes[0].axhline(1.0, color="black", lw=0.8)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["lenet", "resnet18", "mlp"], choices=["lenet", "resnet18", "mlp"])
    p.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default: 256, resnet18 32)")
    p.add_argument("--bucket-mb", type=float, default=25.0, dest="bucket_cap_mb")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="steps per timed block (default 2)")
    p.add_argument("--rounds", type=int, default=10, help="timed blocks per wrapper (default 10)")
    p.add_argument("--hidden-steps", type=int, default=10, help="instrumented steps per wrapper (default 10)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for name in ("batch_size", "warmup", "steps", "rounds", "hidden_steps", "threads"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if any(w < 2 or w > 8 for w in args.world_sizes):
        p.error(f"--world-sizes must be between 2 and 8, got {args.world_sizes}")
    if args.bucket_cap_mb <= 0:
        p.error(f"--bucket-mb must be positive, got {args.bucket_cap_mb}")
    base = {k: getattr(args, k) for k in ("batch_size", "bucket_cap_mb", "warmup", "steps", "rounds", "hidden_steps",
                                          "threads", "timeout")}
    result = sweep(args.models, args.world_sizes, base, progress=not args.no_progress)
    print(format_table(result))
    if args.json:
        from manualdp.support.files import write_json_atomic
        write_json_atomic(args.json, result)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
