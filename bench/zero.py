"""Data parallelism and the three ZeRO stages, ours and torch's: memory, bytes sent and step time, per rank.

    python bench/zero.py --world-size 2 --json bench/results/zero_2.json --txt bench/results/zero_2.txt \
        --plot bench/results/zero_2.png
    python bench/zero.py --world-size 4 --steps 2 --repeats 1     # a quick look: one run, two timed steps
    python bench/zero.py --world-size 2 --backend nccl            # on GPUs, one per rank

Every rank builds the same MLP (`--layers` Linear layers of `--width`, then a head; fp32), trains
it with Adam on its own batch, gloo on 127.0.0.1. Rows:
- `manualdp DDP`: `manualdp.spmd.DistributedDataParallel` (ring allreduce);
- `manualdp ZeRO-1`: that DDP and `manualdp.spmd.sharding.zero.ZeroRedundancyOptimizer(stage=1)`;
- `manualdp ZeRO-2`: `ZeroRedundancyOptimizer(stage=2)` on the bare module (it reduce-scatters the
  gradients itself, bucket by bucket during backward: no DDP buckets);
- `manualdp ZeRO-3`: `manualdp.spmd.fully_shard` on each Linear, then on the root (which is left
  with no parameter of its own), and Adam on `module.parameters()`;
- `torch ZeRO-1`: torch's DDP and `torch.distributed.optim.ZeroRedundancyOptimizer`;
- `torch FSDP2`: `torch.distributed.fsdp.fully_shard`, the same units.

Each row runs in its own fresh processes, so that the process's peak memory is the row's; the
rows take turns (`--repeats` rounds, each in another order) and the table gives, per rank, the
median over the rounds. Per rank and row: `--warmup` steps, `--steps` timed steps, then one
more step in which memory is measured. Columns:
- params: after backward of that step, the bytes of the storages (each counted once) behind the
  parameters this rank holds: `module.parameters()` (a DTensor's local shard), plus ZeRO-3's
  gathered full parameters if any are still allocated;
- grads: at the same moment, the storages behind those parameters' `.grad`, plus ZeRO-3's full
  gradients not yet reduce-scattered, or ZeRO-2's own count (`gradient_bytes()`: its shard and
  any bucket buffer it holds). DDP's bucket buffers (another copy of the gradient, in ours and
  in torch's) are not in it; they are in the process peak;
- state: after the step, the tensors in the optimizer's state (this rank's, for ZeRO);
- in-step (ours only): the most params + grads held at any of the step's sampling points (before
  each Linear's forward, after its prefetch; when backward reaches each Linear's output, after
  its gathers), plus state: what ZeRO-3's gathered units and unreduced gradients add at their
  peak. A lower bound: what a unit hands its worker thread (its concatenated gradient while it
  is reduce-scattered, the sums waiting to become the shards' `.grad`) is out of sight, as are
  torch's FSDP2's gathered buffers (its rows have none); the process peak bounds it from above;
- peak: the process's peak resident memory (`VmHWM`, reset by /proc/self/clear_refs where the
  kernel allows) minus its resident memory before the model was built;
- sent: the floating-point bytes this rank's executor sent per timed step
  (`manualdp.spmd.transport.p2p.traffic`), against the formula: a ring allreduce sends 2(n-1)/n of its
  buffer, a reduce-scatter or an all-gather (n-1)/n. DDP's buckets carry two flags per parameter
  with the gradients, so its buffer is the model plus 8 bytes per parameter tensor. Uneven
  chunks make ranks differ by a few bytes; summed over the ranks the count equals the formula
  exactly (the target). `other`: what else it sent (ZeRO-2's int32 flags of used parameters);
- wire: the bytes this process's TCP sockets sent per timed step (`ss -ti`: tcp_info's
  bytes_sent; gloo's headers and every collective, torch's too). None without `ss`;
- step: the median of the timed steps, and its ratio to torch FSDP2's at the same rank.

With `--backend nccl` every rank trains on its own GPU: peak is then the GPU's peak allocated
memory (`torch.cuda.max_memory_allocated`, reset before the model is built) less what was
allocated before, wire is not measured, and steps are timed by CUDA events
(`bench.common.Stopwatch`).
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import BACKENDS, Stopwatch, check_backend, check_output_paths, save_outputs
from manualdp.runners.cli import positive

__all__ = ["main", "run", "measure", "summarize", "formula", "format_table", "plot", "ROWS"]

ROWS = ("manualdp DDP", "manualdp ZeRO-1", "manualdp ZeRO-2", "manualdp ZeRO-3", "torch ZeRO-1", "torch FSDP2")
LR = 1e-3
MIB = 2 ** 20


# ---------------------------------------------------------------- the model and its sizes

def _mlp(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    body = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*body, nn.Linear(width, 10))


def model_sizes(width: int, layers: int) -> dict:
    """The MLP's parameter bytes, its number of parameter tensors and its largest unit (a Linear), in full."""
    net = _mlp(width, layers)
    nbytes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in net if isinstance(m, nn.Linear)]
    return {"bytes": sum(nbytes), "numel": sum(p.numel() for p in net.parameters()),
            "tensors": len(list(net.parameters())), "largest_unit": max(nbytes)}


def formula(row: str, n: int, model_bytes: int, tensors: int, mp_policy: str = "none") -> int:
    """Floating-point bytes all ranks together send per step, by the textbook (ring: (n-1)/n of a buffer per pass)."""
    ddp = 2 * (n - 1) * (model_bytes + 2 * 4 * tensors)  # DDP's buckets: the gradients and two fp32 flags each
    passes = {"manualdp ZeRO-2": 2,   # reduce-scatter the gradients, all-gather the stepped shards
              "manualdp ZeRO-3": 3,   # all-gather for forward, again for backward, reduce-scatter the gradients
              "torch ZeRO-1": 3,      # allreduce the gradients (2), send the stepped shards (1)
              "torch FSDP2": 3}
    if row == "manualdp DDP":
        return ddp
    if row == "manualdp ZeRO-1":
        return ddp + (n - 1) * model_bytes  # DDP's allreduce, then all-gather the stepped shards
    if row == "manualdp ZeRO-3":  # each segment's tail: (unit, count, trainable, extension code) per all-gather;
        units = tensors // 2      # (unit, count, divide factor) per rank and a flag per tensor per reduce-scatter
        # (fsdp_collectives.py); a Linear (2 tensors) is a unit
        gathered = 2 if mp_policy == "bf16" else 4  # bytes per element of the all-gathers (the reductions: fp32)
        return ((2 * gathered // 4 + 1) * (n - 1) * model_bytes
                + (n - 1) * n * (units * 2 * 4 * gathered + 4 * (units * 3 * n + tensors)))
    return passes[row] * (n - 1) * model_bytes


# ---------------------------------------------------------------- one rank of one row

def _storage_bytes(tensors) -> int:
    """Bytes of the storages behind `tensors` (a DTensor's local one), each counted once."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        try:
            s = t.untyped_storage()
            seen[s.data_ptr(), s.nbytes()] = s.nbytes()
        except RuntimeError:  # no storage: ZeRO-2's stand-in .grad after backward (the gradient is sharded away)
            continue
    return sum(seen.values())


def _state_bytes(opt) -> int:
    inner = getattr(opt, "optim", None) or getattr(opt, "optimizer", None) or opt  # torch's ZeRO: .optim
    return _storage_bytes(v for s in (inner.state.values() if inner is not None else ())
                          for v in s.values() if isinstance(v, torch.Tensor))


def _build(row: str, net: nn.Sequential, mp_policy: str = "none"):
    """The row's model and optimizer, and a function giving (param bytes, grad bytes) held right now."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from manualdp.spmd import DistributedDataParallel, fully_shard
    from manualdp.spmd.sharding.fsdp_unit import UNIT
    from manualdp.spmd.sharding.zero import ZeroRedundancyOptimizer

    def held() -> tuple[int, int]:
        params = list(net.parameters())
        return _storage_bytes(params), _storage_bytes(p.grad for p in params)

    if row in ("manualdp DDP", "manualdp ZeRO-1"):
        model = DistributedDataParallel(net, algorithm="ring")
        opt = (ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=1, lr=LR) if "ZeRO" in row
               else torch.optim.Adam(model.parameters(), lr=LR))
        return model, opt, held
    if row == "manualdp ZeRO-2":
        opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, stage=2, lr=LR)
        return net, opt, lambda: (held()[0], opt.gradient_bytes())
    if row == "torch ZeRO-1":
        model = TorchDDP(net)
        return model, TorchZero(model.parameters(), torch.optim.Adam, lr=LR), held
    shard_fn = fully_shard if row == "manualdp ZeRO-3" else torch_fully_shard
    from torch.distributed.fsdp import MixedPrecisionPolicy
    mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          } if mp_policy == "bf16" else {}
    for m in net:
        if any(True for _ in m.parameters()):
            shard_fn(m, **mp)
    shard_fn(net, **mp)
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    if row == "torch FSDP2":
        return net, opt, held
    units = [m.__dict__[UNIT] for m in net.modules() if UNIT in m.__dict__]

    def held_zero3() -> tuple[int, int]:
        params = list(net.parameters())
        fulls = [p.full for u in units for p in u.params if p.full is not None]
        leaf_grads = [f.grad for f in fulls]
        return _storage_bytes(params + fulls), _storage_bytes([p.grad for p in params] + leaf_grads)
    return net, opt, held_zero3


def _sample_during_step(net: nn.Sequential, held, samples: list) -> list:
    """Hooks that append `held()` before each Linear's forward and when backward reaches its output."""
    def on_grad(grad):
        samples.append(held())

    def before(module, args):
        samples.append(held())

    def after(module, args, output):
        if output.requires_grad:
            output.register_hook(on_grad)  # after fully_shard's own hook: the unit is gathered for backward
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    return [h for m in linears for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size
    except OSError:
        pass  # not allowed here: the peak then counts from the process's start


def _tcp_bytes_sent() -> int | None:
    """Bytes sent so far by this process's open TCP sockets (tcp_info's bytes_sent, from `ss`); None without ss."""
    if shutil.which("ss") is None:
        return None
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=60).stdout
    mine, total = f"pid={os.getpid()},", 0
    lines = out.splitlines()
    for line, info in zip(lines, lines[1:]):
        if mine in line:
            found = re.search(r"\bbytes_sent:(\d+)", info)
            total += int(found.group(1)) if found else 0
    return total


def measure(config: dict) -> dict:
    """One rank of one row: build, warm up, time, then measure one step's memory."""
    from manualdp.spmd import rank_device
    from manualdp.spmd.transport.p2p import traffic

    for name in ("torch.distributed.fsdp", "torch.distributed.optim", "manualdp.spmd.sharding.zero"):
        importlib.import_module(name)  # before the baseline: what an import takes is not the row's memory

    rank, device = dist.get_rank(), rank_device()
    gpu = device.type == "cuda"
    torch.manual_seed(100 + rank)
    X, y = torch.randn(config["batch_size"], config["width"]), torch.randint(0, 10, (config["batch_size"],))
    X, y = X.to(device), y.to(device)
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    _reset_peak()
    before = torch.cuda.memory_allocated(device) if gpu else _status("VmRSS")
    net = _mlp(config["width"], config["layers"]).to(device)
    model, opt, held = _build(config["row"], net, config.get("mp_policy", "none"))

    def step(after_backward=None) -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(X), y).backward()
        if after_backward is not None:
            after_backward()
        opt.step()

    for _ in range(config["warmup"]):
        step()
    counter, times, sent, clock = traffic(), [], [], Stopwatch(device)
    wire = None if gpu else _tcp_bytes_sent()  # NCCL's bytes do not go through this process's sockets
    for _ in range(config["steps"]):
        was = counter.sent()
        clock.start()
        step()
        times.append(clock.stop())
        now = counter.sent()
        sent.append({k: v - was.get(k, 0) for k, v in now.items() if v != was.get(k, 0)})
    wire = None if wire is None else (_tcp_bytes_sent() - wire) / config["steps"]
    samples, snapshot = [], []
    hooks = _sample_during_step(net, held, samples) if config["row"].startswith("manualdp") else []
    step(lambda: snapshot.append(held()))
    for h in hooks:
        h.remove()
    out = {"rank": rank, "param_bytes": snapshot[0][0], "grad_bytes": snapshot[0][1], "state_bytes": _state_bytes(opt),
           "peak_bytes": max(0, (torch.cuda.max_memory_allocated(device) if gpu else _status("VmHWM")) - before),
           "sent": sent, "wire_bytes": wire, "step_s": times,
           "in_step_bytes": max(p + g for p, g in samples + snapshot) if samples else None}
    if config["row"] == "manualdp ZeRO-2":
        out["bucket_bytes"] = max((b.hi - b.lo) * 4 for b in opt.grad_shards.buckets)
    return out


# ---------------------------------------------------------------- the rows, their turns, the summary

def run(world_size: int, rows=ROWS, width: int = 1024, layers: int = 8, batch_size: int = 32, warmup: int = 1,
        steps: int = 3, repeats: int = 3, timeout: float = 900.0, progress=print, backend: str = "gloo",
        mp_policy: str = "none") -> dict:
    """Every row `repeats` times, each run in its own processes, the rows taking turns (each round in another order)."""
    from manualdp.spmd import launch

    config = {"world_size": world_size, "width": width, "layers": layers, "batch_size": batch_size,
              "warmup": warmup, "steps": steps, "repeats": repeats, "optimizer": "adam", "lr": LR, "backend": backend,
              "mp_policy": mp_policy}
    runs = []
    for repeat in range(repeats):
        order = list(rows[repeat % len(rows):]) + list(rows[:repeat % len(rows)])
        for row in order:
            start = time.perf_counter()
            ranks = launch(measure, world_size, ({**config, "row": row},), timeout=timeout, backend=backend)
            runs.append({"row": row, "repeat": repeat, "ranks": ranks})
            if progress is not None:
                progress(f"  round {repeat + 1}/{repeats}: {row} ({time.perf_counter() - start:.0f} s)")
    return summarize({"config": config, "model": model_sizes(width, layers), "runs": runs})


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(result: dict) -> dict:
    """Per row and rank, the medians over the runs; the formula; the targets. Returns `result` with them added."""
    n, model, mp = result["config"]["world_size"], result["model"], result["config"].get("mp_policy", "none")
    rows = []
    for row in dict.fromkeys(r["row"] for r in result["runs"]):
        runs = [r for r in result["runs"] if r["row"] == row]
        for rank in range(n):
            mine = [r["ranks"][rank] for r in runs]
            steps = [s for m in mine for s in m["sent"]]
            floats = [sum(v for k, v in s.items() if k.startswith(("float", "bfloat"))) for s in steps]
            entry = {"row": row, "rank": rank, "runs": len(mine)}
            for key in ("param_bytes", "grad_bytes", "state_bytes", "in_step_bytes", "peak_bytes", "wire_bytes",
                        "bucket_bytes"):
                entry[key] = _median([m.get(key) for m in mine])
            entry["held_bytes"] = entry["param_bytes"] + entry["grad_bytes"] + entry["state_bytes"]
            if entry["in_step_bytes"] is not None:
                entry["in_step_bytes"] += entry["state_bytes"]
            entry["sent_bytes"] = _median(floats) if row.startswith("manualdp") else None
            entry["sent_steady"] = len(set(floats)) <= 1  # every timed step sent the same
            entry["other_bytes"] = _median([sum(v for k, v in s.items() if not k.startswith(("float", "bfloat")))
                                            for s in steps]) if row.startswith("manualdp") else None
            entry["formula_bytes"] = formula(row, n, model["bytes"], model["tensors"], mp) / n
            entry["step_s"] = _median([statistics.median(m["step_s"]) for m in mine])
            rows.append(entry)
    for entry in rows:
        peer = next((r for r in rows if r["row"] == "torch FSDP2" and r["rank"] == entry["rank"]), None)
        entry["time_vs_fsdp2"] = entry["step_s"] / peer["step_s"] if peer else None
    result["rows"] = rows
    result["targets"] = _targets(result)
    return result


def _targets(result: dict) -> list[dict]:
    """The issue's targets, each with the measured value, the bound and whether it holds (None: not measured)."""
    n, model, rows = result["config"]["world_size"], result["model"], result["rows"]
    of = lambda row: [r for r in rows if r["row"] == row]  # noqa: E731
    out = []
    ddp, zero3, zero2 = of("manualdp DDP"), of("manualdp ZeRO-3"), of("manualdp ZeRO-2")
    if ddp and zero3:
        bound = ddp[0]["held_bytes"] / n + model["largest_unit"]
        for what, key in (("after backward / after step", "held_bytes"), ("in-step peak", "in_step_bytes")):
            worst = max(r[key] for r in zero3)
            out.append({"name": f"zero3 {key}",
                        "target": f"ZeRO-3 params+grads+state per rank ({what}) <= DDP's/N + largest unit",
                        "value": worst, "bound": bound, "holds": worst <= bound})
    if zero2:
        bound = math.ceil(model["numel"] / n) * 4 + max(r["bucket_bytes"] for r in zero2)
        worst = max(r["grad_bytes"] for r in zero2)
        out.append({"name": "zero2 grad_bytes",
                    "target": "ZeRO-2 gradient bytes after backward <= model/N + one bucket", "value": worst,
                    "bound": bound, "holds": worst <= bound})
    for row in ("manualdp DDP", "manualdp ZeRO-1", "manualdp ZeRO-2", "manualdp ZeRO-3"):
        if of(row):
            total = sum(r["sent_bytes"] for r in of(row))
            expected = formula(row, n, model["bytes"], model["tensors"], result["config"].get("mp_policy", "none"))
            out.append({"name": f"sent {row}", "target": f"{row}: bytes sent per step, summed over ranks, == formula",
                        "value": total,
                        "bound": expected, "holds": total == expected and all(r["sent_steady"] for r in of(row))})
    if zero3 and of("torch FSDP2"):
        ratio = _median([r["time_vs_fsdp2"] for r in zero3])
        out.append({"name": "zero3 time", "target": "ZeRO-3 step time <= torch FSDP2's (median over ranks)",
                    "value": ratio, "bound": 1.0,
                    "holds": ratio <= 1.0})
    return out


# ---------------------------------------------------------------- the table and the picture

def format_table(result: dict) -> str:
    """One line per row and rank, then the targets."""
    c, model, n = result["config"], result["model"], result["config"]["world_size"]
    mib = lambda v, w=8, d=2: f"{v / MIB:>{w}.{d}f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
    lines = [f"# Adam, MLP {c['layers']}x{c['width']} + head ({model['bytes'] / MIB:.2f} MiB of fp32 parameters, "
             f"largest unit {model['largest_unit'] / MIB:.2f} MiB), {n} ranks, batch {c['batch_size']} per rank; "
             f"{c['warmup']} warm-up + {c['steps']} timed steps, median of {c['repeats']} run(s)",
             "# MiB per rank; sent/wire: MiB per step; formula: the textbook's bytes for this row, per rank",
             f"{'row':<16}{'rank':>4}{'params':>8}{'grads':>8}{'state':>8}{'p+g+s':>8}{'in-step':>8}{'peak':>8}"
             f"{'sent':>9}{'formula':>9}{'sent/f':>8}{'other B':>8}{'wire':>9}{'step ms':>9}{'/FSDP2':>7}"]
    for r in result["rows"]:
        sent, formula_bytes = r["sent_bytes"], r["formula_bytes"]  # one rank sends nothing: no ratio
        ratio = f"{sent / formula_bytes:.4f}" if sent is not None and formula_bytes else "-"
        other = f"{r['other_bytes']:.0f}" if r["other_bytes"] is not None else "-"
        vs = f"{r['time_vs_fsdp2']:.2f}" if r["time_vs_fsdp2"] is not None else "-"
        lines.append(f"{r['row']:<16}{r['rank']:>4}{mib(r['param_bytes'])}{mib(r['grad_bytes'])}"
                     f"{mib(r['state_bytes'])}{mib(r['held_bytes'])}{mib(r['in_step_bytes'])}"
                     f"{mib(r['peak_bytes'], 8, 1)}{mib(r['sent_bytes'], 9, 3)}{mib(r['formula_bytes'], 9, 3)}"
                     f"{ratio:>8}{other:>8}{mib(r['wire_bytes'], 9, 3)}{r['step_s'] * 1e3:>9.1f}{vs:>7}")
    lines.append("# targets")
    for t in result["targets"]:
        verdict = {True: "holds", False: "MISSED", None: "-"}[t["holds"]]
        if t["name"] == "zero3 time":
            value = f"{t['value']:.3f} vs {t['bound']:.3f}"
        elif t["name"].startswith("sent"):
            value = f"{t['value']:.0f} B vs {t['bound']:.0f} B"
        else:
            value = f"{t['value'] / MIB:.3f} MiB vs {t['bound'] / MIB:.3f} MiB"
        lines.append(f"{verdict:<7}{t['target']}: {value}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Stacked bars per row and rank: params, grads, state (MiB); dots: process peak; lines: DDP/N + unit and DDP."""
    from manualdp.support.plot import new_figure, save_figure

    rows, n = result["rows"], result["config"]["world_size"]
    fig, (ax,) = new_figure(1, 1, width=max(6.4, 0.42 * len(rows) + 2), height=4.6)
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for key, label in (("param_bytes", "params"), ("grad_bytes", "grads"), ("state_bytes", "optimizer state")):
        heights = [r[key] / MIB for r in rows]
        ax.bar(x, heights, bottom=bottom, label=label, width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.plot(x, [r["peak_bytes"] / MIB for r in rows], "k.", label="process peak (RSS)")
    ddp = [r for r in rows if r["row"] == "manualdp DDP"]
    if ddp:
        replica = ddp[0]["held_bytes"]
        ax.axhline(replica / MIB, color="gray", ls=":", lw=1, label="DDP: one replica")
        ax.axhline((replica / n + result["model"]["largest_unit"]) / MIB, color="red", ls="--", lw=1,
                   label="ZeRO-3 target: DDP/N + largest unit")
    labels = [(r["row"].replace(" ", "\n", 1) + "\n" if r["rank"] == 0 else "") + f"rank {r['rank']}" for r in rows]
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylim(0, 1.3 * max(max(r["peak_bytes"], r["held_bytes"]) for r in rows) / MIB)
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"Memory per rank, {n} ranks (params and grads after backward, state after step)", fontsize=10)
    ax.legend(fontsize=7, ncol=3, loc="upper center")
    ax.grid(True, axis="y", alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    """`python bench/zero.py`: the table, and optionally JSON, text and a PNG."""
    p = argparse.ArgumentParser(prog="bench/zero.py", description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=positive(int), default=2)
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), metavar="ROW",
                   help=f"which rows, in this order (default all: {', '.join(ROWS)})")
    p.add_argument("--width", type=positive(int), default=1024, help="MLP width (default 1024)")
    p.add_argument("--layers", type=positive(int), default=8, help="hidden Linear layers (default 8: 32.1 MiB)")
    p.add_argument("--batch-size", type=positive(int), default=32, help="per rank (default 32)")
    p.add_argument("--warmup", type=positive(int), default=1, help="untimed steps first (default 1)")
    p.add_argument("--steps", type=positive(int), default=3, help="timed steps per run (default 3)")
    p.add_argument("--repeats", type=positive(int), default=3, help="runs of every row, taking turns (default 3)")
    p.add_argument("--timeout", type=positive(float), default=900.0, help="give up on one run after this many s")
    p.add_argument("--backend", choices=BACKENDS, default="gloo", help="gloo (CPUs, default) or nccl (a GPU per rank)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--txt", metavar="PATH", help="also write the table as text")
    p.add_argument("--plot", metavar="PATH", help="draw the memory per rank to a PNG")
    p.add_argument("--mp-policy", choices=("none", "bf16"), default="none",
                   help="ZeRO-3 and FSDP2 rows: bf16 = MixedPrecisionPolicy(param_dtype=bfloat16, "
                   "reduce_dtype=float32)")
    args = p.parse_args(argv)
    check_output_paths(p, args)
    check_backend(p, args.backend, args.world_size)
    result = run(args.world_size, tuple(args.rows), args.width, args.layers, args.batch_size, args.warmup,
                 args.steps, args.repeats, args.timeout, backend=args.backend, mp_policy=args.mp_policy)
    table = format_table(result)
    print(table)
    if args.txt:
        from manualdp.support.files import atomic_write
        with atomic_write(args.txt, "w") as f:
            f.write(table + "\n")
    save_outputs(result, args.json, args.plot, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
