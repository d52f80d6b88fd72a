"""One scaling table: torch DDP and manualdp at several world sizes, interleaved in the same processes.

    python bench/scaling.py --json scaling.json --plot scaling.png
    python bench/scaling.py --models lenet mlp --world-sizes 1 2 4
    python bench/scaling.py --world-sizes 1 2 --backend nccl    # on GPUs, one per rank

For every model and world size it runs `python bench/compare_ddp.py` (both wrappers in the same
ranks, blocks of steps in turns) and reports what torch's DDP benchmark reports: samples/s
and p50/p75/p90/p95 step times, for each wrapper; the ratio manualdp/DDP, with the min,
median and max of the per-round ratios; and the speedup of each wrapper over its own run with
one process (the same cores, shared among the ranks, so on a machine with few cores the ideal
is not the world size). Below the table: the load average during the run; `--load` runs one
busy process per core meanwhile (`bench/spread.py`).
"""
from __future__ import annotations

import argparse
import os
import sys

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import BACKENDS, check_backend, check_output_paths, save_outputs
from bench.compare_ddp import DEFAULT_BATCH, NAMES, run
from bench.spread import add_load_option, format_load, format_spread, measured_load, spread
from manualdp.runners.cli import positive
from manualdp.schedule import ALGORITHMS
from manualdp.support.models import MODELS

__all__ = ["main", "sweep", "format_table", "plot"]


def sweep(models: list[str], world_sizes: list[int], base: dict, progress: bool = True) -> dict:
    """Run the comparison for every (model, world size); the rows of the table."""
    from tqdm.auto import tqdm

    rows = []
    configs = [(m, w) for m in models for w in world_sizes]
    for model, world_size in tqdm(configs, desc="scaling", disable=not progress, leave=False):
        config = dict(base, model=model, world_size=world_size,
                      batch_size=base.get("batch_size") or DEFAULT_BATCH[model],
                      threads=base["threads"] or max(1, (os.cpu_count() or 1) // world_size))
        result = run(config)
        rounds = [ours / theirs for ours, theirs in zip(result["results"]["manualdp"]["rounds_samples_per_s"],
                                                        result["results"]["torch DDP"]["rounds_samples_per_s"])]
        row = {"model": model, "world_size": world_size, "ratio": result["ratio"], "ratio_rounds": spread(rounds),
               "max_param_diff": result["max_param_diff"], "num_buckets": result["num_buckets"]}
        for name in NAMES:
            s = result["results"][name]
            row[name] = {k: s[k] for k in ("samples_per_s", "p50_ms", "p75_ms", "p90_ms", "p95_ms",
                                           "rounds_samples_per_s")}
        rows.append(row)
    for row in rows:  # speedup over the same model's one-process run, when the sweep has one
        one = next((r for r in rows if r["model"] == row["model"] and r["world_size"] == 1), None)
        for name in NAMES:
            row[name]["speedup"] = row[name]["samples_per_s"] / one[name]["samples_per_s"] if one else None
    return {"config": dict(base, models=models, world_sizes=world_sizes), "rows": rows}


def format_table(result: dict) -> str:
    """The table as text: one line per model and world size."""
    head = ("{:<9} {:>5} | {:>9} {:>7} {:>7} {:>7} {:>7} {:>7} | {:>9} {:>7} {:>7} {:>7} {:>7} {:>7} | {:>6} "
            "{:>17}")
    lines = [head.format("", "", "torch DDP", "", "", "", "", "", "manualdp", "", "", "", "", "", "", "rounds"),
             head.format("model", "world", "samples/s", "p50", "p75", "p90", "p95", "speedup",
                         "samples/s", "p50", "p75", "p90", "p95", "speedup", "ratio", "median (min-max)")]
    for r in result["rows"]:
        cells = []
        for name in NAMES:
            s = r[name]
            cells += [f"{s['samples_per_s']:.1f}"] + [f"{s[f'p{q}_ms']:.1f}" for q in (50, 75, 90, 95)]
            cells.append(f"{s['speedup']:.2f}" if s["speedup"] is not None else "-")
        lines.append(head.format(r["model"], r["world_size"], *cells, f"{r['ratio']:.3f}",
                                 format_spread(r["ratio_rounds"])))
    lines.append("step times in ms (rank 0); speedup: samples/s over the same wrapper's run with 1 process; "
                 "ratio: manualdp/DDP samples/s (rounds: the ratio of each round's blocks)")
    if "load" in result:
        lines.append(format_load(result["load"]))
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Samples/s against world size, one panel per model, both wrappers."""
    from manualdp.support.plot import new_figure, save_figure

    models = result["config"]["models"]
    fig, axes = new_figure(1, len(models), width=4.2 * len(models), height=3.4)
    for ax, model in zip(axes, models):
        rows = [r for r in result["rows"] if r["model"] == model]
        for name, style in zip(NAMES, ("--", "-")):
            ax.plot([r["world_size"] for r in rows], [r[name]["samples_per_s"] for r in rows], style, marker="o",
                    label=name)
        for r in rows:
            ax.annotate(f"{r['ratio']:.2f}", (r["world_size"], r["manualdp"]["samples_per_s"]),
                        textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        ax.set_title(f"{model} (label: manualdp/DDP)")
        ax.set_xlabel("world size (processes)")
        ax.set_xticks([r["world_size"] for r in rows])
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("samples/s")
    axes[0].legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    """`python bench/scaling.py`: the sweep as a table; optionally JSON and a PNG."""
    parser = argparse.ArgumentParser(prog="bench/scaling.py", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["lenet", "mlp", "resnet18"])
    parser.add_argument("--world-sizes", nargs="+", type=positive(int), default=[1, 2, 3, 4])
    parser.add_argument("--batch-size", type=positive(int), help="global batch (default: 256, resnet18 32)")
    parser.add_argument("--steps", type=positive(int), default=2, help="steps per timed block (default 2)")
    parser.add_argument("--rounds", type=positive(int), default=10, help="timed blocks per wrapper (default 10)")
    parser.add_argument("--warmup", type=positive(int), default=3, help="untimed steps per wrapper first (default 3)")
    parser.add_argument("--algorithm", choices=[*sorted(ALGORITHMS), "auto"], default="auto")
    parser.add_argument("--bucket-mb", type=positive(float), default=25.0, help="bucket cap of both (default 25)")
    parser.add_argument("--threads", type=positive(int), help="torch threads per rank (default: cores / world size)")
    parser.add_argument("--timeout", type=positive(float), default=1800.0, help="give up on one run after this many s")
    parser.add_argument("--backend", choices=BACKENDS, default="gloo",
                        help="gloo (CPUs, default) or nccl (a GPU per rank)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_load_option(parser)
    parser.add_argument("--json", metavar="PATH", help="write the table as JSON")
    parser.add_argument("--plot", metavar="PATH", help="plot samples/s against world size to a PNG")
    args = parser.parse_args(argv)
    check_output_paths(parser, args)
    check_backend(parser, args.backend, max(args.world_sizes))
    base = {"batch_size": args.batch_size, "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
            "algorithm": args.algorithm, "bucket_mb": args.bucket_mb, "segment_bytes": 1 << 20, "lr": 0.01, "seed": 0,
            "timeout": args.timeout, "threads": args.threads, "backend": args.backend}
    with measured_load(args.load) as load:
        result = sweep(args.models, sorted(set(args.world_sizes)), base, progress=not args.no_progress)
    result["load"] = load
    print(format_table(result))
    save_outputs(result, args.json, args.plot, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
