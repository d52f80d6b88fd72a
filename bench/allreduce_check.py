"""Where the time of `manualdp.spmd.allreduce` goes at small sizes: its call check, its data, and gloo's.

    python bench/allreduce_check.py                       # 2 ranks, 64 KiB to 4 MiB
    python bench/allreduce_check.py --world-size 4 --calls 50

Four ways, timed in turns in the same processes, each call after a barrier: `check_same_call`
alone (the fixed-size exchange of fingerprints, as DDP runs it once a step), `allreduce(check=False)`
(the data alone), `allreduce()` (the default: at two ranks the data on its fingerprint's tag, nothing
more; from three ranks on the headers beside the first round of data) and
`torch.distributed.all_reduce`. Medians of rank 0's times. The default's excess over "data
alone" is what the check costs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import check_output_paths, save_outputs  # noqa: E402
from manualdp.spmd.launch import launch  # noqa: E402

__all__ = ["main"]

WAYS = ("check alone", "data alone", "default", "gloo all_reduce")


def _rank(sizes: list[int], calls: int, warmup: int) -> dict:
    import torch.distributed as dist

    from manualdp.spmd import allreduce
    from manualdp.spmd.transport.call_check import check_same_call
    from manualdp.spmd.auto.tune import resolve

    out = {}
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4))
        ways = {"check alone": lambda: check_same_call(x, "auto", 1 << 20, None, None),
                "data alone": lambda: allreduce(x, check=False),
                "default": lambda: allreduce(x),
                "gloo all_reduce": lambda: dist.all_reduce(x)}
        times: dict = {k: [] for k in ways}
        for i in range(warmup + calls):
            for k, f in ways.items():
                dist.barrier()
                start = time.perf_counter()
                f()
                if i >= warmup:
                    times[k].append(time.perf_counter() - start)
        out[nbytes] = {"pick": resolve("auto", x.numel(), 4),
                       **{k: statistics.median(v) * 1e6 for k, v in times.items()}}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2, help="ranks (default 2, at most 8)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1 << 16, 1 << 18, 1 << 20, 1 << 22], help="bytes per rank")
    p.add_argument("--calls", type=int, default=100, help="timed calls per way and size (default 100)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not 2 <= args.world_size <= 8:
        p.error(f"--world-size must be 2 to 8, got {args.world_size}")
    if args.calls < 1 or args.warmup < 0 or min(args.sizes) < 4:
        p.error("--calls must be >= 1, --warmup >= 0 and every size >= 4 bytes")
    check_output_paths(p, args)
    res = launch(_rank, args.world_size, (args.sizes, args.calls, args.warmup), timeout=1200)[0]
    print(f"{'bytes':>9} {'auto':>17} " + " ".join(f"{w:>16}" for w in WAYS) + "  (us, rank 0, medians)")
    for nbytes, row in res.items():
        print(f"{nbytes:>9} {row['pick']:>17} " + " ".join(f"{row[w]:>16.1f}" for w in WAYS))
    save_outputs({"config": vars(args), "rows": {str(k): v for k, v in res.items()}}, args.json, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
