"""Memory of ZeRO-1/2 against plain DDP, measured per rank: optimizer state, gradients and peak memory.

    python bench/zero.py --world-size 2 --json bench/results/zero_2.json
    python bench/zero.py --world-size 4 --optimizer adam

Each configuration runs in fresh processes (gloo on 127.0.0.1), so that each one's peak
memory is its own. On every rank it builds the same MLP, trains `--steps` steps and reports:
- optimizer-state bytes: summed over the tensors in the optimizer's state (measured, not computed);
- gradient bytes held after backward: every `.grad`, and what ZeRO-2 keeps instead (its shard);
- peak memory: the process's peak resident set size (`ru_maxrss`) minus its resident size
  just before the model was built, i.e. what the model, its gradients, the optimizer and
  the communication buffers added at their peak;
- the median step time, and the ratio to plain DDP (ours) and to torch's own pair.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import check_output_paths, save_outputs
from manualdp.runners.cli import positive

__all__ = ["main", "run", "format_table", "CONFIGS"]

CONFIGS = ("torch DDP", "torch ZeRO-1", "manualdp DDP", "manualdp ZeRO-1", "manualdp ZeRO-2")
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}), "adam": (torch.optim.Adam, {"lr": 1e-3}),
              "adamw": (torch.optim.AdamW, {"lr": 1e-3})}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _mlp(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    body = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*body, nn.Linear(width, 10))


def _state_bytes(optimizer) -> int:
    inner = getattr(optimizer, "optim", None) or getattr(optimizer, "optimizer", optimizer)  # torch's ZeRO: .optim
    return sum(v.numel() * v.element_size() for s in inner.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def _grad_bytes(net: nn.Module, optimizer) -> int:
    if hasattr(optimizer, "gradient_bytes"):  # ours: the .grad and its own gradient buffers
        return optimizer.gradient_bytes()
    return sum(p.grad.numel() * p.grad.element_size() for p in net.parameters() if p.grad is not None)


def _rank_main(config: dict) -> dict:
    """One rank of one configuration: build, train, measure."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from manualdp.spmd import DistributedDataParallel
    from manualdp.spmd.zero import ZeroRedundancyOptimizer

    rank, n = dist.get_rank(), dist.get_world_size()
    name = config["name"]
    cls, kw = OPTIMIZERS[config["optimizer"]]
    before = _rss_bytes()
    net = _mlp(config["width"], config["layers"])
    if name.startswith("torch"):
        model = TorchDDP(net)
        opt = TorchZero(model.parameters(), cls, **kw) if "ZeRO" in name else cls(model.parameters(), **kw)
    else:
        model = DistributedDataParallel(net)
        stage = int(name[-1]) if "ZeRO" in name else 0
        opt = ZeroRedundancyOptimizer(model.parameters(), cls, stage=stage, **kw) if stage else cls(model.parameters(), **kw)
    stage2 = getattr(opt, "reduces_gradients", False)
    g = torch.Generator().manual_seed(rank)
    X = torch.randn(config["batch_size"], config["width"], generator=g)
    y = torch.randint(0, 10, (config["batch_size"],), generator=g)
    times = []
    for _ in range(config["steps"]):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if stage2:
            with model.no_sync():
                nn.functional.cross_entropy(model(X), y).backward()
        else:
            nn.functional.cross_entropy(model(X), y).backward()
        grads = _grad_bytes(net, opt)
        opt.step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    return {"rank": rank, "world_size": n, "state_bytes": _state_bytes(opt), "grad_bytes": grads, "param_bytes": params,
            "peak_bytes": max(0, peak - before), "step_s": statistics.median(times[1:] or times)}


def run(world_size: int, optimizer: str, width: int, layers: int, batch_size: int, steps: int,
        timeout: float = 600.0) -> dict:
    """Every configuration in its own processes; one row per configuration and rank."""
    from manualdp.spmd import launch

    rows = []
    for name in CONFIGS:
        config = {"name": name, "optimizer": optimizer, "width": width, "layers": layers,
                  "batch_size": batch_size, "steps": steps}
        for result in launch(_rank_main, world_size, (config,), timeout=timeout):
            rows.append({"config": name, **result})
    return {"world_size": world_size, "optimizer": optimizer, "width": width, "layers": layers,
            "batch_size": batch_size, "steps": steps, "rows": rows}


def format_table(result: dict) -> str:
    """One line per configuration and rank, with ratios to plain DDP of the same library."""
    mib = 1 / 2**20
    base = {(r["config"].split()[0], r["rank"]): r for r in result["rows"] if r["config"].endswith("DDP")}
    lines = [f"# {result['optimizer']}, MLP {result['layers']}x{result['width']} "
             f"({result['rows'][0]['param_bytes'] * mib:.1f} MiB of parameters), world size {result['world_size']}",
             f"{'configuration':<17}{'rank':>5}{'state MiB':>11}{'state/DDP':>11}{'grad MiB':>10}{'peak MiB':>10}"
             f"{'peak/DDP':>10}"
             f"{'step ms':>9}{'time/DDP':>10}"]
    for r in result["rows"]:
        ddp = base[(r["config"].split()[0], r["rank"])]
        ratio = (lambda a, b: f"{a / b:.3f}" if b else "-")
        lines.append(f"{r['config']:<17}{r['rank']:>5}{r['state_bytes'] * mib:>11.2f}"
                     f"{ratio(r['state_bytes'], ddp['state_bytes']):>11}{r['grad_bytes'] * mib:>10.2f}"
                     f"{r['peak_bytes'] * mib:>10.1f}"
                     f"{ratio(r['peak_bytes'], ddp['peak_bytes']):>10}{r['step_s'] * 1e3:>9.1f}"
                     f"{ratio(r['step_s'], ddp['step_s']):>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python bench/zero.py`: optimizer state and peak memory per rank, ZeRO against DDP."""
    p = argparse.ArgumentParser(prog="bench/zero.py", description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=positive(int), default=2)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    p.add_argument("--width", type=positive(int), default=1024, help="MLP width (default 1024)")
    p.add_argument("--layers", type=positive(int), default=8, help="hidden layers (default 8)")
    p.add_argument("--batch-size", type=positive(int), default=32, help="per rank (default 32)")
    p.add_argument("--steps", type=positive(int), default=4)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--txt", metavar="PATH", help="also write the table as text")
    args = p.parse_args(argv)
    check_output_paths(p, args)
    result = run(args.world_size, args.optimizer, args.width, args.layers, args.batch_size, args.steps)
    table = format_table(result)
    print(table)
    if args.txt:
        from manualdp.support.files import atomic_write
        with atomic_write(args.txt, "w") as f:
            f.write(table + "\n")
    save_outputs(result, args.json, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
