"""Time per training step: a plain PyTorch loop against manualdp on 1, 2 and 4 simulated devices.

    python bench/overhead.py --model lenet --batch-size 256
    python bench/overhead.py --json overhead.json

Same model, same global batch, same initial parameters. Every configuration is warmed up, then
the configurations are timed in turns (a, b, c, a, b, c, ...) so that machine noise hits all of
them alike; each reported time is the median over rounds of the mean step time in a round.
Peak memory is measured in a fresh child process per configuration (resident set size growth
from just before building the model to the end of the steps).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import check_output_paths
from manualdp.schedule import ALGORITHMS

__all__ = ["main"]


def _batch(batch_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, 1, 28, 28, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def _make_plain(model: str, lr: float):
    from manualdp.support.models import get_model
    torch.manual_seed(0)
    net = get_model(model)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()

    def step(X, y):
        opt.zero_grad(set_to_none=True)
        loss_fn(net(X), y).backward()
        opt.step()
    return step


def _make_manualdp(model: str, lr: float, n: int, algorithm: str):
    from manualdp import cpu_devices, replicate, train_batch
    from manualdp.support.models import get_model
    torch.manual_seed(0)
    devices = cpu_devices(n)
    replicas = replicate(get_model(model), devices)
    opts = [torch.optim.SGD(r.parameters(), lr=lr) for r in replicas]

    def step(X, y):
        train_batch(X, y, replicas, opts, devices, algorithm=algorithm)
    return step


def _configs(args):
    configs = {"(a) plain PyTorch, 1 device": lambda: _make_plain(args.model, args.lr)}
    for n in args.devices:
        configs[f"({'b' if n == 1 else 'c'}) manualdp, {n} device{'s' if n > 1 else ''}"] = (
            lambda n=n: _make_manualdp(args.model, args.lr, n, args.algorithm))
    return configs


def _rss_child(args, name: str) -> float:
    """Peak RSS growth (MiB) of one configuration, measured in a fresh process."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        "import sys; sys.path.insert(0, %r); import torch; torch.set_num_threads(%d);"
        "from bench.overhead import _memory_run; _memory_run(%r, %r, %r, %d, %d, %r)"
        % (root, torch.get_num_threads(), name, args.model, args.lr, args.batch_size, args.steps, args.algorithm)
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"memory child for {name!r} failed:\n{out.stderr}")
    return float(out.stdout.strip().splitlines()[-1])


def _vm(field: str) -> float:
    """A /proc/self/status memory field, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory_run(name, model, lr, batch_size, steps, algorithm):
    X, y = _batch(batch_size)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark, so import-time peaks do not count
    before = _vm("VmRSS")
    if name == "plain":
        step = _make_plain(model, lr)
    else:
        step = _make_manualdp(model, lr, int(name), algorithm)
    for _ in range(steps):
        step(X, y)
    print(_vm("VmHWM") - before)


def _parser():
    p = argparse.ArgumentParser(prog="bench/overhead.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="lenet", choices=["lenet", "mlp", "resnet18"])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4], help="manualdp device counts (default: 1 2 4)")
    p.add_argument("--algorithm", default="naive", choices=list(ALGORITHMS))
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration")
    p.add_argument("--steps", type=int, default=5, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (the median is reported)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: steadier timings on a shared machine; 0 keeps torch's default)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    p.add_argument("--json", metavar="PATH", help="write the table as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    check_output_paths(_parser(), args)
    for name in ("batch_size", "warmup", "steps", "rounds"):
        if getattr(args, name) < 1:
            _parser().error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(n < 1 or n > args.batch_size for n in args.devices):
        _parser().error(f"--devices must be between 1 and --batch-size, got {args.devices}")
    if args.threads < 0:
        _parser().error(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from tqdm.auto import tqdm

    X, y = _batch(args.batch_size)
    configs = _configs(args)
    steps = {name: make() for name, make in configs.items()}
    for step in steps.values():
        for _ in range(args.warmup):
            step(X, y)
    times = {name: [] for name in steps}
    for _ in tqdm(range(args.rounds), desc="rounds", leave=False):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step(X, y)
            times[name].append((time.perf_counter() - start) / args.steps)

    base = statistics.median(times["(a) plain PyTorch, 1 device"])
    memory = {}
    if not args.no_memory:
        for name, child in zip(configs, ["plain"] + [str(n) for n in args.devices]):
            memory[name] = _rss_child(args, child)
    print(f"model {args.model}, global batch {args.batch_size}, {torch.get_num_threads()} threads, "
          f"allreduce {args.algorithm}, median of {args.rounds} rounds x {args.steps} steps")
    print(f"{'configuration':32} {'ms/step':>9} {'p90 ms':>8} {'samples/s':>10} {'ratio':>7} {'peak MiB':>9}")
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        p90 = sorted(ts)[min(len(ts) - 1, int(0.9 * len(ts)))]
        row = {"configuration": name, "ms_per_step": med * 1e3, "p90_ms": p90 * 1e3,
               "samples_per_s": args.batch_size / med, "ratio_vs_plain": med / base,
               "peak_rss_mib": memory.get(name)}
        rows.append(row)
        mem = f"{row['peak_rss_mib']:9.1f}" if row["peak_rss_mib"] is not None else f"{'-':>9}"
        print(f"{name:32} {row['ms_per_step']:9.2f} {row['p90_ms']:8.2f} {row['samples_per_s']:10.0f} "
              f"{row['ratio_vs_plain']:7.3f} {mem}")
    if args.json:
        from manualdp.support.files import write_json_atomic
        write_json_atomic(args.json, {"args": vars(args), "rows": rows})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
