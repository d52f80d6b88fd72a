"""Data time per rank: loading whole global batches and slicing, against loading only the rank's shard.

    python bench/data.py --world-sizes 2 4 --rounds 3
    python bench/data.py --json data.json

Each rank of `train_spmd` needs only its slice of every global batch. Before
`manualdp.spmd.shard_loader`, every rank read and collated the whole global batch and
sliced it (`manualdp.spmd.shard`); now each rank's loader reads and collates only its own
examples. Loading is the same work on every rank and needs no peer, so one process times
one rank's epoch of each kind, in turns (whole, shard, whole, shard, ...), and reports the
median per epoch. Both kinds are checked to give the same batches first.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import check_output_paths, save_outputs

__all__ = ["main", "run"]


def _epoch_whole(loader, rank: int, world_size: int) -> int:
    from manualdp.spmd.launch import shard
    n = 0
    for X, y in loader:
        Xs, _ = shard(X, y, rank, world_size)
        n += len(Xs)
    return n


def _epoch_shard(loader, rank: int, world_size: int) -> int:
    n = 0
    for X, _ in loader:
        n += len(X)
    return n


def _same_batches(make_loader, rank: int, world_size: int) -> bool:
    from manualdp.spmd import shard_loader
    from manualdp.spmd.launch import shard
    whole = [shard(X, y, rank, world_size) for X, y in make_loader()]
    mine = list(shard_loader(make_loader(), rank, world_size))
    return len(whole) == len(mine) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                           for a, b in zip(whole, mine))


def run(world_sizes: list[int], batch_size: int, num_train: int, rounds: int, rank: int = 0) -> dict:
    """Median seconds per epoch of rank `rank` loading whole global batches vs its shard, per world size."""
    from manualdp.spmd import shard_loader
    from manualdp.support.data import load_data

    dataset = load_data("synthetic", batch_size, num_train=num_train, num_test=batch_size, seed=0)[0].dataset

    def make_loader():  # as load_data builds it: shuffled by a seeded generator, short last batch dropped
        return DataLoader(dataset, batch_size, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(0))

    rows = []
    for w in world_sizes:
        if not _same_batches(make_loader, rank, w):
            raise RuntimeError(f"world size {w}: shard_loader's batches differ from sliced global batches")
        times = {"whole": [], "shard": []}
        for r in range(rounds + 1):  # the first round warms up
            for kind, epoch in (("whole", _epoch_whole), ("shard", _epoch_shard)):
                loader = make_loader() if kind == "whole" else shard_loader(make_loader(), rank, w)
                start = time.perf_counter()
                epoch(loader, rank, w)
                if r:
                    times[kind].append(time.perf_counter() - start)
        whole, mine = statistics.median(times["whole"]), statistics.median(times["shard"])
        steps = num_train // batch_size
        rows.append({"world_size": w, "whole_s": whole, "shard_s": mine,
                     "saved_ms_per_step": (whole - mine) / steps * 1e3,
                     "speedup": whole / mine, "times": times})
    return {"config": {"world_sizes": world_sizes, "batch_size": batch_size, "num_train": num_train, "rounds": rounds,
                       "rank": rank, "torch": torch.__version__}, "rows": rows}


def format_table(result: dict) -> str:
    c = result["config"]
    fmt = "{:>6} {:>14} {:>14} {:>9} {:>16}".format
    lines = [f"data time of rank {c['rank']} per epoch: {c['num_train']} synthetic examples, global batch "
             f"{c['batch_size']}, median of {c['rounds']} rounds after a warm-up, torch {c['torch']}",
             fmt("ranks", "whole+slice(s)", "own shard(s)", "speedup", "saved ms/step")]
    for r in result["rows"]:
        lines.append(fmt(r["world_size"], f"{r['whole_s']:.3f}", f"{r['shard_s']:.3f}", f"{r['speedup']:.2f}",
                         f"{r['saved_ms_per_step']:.2f}"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python bench/data.py`: print what loading only each rank's shard saves."""
    parser = argparse.ArgumentParser(prog="bench/data.py", description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="ranks to shard over (default 2 4)")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size (default 256)")
    parser.add_argument("--num-train", type=int, default=60000, help="examples per epoch (default 60000)")
    parser.add_argument("--rounds", type=int, default=3, help="timed epochs of each kind (default 3)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    for name in ("batch_size", "num_train", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive int, got {getattr(args, name)}")
    if any(w < 1 for w in args.world_sizes):
        parser.error(f"--world-sizes must be positive ints, got {args.world_sizes}")
    if args.batch_size < max(args.world_sizes) or args.num_train < args.batch_size:
        parser.error(f"need num_train >= batch_size >= world size, got {args.num_train}, {args.batch_size}, "
                     f"{max(args.world_sizes)}")
    check_output_paths(parser, args)
    result = run(args.world_sizes, args.batch_size, args.num_train, args.rounds)
    print(format_table(result))
    save_outputs(result, args.json, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
