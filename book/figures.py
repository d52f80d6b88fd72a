"""Every figure of the book, made from manualdp's own code.

    python book/figures.py                  # into book/figures/
    python book/figures.py --out /tmp/figs --fast

The chapters show them from book/figures/. tests/test_book.py builds them all (`--fast`: fewer
steps and sizes, the same pictures) and checks that every figure a chapter shows is made here.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from matplotlib.animation import FuncAnimation, PillowWriter
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import nn

import manualdp
from manualdp.cost import traffic
from manualdp.runners.explain import DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_GAMMA, pictures, plot
from manualdp.runners.explain_zero3 import COLOURS, demo_step, plot_zero3
from manualdp.schedule import ALGORITHMS, get_schedule
from manualdp.spmd.auto.tune import Link, predict
from manualdp.support.files import output_problem
from manualdp.support.plot import save_figure
from manualdp.support.plot_rounds import draw_panel

HERE = os.path.dirname(os.path.abspath(__file__))
# chapter 2, 4 devices
COLLECTIVES = ["naive", "ring", "tree", "halving_doubling", "recursive_doubling", "reduce_scatter", "all_gather"]


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


# ---------------------------------------------------------------- chapter 1: N devices equal one

def same_as_one_device(path: str, fast: bool) -> None:
    """Train one MLP on 1 device and on 4 simulated devices, on the same global batches: the same losses."""
    steps, devices = (6 if fast else 30), manualdp.cpu_devices(4)
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(steps, 64, 20, generator=g, dtype=torch.float64), torch.randint(0, 5, (steps, 64), generator=g)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5)).double()
    runs = {}
    for k in (1, 4):
        replicas = manualdp.replicate(net, devices[:k])
        opts = [torch.optim.SGD(r.parameters(), lr=0.5) for r in replicas]
        losses = [manualdp.train_batch(X[s], y[s], replicas, opts, devices[:k]).loss / 64 for s in range(steps)]
        runs[k] = (losses, list(replicas[0].parameters()))
    diff = max((a - b).abs().max().item() for a, b in zip(runs[1][1], runs[4][1]))
    fig = _figure(6.5, 3.2)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(range(1, steps + 1), runs[1][0], "o-", label="1 device", lw=3, alpha=0.4)
    ax.plot(range(1, steps + 1), runs[4][0], "x--", label="4 simulated devices", color="black")
    ax.set_xlabel("step")
    ax.set_ylabel("mean loss of the global batch")
    ax.set_title(f"the same steps: largest parameter difference after {steps} steps {diff:.1e}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)  # atomically: a failed write leaves no half a PNG


# ---------------------------------------------------------------- chapter 2: collectives as schedules

def collective(name: str):
    def draw(path: str, fast: bool) -> None:
        plot(name, 4, path)
    return draw


def ring_gif(path: str, fast: bool) -> None:
    """The ring allreduce on 4 devices, one frame per round: which chunk goes where, and what each device holds."""
    schedule = get_schedule("ring", 4)
    cells, shares = pictures(schedule)
    fig = _figure(5.6, 3.4)
    ax = fig.add_subplot(1, 1, 1)

    def frame(r: int):
        ax.clear()
        title = "start: device d holds its own values" if r == 0 else f"round {r}: {schedule.phases[r - 1]}"
        draw_panel(ax, cells[r], shares[r], list(schedule.rounds[r - 1]) if r else [], title)
        fig.suptitle("ring allreduce (red: add, blue: overwrite)", fontsize=9)

    frames = list(range(len(schedule.rounds) + 1)) + [len(schedule.rounds)]  # hold the last frame
    FuncAnimation(fig, frame, frames=frames).save(path, writer=PillowWriter(fps=1), dpi=70 if fast else 100)


def bytes_per_device(path: str, fast: bool) -> None:
    """The busiest device's bytes sent, in units of the buffer S, against the textbook formulas."""
    S, ns = 840 * 64, list(range(2, 17))  # S divisible by every chunk count drawn: no rounding
    fig = _figure(6.5, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    for name in ALGORITHMS:
        sent = [max(traffic(get_schedule(name, n), S)["sent"]) / S for n in ns]
        ax.plot(ns, sent, "o", label=f"{name} (counted from its schedule)")
    ax.plot(ns, [n - 1 for n in ns], "-", color="gray", lw=0.8, label="(n-1): naive's device 0")
    ax.plot(ns, [2 * (n - 1) / n for n in ns], "--", color="black", lw=0.8, label="2(n-1)/n: the ring")
    ax.set_xlabel("devices n")
    ax.set_ylabel("bytes sent by the busiest device / S")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


# ---------------------------------------------------------------- chapter 3: the cost model

def predicted_time(path: str, fast: bool) -> None:
    """The alpha-beta-gamma model's time for each allreduce, against the buffer's size, at 8 devices."""
    link = Link(DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_GAMMA)
    sizes = [4 << (2 * i) for i in range(0, 13, 2 if fast else 1)]  # 4 B .. 64 MiB
    fig = _figure(6.5, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    for name in ALGORITHMS:
        ax.plot(sizes, [predict(name, 8, s, link, segment_bytes=None) * 1e6 for s in sizes], "o-", ms=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes per device (S)")
    ax.set_ylabel("predicted microseconds")
    ax.set_title("8 devices, alpha 5 us, 20 GB/s links: latency rules small buffers, bandwidth large ones", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


# ---------------------------------------------------------------- chapter 4: the DDP ladder

def ladder(path: str, fast: bool) -> None:
    """One step of every rung on 2 ranks (rank 0): compute above, communication below."""
    from manualdp.runners.ladder import RUNGS, record_ladder
    from manualdp.spmd import launch

    timelines = launch(record_ladder, 2, (1 if fast else 5,), timeout=300)[0]
    colours = {"forward": "#4c9be8", "backward": "#e8884c", "step": "#59b36b", "wait": "#d04a4a",
               "allreduce": "#b04ad0"}
    fig = _figure(7.5, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    labels = []
    for i, rung in enumerate(RUNGS):
        for j, track in enumerate(("compute", "comm")):
            row = 2 * i + j
            labels.append(f"{rung}: {track}")
            for span in timelines[rung]["spans"]:
                if span["track"] == track:
                    ax.broken_barh([(span["start_ms"], span["end_ms"] - span["start_ms"])], (row - 0.4, 0.8),
                                   facecolors=colours[span["name"]], edgecolor="white", linewidth=0.5)
                    if "queued_ms" in span:
                        ax.plot(span["queued_ms"], row, "k|", ms=9)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlabel("ms from the start of the step, rank 0")
    ax.set_title("forward (blue), backward (orange), allreduce (purple), waiting for it (red), step (green);\n"
                 "| marks when backward handed an allreduce to the communication thread", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


# ---------------------------------------------------------------- chapter 6: sharding

def zero3_step(path: str, fast: bool) -> None:
    """One ZeRO-3 step on 4 simulated devices: its collectives, the parameter bytes held (`manualdp explain zero3`)."""
    plot_zero3(4, path)


def zero3_gif(path: str, fast: bool) -> None:
    """One ZeRO-3 step on 4 devices, one frame per collective: which unit moves, and what each device holds after."""
    zero = demo_step(4)
    steps, between = zero.collectives, zero.param_bytes()
    units = [(c.unit, c.numel * c.element_size) for c in zero.planned() if c.phase == "forward"]
    model = sum(size for _, size in units)
    fig = _figure(6.4, 4.4)
    top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)

    def frame(k: int):
        top.clear()
        bottom.clear()
        c = steps[k - 1] if k else None
        left = 0
        for name, size in units:  # the model, unit by unit; each device keeps one quarter of every unit
            moving = c is not None and c.unit == name
            top.barh(0, size, left=left, color=COLOURS[c.kind, c.phase] if moving else "#dddddd", edgecolor="black")
            for d in range(1, 4):
                top.plot([left + size * d / 4] * 2, [-0.4, 0.4], color="grey", lw=0.6)
            top.text(left + size / 2, 0, f"unit {name}", ha="center", va="center", fontsize=8)
            left += size
        top.set(xlim=(0, model), yticks=[], xlabel="the model's parameters, unit by unit (bytes)")
        what = "between steps: each device keeps its quarter of every unit" if c is None else (
            f"{k}/{len(steps)}: {c.kind.replace('_', '-')} unit {c.unit} ({c.phase})")
        top.set_title(what, fontsize=9)
        held = between if c is None else c.held
        bottom.bar([f"dev{i}" for i in range(4)], held, color="#2c6fbb" if c is None else COLOURS[c.kind, c.phase])
        bottom.axhline(model, color="grey", ls="--", lw=0.8, label="the whole model (plain data parallelism)")
        bottom.axhline(model / 4, color="grey", ls=":", lw=0.8, label="a quarter of it")
        bottom.set(ylim=(0, model * 1.4), ylabel="parameter bytes held")
        bottom.legend(fontsize=7, loc="upper center", ncol=2)
        fig.tight_layout()

    frames = list(range(len(steps) + 1)) + [len(steps)]  # hold the last frame
    FuncAnimation(fig, frame, frames=frames).save(path, writer=PillowWriter(fps=1), dpi=70 if fast else 100)


# ---------------------------------------------------------------- chapter 8: training through failures

def ft_quorum(path: str, fast: bool) -> None:
    """A run of 3 replicas where c is out from step 3 to 5: the quorum per step, and the loss of three runs.

    The losses are `reference_run`'s, the one-process run that the replicas equal (chapter 8 checks it on
    a real run, tests/spmd/ft/test_ft_cli_rejoin.py on longer ones): uninterrupted, the batch split among the members,
    and each replica keeping its own shard."""
    from manualdp.runners.ft_reference import reference_run
    from manualdp.support import data, models

    steps = 8 if fast else 24
    out = range(3, 6) if fast else range(6, 14)
    members = [["a", "b"] if s in out else ["a", "b", "c"] for s in range(steps)]

    def run(membership, shards):
        torch.manual_seed(0)
        train_iter, _ = data.load_data("synthetic", 32, seed=0, num_train=32 * steps, num_test=32)
        return reference_run(models.get_model("mlp"), list(train_iter), membership, lr=0.1, shards=shards,
                             replicas=["a", "b", "c"])

    curves = {"uninterrupted": run([["a", "b", "c"]] * steps, "split"),
              "c out, batch split among the members": run(members, "split"),
              "c out, each replica its own shard": run(members, "fixed")}
    fig = _figure(7.0, 4.4)
    top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
    for row, rid in enumerate("abc"):
        inside = [s for s in range(steps) if rid in members[s]]
        top.scatter(inside, [row] * len(inside), marker="s", s=60, color=f"C{row}")
    top.set(yticks=[0, 1, 2], yticklabels=["a", "b", "c"], xlim=(-0.5, steps - 0.5), ylim=(-0.6, 2.6),
            title="the quorum of each step (c killed, then started again and given the state)")
    for (label, losses), style in zip(curves.items(), ["o-", "x--", "s:"]):
        bottom.plot(range(steps), losses, style, label=label, lw=1.5, ms=4)
    bottom.axvspan(min(out) - 0.5, max(out) + 0.5, color="grey", alpha=0.15)
    bottom.set(xlabel="step", ylabel="loss of the step's batch", xlim=(-0.5, steps - 0.5))
    bottom.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


FIGURES = {
    "same-as-one-device.png": same_as_one_device,
    **{f"{name}.png": collective(name) for name in COLLECTIVES},
    "ring.gif": ring_gif,
    "bytes.png": bytes_per_device,
    "predicted.png": predicted_time,
    "ladder.png": ladder,
    "zero3.png": zero3_step,
    "zero3.gif": zero3_gif,
    "ft-quorum.png": ft_quorum,
}


def build(out: str, fast: bool = False, names=None) -> list[str]:
    """Make the figures `names` (default: all) into the folder `out`; returns their paths."""
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    paths = []
    for name in names or FIGURES:
        path = os.path.join(out, name)
        FIGURES[name](path, fast)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python book/figures.py", description="Make every figure of the book.")
    parser.add_argument("--out", default=os.path.join(HERE, "figures"), help="folder (default: book/figures)")
    parser.add_argument("--fast", action="store_true", help="fewer steps and sizes: for the tests")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"only these figures, of: {', '.join(FIGURES)}")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in FIGURES]
    if unknown:
        parser.error(f"no figure named {', '.join(unknown)}; the figures: {', '.join(FIGURES)}")
    problem = output_problem(args.out, 16 << 20, folder=True)  # before any work, as `manualdp train` checks its outputs
    if problem is None and os.path.islink(args.out) and not os.path.exists(args.out):
        problem = "it is a symlink to nothing (a folder cannot be made there)"
    taken = [n for n in args.names or FIGURES if os.path.isdir(os.path.join(args.out, n))]
    if problem is None and taken:
        problem = f"{taken[0]} in it is a folder, where the figure of that name would go"
    if problem:
        parser.error(f"--out {args.out!r}: {problem}")
    for path in build(args.out, args.fast, args.names):
        print(f"wrote {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
