"""What the ladder's per-forward buffer check costs: a rung with it against the same rung without it, and torch's DDP.

    python bench/buffer_check.py                      # 2 ranks, a small MLP with BatchNorm, 20 rounds
    python bench/buffer_check.py --width 1024 --rounds 30

A rung with buffers (BatchNorm's running statistics) copies rank 0's buffers before every
forward pass with grad, as torch's DDP does, by manualdp's broadcast, whose call check carries the
step (`NaiveDDP.copy_buffers`): a rank that runs one forward pass more raises naming the step.
This times training steps of three wrappers over the same model, in each rank, taking turns in
blocks of `--steps` steps (the order rotating every round, so that a busy moment of the machine
falls on all alike): the rung, the rung copying its buffers by torch's broadcast with no check
(as it did before the check), and torch's DDP. Reported: each one's median step time over the rounds, and the ratios.
A small model makes the check's share visible; on a real one it is smaller still.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

__all__ = ["main"]


def _job(width: int, batch: int, steps: int, rounds: int, warmup: int) -> dict:
    import warnings

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from manualdp.spmd import NaiveDDP
    from manualdp.spmd.transport.agree import broadcast_from_rank0

    torch.set_num_threads(1)
    rank = dist.get_rank()

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 10))

    unchecked = NaiveDDP(net())
    # torch's broadcast of the same buffers, no header: the copy the rung made before it checked the step
    unchecked.copy_buffers = lambda: broadcast_from_rank0(unchecked.synced_buffers, None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrappers = {"checked": NaiveDDP(net()), "unchecked": unchecked, "torch": TorchDDP(net())}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in wrappers.items()}
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(rank))

    def block(name: str, n: int) -> float:
        model, opt = wrappers[name], opts[name]
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return (time.perf_counter() - start) / n

    names = list(wrappers)
    for name in names:
        block(name, warmup)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(block(name, steps))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2, choices=[2, 3, 4])
    p.add_argument("--width", type=int, default=256, help="the MLP's hidden width (default 256)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank (default 32)")
    p.add_argument("--steps", type=int, default=10, help="steps per timed block (default 10)")
    p.add_argument("--rounds", type=int, default=20, help="timed blocks per wrapper (default 20)")
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args(argv)
    for name in ("width", "batch_size", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    from manualdp.spmd import launch

    per_rank = launch(_job, args.world_size, (args.width, args.batch_size, args.steps, args.rounds, args.warmup),
                      timeout=1800)
    print(f"{args.world_size} ranks, MLP width {args.width}, batch {args.batch_size} a rank: median step time, ms")
    print(f"{'rank':>4} {'checked':>9} {'unchecked':>9} {'torch':>9} {'checked/unchecked':>18} {'checked/torch':>14}")
    for r, t in enumerate(per_rank):
        print(f"{r:>4} {t['checked'] * 1e3:9.3f} {t['unchecked'] * 1e3:9.3f} {t['torch'] * 1e3:9.3f} "
              f"{t['checked'] / t['unchecked']:18.3f} {t['checked'] / t['torch']:14.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
