"""Allreduce on simulated CPU devices: nccl-tests columns, bandwidth against memcpy, a fitted cost model.

    python bench/allreduce.py --devices 4 --json allreduce.json --plot allreduce.png
    python bench/allreduce.py --devices 4
    python bench/allreduce.py --devices 4 --load    # with one busy process per core, started and stopped here

For every size S (bytes per device) and every algorithm, one row with the columns nccl-tests
prints: size, count, type, time (median, us), algbw = S / time, busbw = algbw * 2(n-1)/n, and
#wrong, the elements that differ from a reference sum after the timed runs (inputs are small
integers, so every summation order gives the exact sum and #wrong must be 0).

Effective bandwidth counts the bytes the schedule makes memory read and write: a reduce
transfer of b bytes reads two chunks and writes one (3b), a copy reads one and writes one
(2b). It is compared with memcpy bandwidth: read + write bytes per second (median) of the
`dst.copy_(src)` that resets every device's input before each timed run, so the peer moves the
same working set through the same memory, interleaved run by run with the allreduce.

Model: one Python thread performs every transfer in turn, so a round takes the sum of its
transfers, not the max over devices as on real devices (`manualdp.cost.cost`):
time = alpha * transfers + beta * bytes moved + gamma * bytes added, fitted by non-negative
least squares on relative error over all rows. The link between simulated devices is memory,
which is several times slower once the working set leaves the CPU cache, so the "model"
columns count bytes in units of the row's measured memcpy time per byte; the "const" columns
keep one bandwidth for every size, as the textbook model does.

Each timed allreduce starts from inputs copied from a pristine buffer (allreduce sums in
place); that copy is timed apart, as the memcpy peer. One thread by default (`--threads`): the simulated devices share
the CPU, and one thread keeps timings steady on a busy machine.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import check_output_paths, save_outputs
from bench.spread import add_load_option, format_load, measured_load, spread
from manualdp.allreduce import _swaps, allreduce
from manualdp.schedule import ALGORITHMS, Schedule, chunk_sizes, get_schedule

__all__ = [
    "DTYPES", "Measurement", "time_in_process", "memory_bytes", "serial_features", "fit_cost",
    "sweep", "format_table", "plot", "main",
]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}
MiB = 1 << 20


@dataclass
class Measurement:
    times: list[float]       # seconds of each timed allreduce
    copy_times: list[float]  # seconds of the memcpy that reset the inputs before each of them
    wrong: int               # elements, over all devices, that differ from the reference sum


# A timer runs one (algorithm, size) point: (algorithm, numel, dtype, num_devices, iters, warmup) -> Measurement.
# The SPMD mode (one process per device) plugs in here with its own timer and its own model features.
Timer = Callable[[str, int, torch.dtype, int, int, int], Measurement]


def _inputs(num_devices: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(numel)
    # Small integers: every summation order is exact, so the check can demand equality.
    return [torch.randint(-8, 8, (numel,), generator=g).to(dtype) for _ in range(num_devices)]


def time_in_process(algorithm: str, numel: int, dtype: torch.dtype, num_devices: int, iters: int,
                    warmup: int) -> Measurement:
    """Time `allreduce` on `num_devices` simulated devices, and the memcpy that resets its inputs before each run."""
    pristine = _inputs(num_devices, numel, dtype)
    expected = pristine[0].clone()
    for p in pristine[1:]:
        expected += p
    work = [p.clone() for p in pristine]
    times, copy_times = [], []
    for i in range(warmup + iters):
        # The reset is the memcpy peer: same bytes, same memory, interleaved run by run with the allreduce.
        start = time.perf_counter()
        for w, p in zip(work, pristine):
            w.copy_(p)
        middle = time.perf_counter()
        allreduce(work, algorithm)
        end = time.perf_counter()
        if i >= warmup:
            copy_times.append(middle - start)
            times.append(end - middle)
    wrong = sum(int((w != expected).sum()) for w in work)
    return Measurement(times, copy_times, wrong)


def _chunk_bytes(schedule: Schedule, nbytes: int, element_size: int) -> list[int]:
    return [s * element_size for s in chunk_sizes(nbytes // element_size, schedule.num_chunks)]


def memory_bytes(schedule: Schedule, nbytes: int, element_size: int) -> int:
    """Bytes read and written by running `schedule` on `nbytes` per device: 3 per added byte, 2 per copied byte."""
    return sum((3 if adds else 2) * size for size, adds in _executed(schedule, nbytes, element_size))


def serial_features(schedule: Schedule, nbytes: int, element_size: int) -> tuple[int, int, int]:
    """(transfers, bytes moved, bytes added) over the whole schedule: the single controller does them one by one."""
    done = _executed(schedule, nbytes, element_size)
    return len(done), sum(size for size, _ in done), sum(size for size, adds in done if adds)


def _executed(schedule: Schedule, nbytes: int, element_size: int) -> list[tuple[int, bool]]:
    """(bytes, whether added) of each transfer as the single controller runs it: empty chunks skipped, and of two
    partners that swap a chunk and both add it (recursive doubling), the second copies the first's sum back."""
    sizes = _chunk_bytes(schedule, nbytes, element_size)
    out = []
    for rnd in schedule.rounds:
        swaps, added = _swaps(rnd), set()
        for t in rnd:
            if sizes[t.chunk]:
                copied_back = (t.src, t.dst, t.chunk) in swaps and (t.dst, t.src, t.chunk) in added
                out.append((sizes[t.chunk], t.reduce and not copied_back))
                added.add((t.src, t.dst, t.chunk))
    return out


def fit_cost(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative least squares of `features @ x ~ seconds`, on relative error; exact for 3 unknowns.

    Tries every set of free coefficients (the others pinned to 0) and keeps the best
    non-negative solution; with 3 coefficients that is 7 small solves.
    """
    features = np.asarray(features, dtype=float)
    seconds = np.asarray(seconds, dtype=float)
    if features.ndim != 2 or len(features) != len(seconds) or len(seconds) == 0:
        raise ValueError(f"features must be (rows, k) and match seconds, got {features.shape} and {seconds.shape}")
    if not np.all(seconds > 0):
        raise ValueError("seconds must all be positive")
    A, b = features / seconds[:, None], np.ones(len(seconds))  # relative: small sizes count as much as big ones
    best, best_residual = np.zeros(features.shape[1]), float(b @ b)
    for k in range(1, features.shape[1] + 1):
        for free in itertools.combinations(range(features.shape[1]), k):
            sol, *_ = np.linalg.lstsq(A[:, free], b, rcond=None)
            if np.all(sol >= 0):
                x = np.zeros(features.shape[1])
                x[list(free)] = sol
                residual = float(np.sum((A @ x - b) ** 2))
                if residual < best_residual:
                    best, best_residual = x, residual
    return best


def sweep(
    sizes: list[int],
    algorithms: list[str],
    num_devices: int,
    dtype: torch.dtype,
    iters: int,
    warmup: int,
    timer: Timer = time_in_process,
    features: Callable[[Schedule, int, int], tuple[int, int, int]] = serial_features,
    progress: bool = True,
) -> dict:
    """Measure every (size, algorithm) with its memcpy peer, fit the model; return everything as a dict."""
    from tqdm import tqdm

    element_size = torch.empty((), dtype=dtype).element_size()
    for algorithm in algorithms:  # first calls pay one-time costs (code paths, allocator); keep them out of row 1
        timer(algorithm, sizes[0] // element_size, dtype, num_devices, 1, warmup)
    rows = []
    points = [(size, algorithm) for size in sizes for algorithm in algorithms]
    for size, algorithm in tqdm(points, desc="allreduce", disable=not progress, file=sys.stderr):
        m = timer(algorithm, size // element_size, dtype, num_devices, iters, warmup)
        t = statistics.median(m.times)
        schedule = get_schedule(algorithm, num_devices)
        algbw = size / t / 1e9
        rows.append({
            "algorithm": algorithm, "size": size, "count": size // element_size,
            "type": str(dtype).removeprefix("torch."),
            "time_us": t * 1e6, "algbw": algbw, "busbw": algbw * 2 * (num_devices - 1) / num_devices, "wrong": m.wrong,
            "effbw": memory_bytes(schedule, size, element_size) / t / 1e9,
            "memcpy": 2 * num_devices * size / statistics.median(m.copy_times) / 1e9,
            "features": list(features(schedule, size, element_size)), "times_us": [x * 1e6 for x in m.times],
            # run by run: the allreduce's effective bandwidth over the memcpy that reset its inputs just before
            "eff_ratio_runs": spread([memory_bytes(schedule, size, element_size) * c / (2 * num_devices * size * t)
                                      for t, c in zip(m.times, m.copy_times)]),
        })
    seconds = np.array([r["time_us"] for r in rows]) / 1e6
    textbook = np.array([r["features"] for r in rows], dtype=float)
    # The link of a simulated device is memory, whose speed falls several times once the working set
    # leaves the cache; so bytes are also counted in seconds of memcpy at the row's own working set.
    copy_seconds_per_byte = np.array([2 / (r["memcpy"] * 1e9) for r in rows])
    in_memcpy_time = textbook * np.c_[np.ones(len(rows)), copy_seconds_per_byte, copy_seconds_per_byte]
    fits = {"memcpy": fit_cost(in_memcpy_time, seconds), "constant": fit_cost(textbook, seconds)}
    for r, x_mem, x_const in zip(rows, in_memcpy_time, textbook):
        r["eff_ratio"] = r["effbw"] / r["memcpy"]
        r["model_us"] = float(x_mem @ fits["memcpy"]) * 1e6
        r["model_err"] = r["model_us"] / r["time_us"] - 1
        r["constant_model_us"] = float(x_const @ fits["constant"]) * 1e6
        r["constant_model_err"] = r["constant_model_us"] / r["time_us"] - 1
    return {
        "config": {"devices": num_devices, "dtype": str(dtype).removeprefix("torch."), "iters": iters, "warmup": warmup,
                   "threads": torch.get_num_threads(), "torch": torch.__version__},
        "model": {  # beta and gamma in memcpy-seconds per byte: 1.0 means as fast as memcpy
            "alpha_s": float(fits["memcpy"][0]), "beta": float(fits["memcpy"][1]), "gamma": float(fits["memcpy"][2])},
        "constant_model": {
            "alpha_s": float(fits["constant"][0]), "beta_s_per_byte": float(fits["constant"][1]),
            "gamma_s_per_byte": float(fits["constant"][2])},
        "rows": rows,
        "targets": _targets(rows),
    }


def _targets(rows: list[dict]) -> dict:
    big = [r for r in rows if r["size"] >= 16 * MiB]
    mid = [r for r in rows if r["size"] >= MiB]
    return {
        "effbw_over_memcpy_min_16MiB": min((r["eff_ratio"] for r in big), default=None),
        "model_abs_err_max_1MiB": max((abs(r["model_err"]) for r in mid), default=None),
        "constant_model_abs_err_max_1MiB": max((abs(r["constant_model_err"]) for r in mid), default=None),
    }


def format_table(result: dict) -> str:
    """The result as text: one block per algorithm, one row per size."""
    c, m, k = result["config"], result["model"], result["constant_model"]
    head = ("size", "count", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong",
            "effbw(GB/s)", "memcpy(GB/s)", "eff/memcpy(min-max)", "model(us)", "err", "const(us)", "err")
    fmt = "{:>9} {:>9} {:>7} {:>9} {:>11} {:>11} {:>6} {:>11} {:>12} {:>17} {:>9} {:>5} {:>9} {:>5}".format
    out = [
        f"allreduce on {c['devices']} simulated devices, {c['dtype']}, median of {c['iters']} runs "
        f"after {c['warmup']} warm-up, {c['threads']} thread(s), torch {c['torch']}",
        f"model: alpha = {m['alpha_s'] * 1e6:.3f} us per transfer, beta = {m['beta']:.3f} per byte moved, "
        f"gamma = {m['gamma']:.3f} per byte added, in units of the row's memcpy time per byte "
        f"(beta + gamma/2 = {m['beta'] + m['gamma'] / 2:.3f})",
        f"const: alpha = {k['alpha_s'] * 1e6:.3f} us per transfer, "
        f"beta = {k['beta_s_per_byte'] * 1e12:.2f} ps per byte moved, "
        f"gamma = {k['gamma_s_per_byte'] * 1e12:.2f} ps per byte added, one bandwidth for every size "
        f"(beta + gamma/2 = {(k['beta_s_per_byte'] + k['gamma_s_per_byte'] / 2) * 1e12:.2f} ps)",
        "(every schedule adds half the bytes it moves, so the timings fix only beta + gamma/2, "
        "not beta and gamma apart)",
    ]
    for algorithm in dict.fromkeys(r["algorithm"] for r in result["rows"]):
        out += ["", f"# {algorithm}", fmt(*head)]
        for r in (r for r in result["rows"] if r["algorithm"] == algorithm):
            out.append(fmt(
                r["size"], r["count"], r["type"], f"{r['time_us']:.1f}", f"{r['algbw']:.2f}", f"{r['busbw']:.2f}",
                r["wrong"], f"{r['effbw']:.2f}", f"{r['memcpy']:.2f}",
                f"{r['eff_ratio']:.2f} ({r['eff_ratio_runs']['min']:.2f}-{r['eff_ratio_runs']['max']:.2f})",
                f"{r['model_us']:.1f}",
                f"{r['model_err']:+.0%}", f"{r['constant_model_us']:.1f}", f"{r['constant_model_err']:+.0%}",
            ))
    t = result["targets"]
    out += ["", "eff/memcpy: of the medians, then (min-max) of the same ratio run by run"]
    if "load" in result:  # main's: sweep alone does not know the run's conditions
        out.append(format_load(result["load"]))
    if t["effbw_over_memcpy_min_16MiB"] is not None:
        worst = t["effbw_over_memcpy_min_16MiB"]
        out.append(f"target effbw >= 0.7 x memcpy for sizes >= 16 MiB: worst {worst:.2f} -> {_met(worst >= 0.7)}")
    if t["model_abs_err_max_1MiB"] is not None:
        worst, const = t["model_abs_err_max_1MiB"], t["constant_model_abs_err_max_1MiB"]
        out.append(f"target model within 30% for sizes >= 1 MiB: worst {worst:.1%} -> {_met(worst <= 0.3)} "
                   f"(const model: worst {const:.1%} -> {_met(const <= 0.3)})")
    return "\n".join(out)


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def plot(result: dict, path: str) -> None:
    """busbw and effective bandwidth against size, one line per algorithm, to a PNG at `path` (atomically)."""
    from manualdp.support.plot import new_figure, save_figure

    fig, (ax_bus, ax_eff) = new_figure(1, 2, width=11, height=4.2)
    for algorithm in dict.fromkeys(r["algorithm"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["algorithm"] == algorithm]
        ax_bus.plot([r["size"] for r in rows], [r["busbw"] for r in rows], marker="o", label=algorithm)
        ax_eff.plot([r["size"] for r in rows], [r["effbw"] for r in rows], marker="o", label=algorithm)
    c = result["config"]
    sizes = sorted({r["size"] for r in result["rows"]})
    memcpy = [statistics.median(r["memcpy"] for r in result["rows"] if r["size"] == size) for size in sizes]
    ax_eff.plot(sizes, memcpy, color="gray", linestyle="--", label="memcpy (same run)")
    for ax, ylabel in ((ax_bus, "busbw (GB/s)"), (ax_eff, "effective bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size per device (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"allreduce, {c['devices']} simulated devices, {c['dtype']}")
    save_figure(fig, path, dpi=120)


def _sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def main(argv: list[str] | None = None) -> int:
    """`python bench/allreduce.py`: the sweep, printed as a table; optionally JSON and a PNG."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--spmd" in argv:  # one process per device: its own module and options
        from bench.allreduce_spmd import main as spmd_main
        return spmd_main([a for a in argv if a != "--spmd"])
    parser = argparse.ArgumentParser(prog="bench/allreduce.py", description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=4, help="simulated devices (default 4)")
    parser.add_argument("--min-bytes", type=int, default=4096, help="smallest size per device (default 4 KiB)")
    parser.add_argument("--max-bytes", type=int, default=64 * MiB, help="largest size per device (default 64 MiB)")
    parser.add_argument("--factor", type=int, default=2, help="ratio between consecutive sizes (default 2)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--algorithms", nargs="+", choices=sorted(ALGORITHMS), default=sorted(ALGORITHMS))
    parser.add_argument("--iters", type=int, default=20, help="timed runs per point (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 keeps torch's default)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="plot busbw and effective bandwidth against size to a PNG")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_load_option(parser)
    parser.add_argument("--spmd", action="store_true",
                        help="across processes over torch.distributed instead, against gloo's all_reduce "
                             "(options: python bench/allreduce.py --spmd --help)")
    args = parser.parse_args(argv)
    check_output_paths(parser, args)

    element_size = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    checks = [
        (args.devices >= 1, f"--devices must be >= 1, got {args.devices}"),
        (args.iters >= 1 and args.warmup >= 0,
         f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}"),
        (args.factor >= 2, f"--factor must be >= 2, got {args.factor}"),
        (args.threads >= 0, f"--threads must be >= 0, got {args.threads}"),
        (0 < args.min_bytes <= args.max_bytes,
         f"need 0 < --min-bytes <= --max-bytes, got {args.min_bytes} and {args.max_bytes}"),
        (args.min_bytes % element_size == 0,
         f"--min-bytes must be a multiple of {element_size} ({args.dtype}), got {args.min_bytes}"),
    ]
    for ok, message in checks:
        if not ok:
            parser.error(message)

    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with measured_load(args.load) as load:
            result = sweep(_sizes(args.min_bytes, args.max_bytes, args.factor), args.algorithms, args.devices,
                           DTYPES[args.dtype], args.iters, args.warmup, progress=not args.no_progress)
    finally:
        torch.set_num_threads(threads)
    result["load"] = load
    print(format_table(result))
    save_outputs(result, args.json, args.plot, plot)
    return 1 if any(r["wrong"] for r in result["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
