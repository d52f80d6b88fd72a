"""`manualdp explain zero3`: the collectives of one ZeRO-3 step, with their bytes, and a picture of it.

    manualdp explain zero3 --devices 4 [--plot zero3.png]

It runs one real step of `manualdp.zero3.Zero3` on a small MLP over simulated devices and
prints what that step ran: each unit all-gathered for its forward, again for its backward
(where backward reads its weights), and its gradients reduce-scattered; for each, the bytes
every device sends and receives (from the schedules, `manualdp.cost.traffic`) and the
parameter bytes every device holds right after it. The picture draws the same two things.
"""
from __future__ import annotations

import torch
from matplotlib.patches import Patch
from torch import nn

from ..cost import traffic
from ..devices import cpu_devices
from ..replicate import replicate
from ..schedule import get_collective, get_schedule
from ..support.plot import new_figure, save_figure
from ..validate import int_between
from ..zero3 import Zero3, traffic_of

__all__ = ["MAX_DEVICES", "demo_step", "explain_zero3", "plot_zero3"]

MAX_DEVICES = 32  # one thread per device runs a real step
COLOURS = {("all_gather", "forward"): "#2c6fbb", ("all_gather", "backward"): "#e08a1e",
           ("reduce_scatter", "step"): "#c0392b"}


def demo_step(num_devices: int) -> Zero3:
    """One ZeRO-3 step of a three-unit MLP (float32) on `num_devices` simulated devices;
    its `collectives` are the step's."""
    int_between("num_devices", num_devices, 1, MAX_DEVICES)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    zero = Zero3(replicate(net, cpu_devices(num_devices)), torch.optim.SGD, lr=0.1)
    zero.train_batch(torch.randn(4 * num_devices, 64), torch.randint(0, 10, (4 * num_devices,)))
    return zero


def _span(values) -> str:
    return str(min(values)) if min(values) == max(values) else f"{min(values)}-{max(values)}"


def _unit(name: str) -> str:
    return name or "(root)"


def explain_zero3(num_devices: int) -> str:
    """What one ZeRO-3 step on `num_devices` ran, collective by collective, and its bytes against the formulas."""
    zero = demo_step(num_devices)
    n, steps = num_devices, zero.collectives
    model = sum(c.numel * c.element_size for c in zero.planned() if c.phase == "forward")
    between = zero.param_bytes()
    out = [f"ZeRO-3 on {n} device{'s' * (n != 1)}: one step of an MLP (Linear 64-128, ReLU, Linear 128-128, ReLU, "
           f"Linear 128-10; float32), {model} bytes of parameters in {len(zero.plans)} units",
           "each device keeps its chunk of every unit; a unit is all-gathered for its forward and freed after, "
           "all-gathered again when backward reads its weights, and its gradients are reduce-scattered",
           "", "  {:<4}{:<16}{:<10}{:<7}{:>10}{:>16}{:>16}  {}".format(
               "#", "collective", "phase", "unit", "bytes", "sent/device", "received", "parameter bytes held after")]
    for k, c in enumerate(steps, start=1):
        t = traffic(get_collective(c.kind, zero.algorithm, n), c.numel * c.element_size, c.element_size)
        held = " ".join(map(str, c.held)) if n <= 8 else f"{_span(c.held)} (dev0..dev{n - 1})"
        out.append("  {:<4}{:<16}{:<10}{:<7}{:>10}{:>16}{:>16}  {}".format(
            k, c.kind.replace("_", "-"), c.phase, _unit(c.unit), c.numel * c.element_size, _span(t["sent"]),
            _span(t["received"]), held))
    ran, planned = traffic_of(steps, n, zero.algorithm), traffic_of(zero.planned(), n, zero.algorithm)
    skipped = [c for c in zero.planned() if c[:3] not in {s[:3] for s in steps}]
    ddp = traffic(get_schedule("ring", n), model, 4)
    out += ["", "bytes each device sent in the step: " + _span(ran["sent"]) + ", received: " + _span(ran["received"]),
            f"  two all-gathers and one reduce-scatter of every unit would send {_span(planned['sent'])}: "
            f"3(n-1)/n * {model} = {3 * (n - 1) * model / n:.0f} when n divides every unit"]
    if skipped:
        out.append("  this step ran fewer: " + ", ".join(f"unit {_unit(c.unit)}'s {c.phase} {c.kind.replace('_', '-')}"
                                                        for c in skipped) + " (backward reads none of its weights: "
                   "its input needs no gradient)")
    out += [f"  plain data parallelism's ring allreduce sends {_span(ddp['sent'])}: 2(n-1)/n * {model} = "
            f"{2 * (n - 1) * model / n:.0f}",
            "", f"parameter bytes each device holds between steps: {_span(between)} (its shards, and a one-element "
            f"placeholder), at most {max(max(c.held) for c in steps) if steps else max(between)} during the step; "
            f"plain data parallelism: {model} on every device, always",
            f"each all-gather and reduce-scatter is a ring: 'manualdp explain all_gather --devices {n}' prints one "
            "round by round"]
    return "\n".join(out)


def plot_zero3(num_devices: int, path: str):
    """Draw one ZeRO-3 step as a PNG at `path`: the collectives in order, and the parameter bytes each device holds."""
    zero = demo_step(num_devices)
    steps, n = zero.collectives, num_devices
    model = sum(c.numel * c.element_size for c in zero.planned() if c.phase == "forward")
    fig, (wire, memory) = new_figure(2, 1, width=max(6.4, 0.7 * len(steps) + 2), height=6.0)
    for k, c in enumerate(steps, start=1):
        sent = max(traffic(get_collective(c.kind, zero.algorithm, n), c.numel * c.element_size, c.element_size)["sent"])
        wire.bar(k, sent, color=COLOURS[c.kind, c.phase])
        wire.annotate(f"unit {_unit(c.unit)}", (k, sent), ha="center", va="bottom", fontsize=7)
    wire.legend([Patch(color=colour) for colour in COLOURS.values()],
                [f"{kind.replace('_', '-')} ({phase})" for kind, phase in COLOURS], fontsize=8)
    wire.set(ylabel="bytes sent per device", title=f"one ZeRO-3 step on {n} devices: the collectives, in order")
    for i in range(n):
        memory.step(range(1, len(steps) + 1), [c.held[i] for c in steps], where="mid",
                    label=f"dev{i}" if n <= 8 else None)
    memory.axhline(model, color="grey", linestyle="--", label="plain data parallelism: the whole model")
    memory.axhline(model / n, color="grey", linestyle=":", label="1/n of the model")
    memory.set(ylabel="parameter bytes held after it", xlabel="collective", ylim=(0, model * 1.1))
    for ax in (wire, memory):
        ax.set_xticks(range(1, len(steps) + 1))
    memory.legend(fontsize=7)
    save_figure(fig, path)
    return fig
