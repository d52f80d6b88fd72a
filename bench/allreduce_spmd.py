"""Allreduce across processes: manualdp's schedules over isend/irecv against gloo's own all_reduce.

    python bench/allreduce_spmd.py --world-size 4 --json spmd.json --plot spmd.png
    python bench/allreduce.py --spmd --world-size 2
    python bench/allreduce.py --spmd --world-size 2 --backend nccl    # a GPU per rank, against NCCL's all_reduce
    python bench/allreduce.py --spmd --load    # the same with one busy process per core, started and stopped here

Spawns `--world-size` processes on gloo (127.0.0.1). For every size S (bytes per rank) one
row per algorithm (the schedule alone, `check=False`, as gloo's all_reduce checks nothing
either), one for `auto` as users call it (`auto+check`: with the call check, which at two ranks
is the data's tag alone and from three ranks on adds fixed-size headers beside the first round of
data, `manualdp.spmd.transport.call_check`) and one
for `torch.distributed.all_reduce`, with the columns nccl-tests prints: time (median over
runs of the slowest rank's time), algbw = S / time, busbw = algbw * 2(n-1)/n, #wrong (inputs
are small integers, so every order of summation is exact and #wrong must be 0), and busbw /
gloo's busbw at the same size, then (min-max) of that ratio taken round by round. The
implementations run in turns, run by run, after a barrier each, so that machine noise hits all
of them alike. Below the table: the load average during the run, how many times "auto" measured
the link again, and how many checked calls were late enough that the ranks compared their
fingerprints through the store (`manualdp.spmd.transport.late`).
With `--backend nccl` the same on GPUs, against NCCL's all_reduce, timed by CUDA events
(`bench.common.Stopwatch`); the columns keep their names ("gloo" is then NCCL).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import BACKENDS, Stopwatch, check_backend, check_output_paths, save_outputs
from bench.spread import add_load_option, format_load, measured_load, spread
from manualdp.schedule import ALGORITHMS, get_schedule

__all__ = ["main", "run", "format_table", "plot"]

MiB = 1 << 20
GLOO = "gloo all_reduce"
CHECKED = "auto+check"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}


def _input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 7919 + numel)
    return torch.randint(-8, 8, (numel,), generator=g).to(dtype)  # small integers: every summation order is exact


def _rank_main(config: dict) -> dict:
    """One rank: time every implementation at every size; return per-run times and wrong counts."""
    from manualdp.spmd import allreduce, rank_device
    from manualdp.spmd.auto.tune import link_for, resolve
    from manualdp.spmd.transport.group import group_state

    rank, n = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    clock = Stopwatch(device)
    dtype = DTYPES[config["dtype"]]
    element_size = torch.empty((), dtype=dtype).element_size()
    impls = {a: (lambda x, a=a: allreduce(x, a, segment_bytes=config["segment_bytes"], check=False))
             for a in [*config["algorithms"], "auto"]}
    impls[CHECKED] = lambda x: allreduce(x, "auto", segment_bytes=config["segment_bytes"])
    impls[_peer(config)] = dist.all_reduce
    link = link_for()  # the agreed constants (calibrated, cached or MANUALDP_LINK) before any timing
    names = list(impls)
    out = {}
    for size in config["sizes"]:
        numel = size // element_size
        pristine = _input(rank, numel, dtype).to(device)
        expected = sum(_input(r, numel, dtype) for r in range(n)).to(device)
        work = pristine.clone()
        times = {name: [] for name in names}
        wrong = dict.fromkeys(names, 0)
        for i in range(config["warmup"] + config["iters"]):
            order = names[i % len(names):] + names[:i % len(names)]  # rotate who goes first
            for name in order:
                work.copy_(pristine)
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                clock.start()
                impls[name](work)
                seconds = clock.stop()
                if i >= config["warmup"]:
                    times[name].append(seconds)
                    wrong[name] = max(wrong[name], int((work != expected).sum()))
        out[size] = {"times": times, "wrong": wrong, "pick": resolve("auto", numel, element_size,
                                                                             segment_bytes=config["segment_bytes"])}
    state = group_state()
    out["link"] = vars(link)
    out["remeasures"] = state.remeasures  # "auto" measured the link again (drift) during the run
    out["late"] = state.late.late_calls if state.late else 0  # checked calls compared through the store
    return out


def _peer(config: dict) -> str:
    """The row of the backend's own all_reduce."""
    return GLOO if config.get("backend", "gloo") == "gloo" else f"{config['backend']} all_reduce"


def run(config: dict) -> dict:
    """Spawn the ranks and build the rows: nccl-tests columns plus the ratio to gloo (to NCCL with --backend nccl)."""
    from manualdp.spmd import launch

    per_rank = launch(_rank_main, config["world_size"], (config,), threads=config["threads"], timeout=config["timeout"],
                      backend=config.get("backend", "gloo"))
    n = config["world_size"]
    element_size = torch.empty((), dtype=DTYPES[config["dtype"]]).element_size()
    from manualdp.spmd.auto.pick import Link, predict

    link = Link(**per_rank[0]["link"])
    rows = []
    for size in config["sizes"]:
        names = list(per_rank[0][size]["times"])
        block = []
        for name in names:
            # the collective ends with its last rank
            slowest = [max(ts) for ts in zip(*(r[size]["times"][name] for r in per_rank))]
            t = statistics.median(slowest)
            algbw = size / t / 1e9
            block.append({"algorithm": name, "size": size, "count": size // element_size, "type": config["dtype"],
                          "time_us": t * 1e6, "algbw": algbw, "busbw": algbw * 2 * (n - 1) / n,
                          "wrong": sum(r[size]["wrong"][name] for r in per_rank),
                          "times_us": [x * 1e6 for x in slowest]})
        peer = next(r for r in block if r["algorithm"] == _peer(config))
        for r in block:
            r["vs_gloo"] = r["busbw"] / peer["busbw"]
            # round by round (the implementations ran in turns within a round): the peer's time over ours
            r["vs_gloo_rounds"] = spread([p / t for p, t in zip(peer["times_us"], r["times_us"])])
        auto = next(r for r in block if r["algorithm"] == "auto")
        explicit = [r for r in block if r["algorithm"] in config["algorithms"]]
        auto["pick"] = per_rank[0][size]["pick"]
        auto["predicted_us"] = 1e6 * predict(auto["pick"], n, size, link, element_size, config["segment_bytes"])
        fastest = min(explicit, key=lambda r: r["time_us"])
        auto["fastest"] = fastest["algorithm"]
        # At two ranks naive and tree are one schedule (the same transfers): either counts as the other.
        auto["pick_is_fastest"] = (auto["pick"] == fastest["algorithm"] or
                                   get_schedule(auto["pick"], n).rounds == get_schedule(fastest["algorithm"], n).rounds)
        picked = next((r for r in explicit if r["algorithm"] == auto["pick"]), None)
        auto["pick_vs_fastest"] = picked["time_us"] / fastest["time_us"] if picked else None
        auto["pick_within_5pct"] = auto["pick_is_fastest"] or (picked is not None and auto["pick_vs_fastest"] <= 1.05)
        rows += block
    autos = [r for r in rows if r["algorithm"] == "auto"]
    in_range = [r["vs_gloo"] for r in autos if 64 * 1024 <= r["size"] <= 64 * MiB]
    checked = [r["vs_gloo"] for r in rows if r["algorithm"] == CHECKED and 64 * 1024 <= r["size"] <= 64 * MiB]
    return {"config": dict(config, torch=torch.__version__), "rows": rows, "link": vars(link),
            "remeasures": [r["remeasures"] for r in per_rank], "late_calls": [r["late"] for r in per_rank],
            "target": {"auto_vs_gloo_min": min(in_range) if in_range else None,
                       "checked_vs_gloo_min": min(checked) if checked else None,
                       "checked_vs_gloo_round_min": min((r["vs_gloo_rounds"]["min"] for r in rows
                                                         if r["algorithm"] == CHECKED and
                                                         64 * 1024 <= r["size"] <= 64 * MiB), default=None),
                       "auto_picks_fastest": sum(r["pick_is_fastest"] for r in autos), "sizes": len(autos),
                       "auto_picks_within_5pct": sum(r["pick_within_5pct"] for r in autos),
                       # What a wrong pick costs: its time over the fastest's, at the worst size it missed.
                       "pick_vs_fastest_max": max((r["pick_vs_fastest"] for r in autos
                                                   if not r["pick_is_fastest"] and r["pick_vs_fastest"]),
                                                  default=None)}}


def format_table(result: dict) -> str:
    """The rows as text, one block per size."""
    c = result["config"]
    fmt = "{:>10} {:>9} {:>7} {:>16} {:>10} {:>11} {:>11} {:>6} {:>22}".format
    backend = c.get("backend", "gloo")
    lines = [f"allreduce across {c['world_size']} processes ({backend}, 127.0.0.1, {c['threads']} thread(s) each), "
             f"{c['dtype']}, median of {c['iters']} runs after {c['warmup']} warm-up, "
             f"segments of {c['segment_bytes']} B, torch {c['torch']}",
             fmt("size", "count", "type", "algorithm", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong",
                 f"busbw/{backend} med (min-max)")]
    for r in result["rows"]:
        name = f"auto={r['pick']}" if r["algorithm"] == "auto" else r["algorithm"]
        line = fmt(r["size"], r["count"], r["type"], name, f"{r['time_us']:.1f}", f"{r['algbw']:.3f}",
                   f"{r['busbw']:.3f}", r["wrong"],
                   f"{r['vs_gloo']:.2f} ({r['vs_gloo_rounds']['min']:.2f}-{r['vs_gloo_rounds']['max']:.2f})")
        if r["algorithm"] == "auto":
            line += f"  predicted {r['predicted_us']:.1f} us; fastest measured: {r['fastest']}"
            if r.get("pick_vs_fastest") and not r["pick_is_fastest"]:
                line += f" ({r['pick']} took {r['pick_vs_fastest']:.2f}x its time)"
        lines.append(line)
    link, t = result["link"], result["target"]
    lines.append(f"ratios: of medians, then (min-max) of the same ratio round by round over {c['iters']} rounds")
    if "load" in result:  # main's: run alone does not know the run's conditions
        lines.append(format_load(result["load"]))
    lines.append(f"auto measured the link again {max(result['remeasures'])} time(s) during the run; "
                 f"checked calls late enough to compare through the store, per rank: "
                 f"{', '.join(map(str, result['late_calls']))}")
    lines.append(f"link: alpha {link['alpha'] * 1e6:.2f} us, beta {link['beta'] * 1e9:.3f} ns/B, "
                 f"gamma {link['gamma'] * 1e9:.3f} ns/B, duplex {link.get('duplex', 0.0):.2f}"
                 f" +- {link.get('duplex_spread', 0.0):.2f}")
    if t["auto_vs_gloo_min"] is not None:
        lines.append(f"target auto busbw >= 1.0 x {backend} from 64 KiB to 64 MiB: "
                     f"worst {t['auto_vs_gloo_min']:.2f} -> "
                     f"{'met' if t['auto_vs_gloo_min'] >= 1.0 else 'NOT met'}")
    if t.get("checked_vs_gloo_min") is not None:
        lines.append("  with the per-call check (allreduce's default): "
                     f"worst {t['checked_vs_gloo_min']:.2f} x {backend} "
                     f"(worst single round {t['checked_vs_gloo_round_min']:.2f})")
    share = t["auto_picks_within_5pct"] / t["sizes"]
    lines.append(f"target auto picks the measured-fastest algorithm, or one within 5% of its time, at >= 90% of "
                 f"sizes: {t['auto_picks_within_5pct']}/{t['sizes']} -> {'met' if share >= 0.9 else 'NOT met'} "
                 f"(the fastest itself at {t['auto_picks_fastest']})")
    if t.get("pick_vs_fastest_max") is not None:
        lines.append(f"  where it missed, the pick took at most {t['pick_vs_fastest_max']:.2f}x the fastest's time")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """busbw against size, one line per implementation, to a PNG at `path` (atomically)."""
    from manualdp.support.plot import new_figure, save_figure

    fig, (ax,) = new_figure(1, 1, width=6.5, height=4.2)
    for name in dict.fromkeys(r["algorithm"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["algorithm"] == name]
        ax.plot([r["size"] for r in rows], [r["busbw"] for r in rows], marker="o", label=name,
                linestyle="--" if name == _peer(result["config"]) else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size per rank (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    c = result["config"]
    ax.set_title(f"allreduce across {c['world_size']} processes, {c.get('backend', 'gloo')}, {c['dtype']}")
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """`python bench/allreduce.py --spmd`: the table; optionally JSON and a PNG."""
    parser = argparse.ArgumentParser(prog="bench/allreduce.py --spmd", description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--min-bytes", type=int, default=4096, help="smallest size per rank (default 4 KiB)")
    parser.add_argument("--max-bytes", type=int, default=64 * MiB, help="largest size per rank (default 64 MiB)")
    parser.add_argument("--factor", type=int, default=4, help="ratio between consecutive sizes (default 4)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--algorithms", nargs="+", choices=sorted(ALGORITHMS), default=sorted(ALGORITHMS))
    parser.add_argument("--iters", type=int, default=10, help="timed runs per point (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    parser.add_argument("--segment-bytes", type=int, default=1 << 20,
                        help="manualdp's message segments (default 1 MiB)")
    parser.add_argument("--threads", type=int, help="torch threads per rank (default: cores / world size)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    parser.add_argument("--backend", choices=BACKENDS, default="gloo",
                        help="gloo (CPUs, default) or nccl (a GPU per rank)")
    add_load_option(parser)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="plot busbw against size to a PNG")
    args = parser.parse_args(argv)
    check_output_paths(parser, args)
    check_backend(parser, args.backend, args.world_size)
    element_size = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    checks = [
        (args.world_size >= 2, f"--world-size must be >= 2, got {args.world_size}"),
        (args.iters >= 1 and args.warmup >= 0,
         f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}"),
        (args.factor >= 2, f"--factor must be >= 2, got {args.factor}"),
        (args.segment_bytes >= 1, f"--segment-bytes must be >= 1, got {args.segment_bytes}"),
        (args.threads is None or args.threads >= 1, f"--threads must be >= 1, got {args.threads}"),
        (args.timeout > 0, f"--timeout must be > 0, got {args.timeout}"),
        (0 < args.min_bytes <= args.max_bytes,
         f"need 0 < --min-bytes <= --max-bytes, got {args.min_bytes} and {args.max_bytes}"),
        (args.min_bytes % element_size == 0,
         f"--min-bytes must be a multiple of {element_size} ({args.dtype}), got {args.min_bytes}"),
    ]
    for ok, message in checks:
        if not ok:
            parser.error(message)
    sizes = [args.min_bytes]
    while sizes[-1] * args.factor <= args.max_bytes:
        sizes.append(sizes[-1] * args.factor)
    config = {"world_size": args.world_size, "sizes": sizes, "dtype": args.dtype, "algorithms": args.algorithms,
              "iters": args.iters, "warmup": args.warmup, "segment_bytes": args.segment_bytes, "timeout": args.timeout,
              "backend": args.backend,
              "threads": args.threads or max(1, (os.cpu_count() or 1) // args.world_size)}
    with measured_load(args.load) as load:  # sampled here: the load average is the machine's, not a rank's
        result = run(config)
    result["load"] = load
    print(format_table(result))
    save_outputs(result, args.json, args.plot, plot)
    return 1 if any(r["wrong"] for r in result["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
