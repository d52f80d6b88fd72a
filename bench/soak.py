"""Soak test: train for thousands of steps and watch resident memory.

    python bench/soak.py --mode single --steps 3000
    python bench/soak.py --mode spmd --world-size 2 --steps 3000

Resident set size (RSS) is sampled every `--interval` steps. Growth is measured from the
first sample after `--warmup` steps to the last; the target is at most 5%.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import check_output_paths
from manualdp.schedule import ALGORITHMS

__all__ = ["main", "rss_mib"]


def rss_mib() -> float:
    """Current resident set size of this process, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def _data(batch_size: int, step: int):
    g = torch.Generator().manual_seed(step % 50)  # a fixed pool of batches, no growing data set
    return torch.randn(batch_size, 1, 28, 28, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def _soak_single(args) -> list[tuple[int, float]]:
    from manualdp import cpu_devices, replicate, train_batch
    from manualdp.support.models import get_model
    torch.manual_seed(0)
    devices = cpu_devices(args.devices)
    replicas = replicate(get_model(args.model), devices)
    opts = [torch.optim.SGD(r.parameters(), lr=0.05, momentum=0.9) for r in replicas]
    samples = []
    for step in _progress(args.steps, True):
        X, y = _data(args.batch_size, step)
        train_batch(X, y, replicas, opts, devices, algorithm=args.algorithm, bucket_cap_mb=args.bucket_mb,
                    nonfinite="raise", step=step)
        if step % args.interval == 0 or step == args.steps - 1:
            samples.append((step, rss_mib()))
    return samples


def _soak_rank(args) -> list[tuple[int, float]]:
    """One rank (started by `spmd.launch`): the steps `train_spmd` takes, with the non-finite check."""
    import torch.distributed as dist

    from manualdp.runners.loop import OneRank
    from manualdp.spmd import DistributedDataParallel
    from manualdp.support.models import get_model
    from manualdp.loss import summed_loss
    torch.manual_seed(0)
    model = DistributedDataParallel(get_model(args.model), algorithm=args.algorithm,
                                    bucket_cap_mb=args.bucket_mb or 25.0, timeout=60)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rank = OneRank(model, opt, summed_loss(None), "raise", torch.device("cpu"), args.algorithm, 60, test_iter=[])
    samples = []
    for step in _progress(args.steps, dist.get_rank() == 0):
        X, y = _data(args.batch_size, step)
        rank.step(X, y, len(X), step)
        if step % args.interval == 0 or step == args.steps - 1:
            samples.append((step, rss_mib()))
    return samples


def _soak_spmd(args) -> list[tuple[int, float]]:
    from manualdp.spmd import launch
    threads = max(1, (os.cpu_count() or 1) // args.world_size)
    results = launch(_soak_rank, args.world_size, (args,), timeout=args.timeout, threads=threads)
    return max(results, key=lambda s: _growth(s, args.warmup))  # the worst rank decides


def _progress(n: int, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(range(n), desc="steps", leave=False, disable=not enabled, mininterval=1.0)


def _growth(samples, warmup: int) -> float:
    after = [rss for step, rss in samples if step >= warmup]
    return (after[-1] - after[0]) / after[0]


def _parser():
    p = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["single", "spmd"], default="single")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=300, help="steps before the baseline sample")
    p.add_argument("--interval", type=int, default=250, help="steps between RSS samples")
    p.add_argument("--model", default="lenet", choices=["lenet", "mlp", "resnet18"])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--devices", type=int, default=2, help="simulated devices (single mode)")
    p.add_argument("--world-size", type=int, default=2, help="processes (spmd mode)")
    p.add_argument("--algorithm", default="ring", choices=list(ALGORITHMS))
    p.add_argument("--bucket-mb", type=float, default=None)
    p.add_argument("--timeout", type=float, default=3600, help="seconds to wait for the ranks (spmd mode)")
    p.add_argument("--json", metavar="PATH")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    check_output_paths(parser, args)
    for name in ("steps", "interval", "batch_size", "devices", "world_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps), got {args.warmup}")
    samples = _soak_single(args) if args.mode == "single" else _soak_spmd(args)
    growth = _growth(samples, args.warmup)
    print(f"{args.mode} mode, {args.model}, batch {args.batch_size}, {args.steps} steps, allreduce {args.algorithm}")
    print(f"{'step':>7} {'RSS MiB':>9}")
    for step, rss in samples:
        print(f"{step:7d} {rss:9.1f}{'  (warm-up)' if step < args.warmup else ''}")
    verdict = "OK" if growth <= 0.05 else "FAIL"
    print(f"growth after warm-up: {100 * growth:+.2f}% (target <= +5%): {verdict}")
    if args.json:
        from manualdp.support.files import write_json_atomic
        write_json_atomic(args.json, {"args": vars(args), "samples": samples, "growth": growth})
    return 0 if growth <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
