"""Where `manualdp.spmd.allreduce`'s own work goes per call, beside gloo's: CPU time and counts, not wall time.

    python bench/allreduce_profile.py                        # 2 ranks, 64 KiB to 1 MiB, 300 calls each
    python bench/allreduce_profile.py --world-size 3 --calls 100 --top 15

Per rank and size, in the same processes, after a warm-up: the caller thread's CPU time per call
(`time.thread_time`) and the whole process's (`time.process_time`: gloo's threads and ours too)
of `allreduce(x)` (auto + the check), `allreduce(x, check=False)` and `dist.all_reduce(x)`; then
one cProfile of the default's calls: Python calls per call and the top entries by own time.
Load on a shared host changes wall times a lot and CPU times and counts little: this is what to
compare before and after a change to the engine's per-call path.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from manualdp.spmd.launch import launch  # noqa: E402
from manualdp.validate import positive_int  # noqa: E402

__all__ = ["main", "cpu_per_call"]

SIZES = (64 << 10, 256 << 10, 1 << 20)


def cpu_per_call(fn, calls: int) -> tuple[float, float]:
    """Microseconds of this thread's and this process's CPU time per call of `fn`, over `calls` calls."""
    positive_int("calls", calls)
    thread, process = time.thread_time(), time.process_time()
    for _ in range(calls):
        fn()
    return ((time.thread_time() - thread) * 1e6 / calls, (time.process_time() - process) * 1e6 / calls)


def _rank(sizes: tuple[int, ...], calls: int, top: int) -> dict:
    import torch
    import torch.distributed as dist

    from manualdp.spmd import allreduce
    from manualdp.spmd.transport.group import group_state

    out, state = {}, group_state()
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        ways = {"default": lambda: allreduce(x), "unchecked": lambda: allreduce(x, check=False),
                "gloo": lambda: dist.all_reduce(x)}
        for f in ways.values():  # warm up: the link agreed, scratch space and works in place
            for _ in range(20):
                f()
        row = {}
        for name, f in ways.items():
            dist.barrier()
            row[name] = cpu_per_call(f, calls)
        dist.barrier()
        profile = cProfile.Profile()
        profile.runcall(lambda: [allreduce(x) for _ in range(calls)])
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(top)
        row["python_calls"] = stats.total_calls / calls
        row["profile"] = text.getvalue()
        row["remeasures"], row["late"] = state.remeasures, state.late.late_calls if state.late else 0
        out[nbytes] = row
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--top", type=int, default=12, help="profile entries to print (rank 0)")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="bytes per call")
    args = parser.parse_args(argv)
    positive_int("world_size", args.world_size)
    positive_int("calls", args.calls)
    positive_int("top", args.top)
    for s in args.sizes:
        positive_int("sizes", s)
    results = launch(_rank, args.world_size, (tuple(args.sizes), args.calls, args.top), timeout=600.0)
    for nbytes in args.sizes:
        print(f"== {nbytes} bytes, {args.world_size} ranks: CPU us per call (caller thread / whole process)")
        for rank, out in enumerate(results):
            row = out[nbytes]
            ways = "  ".join(f"{k} {row[k][0]:.0f}/{row[k][1]:.0f}" for k in ("default", "unchecked", "gloo"))
            print(f"rank {rank}: {ways}  python calls per default call {row['python_calls']:.0f}; "
                  f"link measured again {row['remeasures']}, late calls {row['late']} (so far)")
        print(results[0][nbytes]["profile"])


if __name__ == "__main__":
    main()
