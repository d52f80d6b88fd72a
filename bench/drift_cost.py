"""What the replicas' drift check costs: one check against one training step of the drop-in, on 2 ranks.

    python bench/drift_cost.py                       # LeNet, batch 64 a rank, 2 ranks
    python bench/drift_cost.py --model mlp --world-size 4 --steps 60

The drop-in trains with the check off (`drift_check_every=0`); each round times `--steps` steps,
then `--steps` calls of the check alone (`manualdp.spmd.ladder.drift.check_replicas`), in turns, so
that machine noise hits both alike. One row: the median step and check times, and the check's
share of a step at the default interval (`DRIFT_CHECK_EVERY`): check / (every * step).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

__all__ = ["main"]


def _rank(model_name: str, batch: int, steps: int, rounds: int) -> dict:
    from manualdp.distributed import DistributedDataParallel
    from manualdp.spmd.ladder.drift import DRIFT_CHECK_EVERY, check_replicas
    from manualdp.support.models import get_model
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DistributedDataParallel(get_model(model_name), drift_check_every=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def check() -> None:
        check_replicas(model.module.named_parameters(), who="bench", step=0)

    for fn in (step, check):  # warm up
        for _ in range(3):
            fn()
    times = {"step": [], "check": []}
    for _ in range(rounds):
        for name, fn in (("step", step), ("check", check)):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append((time.perf_counter() - start) / steps)
    step_s, check_s = statistics.median(times["step"]), statistics.median(times["check"])
    return {"model": model_name, "parameters": sum(p.numel() for p in model.parameters()),
            "step_ms": step_s * 1e3, "check_ms": check_s * 1e3, "every": DRIFT_CHECK_EVERY,
            "share": check_s / (DRIFT_CHECK_EVERY * step_s)}


def main(argv: list[str] | None = None) -> dict:
    from manualdp.spmd import launch
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lenet", choices=("lenet", "mlp", "resnet18"))
    p.add_argument("--batch-size", type=int, default=64, help="examples per rank")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="steps (and checks) per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    row = launch(_rank, args.world_size, (args.model, args.batch_size, args.steps, args.rounds), timeout=1800)[0]
    print(f"{'model':>8} {'params':>9} {'step ms':>8} {'check ms':>9} {'every':>6} {'share':>7}")
    print(f"{row['model']:>8} {row['parameters']:>9} {row['step_ms']:>8.2f} {row['check_ms']:>9.3f} "
          f"{row['every']:>6} {row['share']:>7.2%}")
    return row


if __name__ == "__main__":
    main()
