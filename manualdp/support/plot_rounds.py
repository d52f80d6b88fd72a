"""A collective drawn round by round: devices as rows, chunks as coloured cells, an arrow per transfer.

It takes plain data (no schedule objects), so that it stays a leaf module:
`rounds[r]` is a list of `(src, dst, chunk, reduce)`, `cells[r][device][chunk]` is the
text of a cell after round r (`cells[0]` is the start) and `shares[r][device][chunk]`
the fraction of the devices whose values it holds (its colour).
"""
from __future__ import annotations

import math

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .files import atomic_write

__all__ = ["plot_rounds", "draw_panel"]

ADD, COPY = "#c0392b", "#2c6fbb"  # arrow colours: the receiver adds / overwrites


def plot_rounds(path: str, title: str, rounds: list, phases: list[str], cells: list, shares: list,
                columns: int = 4) -> Figure:
    """Draw the start and every round as one panel each, and write a PNG to `path` atomically; returns the figure."""
    if not str(path).lower().endswith(".png"):
        raise ValueError(f"path must end in .png, got {path!r}")
    n, k = len(cells[0]), len(cells[0][0])
    panels = len(rounds) + 1
    columns = min(columns, panels)
    rows = math.ceil(panels / columns)
    width, height = 0.9 * k + 1.0, 0.5 * n + 0.8
    fig = Figure(figsize=(columns * width, rows * height + 0.6), dpi=110)
    FigureCanvasAgg(fig)
    for p in range(panels):
        ax = fig.add_subplot(rows, columns, p + 1)
        draw_panel(ax, cells[p], shares[p], rounds[p - 1] if p else [],
                   "start" if p == 0 else f"round {p}: {phases[p - 1]}")
    legend = "(red: add into the receiver, blue: overwrite; darker: more devices summed)"
    # on a line of its own if narrow
    fig.suptitle(f"{title}{'   ' if columns * width > 9 else chr(10)}{legend}", fontsize=9)
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png")
    return fig


def draw_panel(ax, cells: list, shares: list, transfers: list, title: str) -> None:
    """One panel on `ax`: `cells[device][chunk]` coloured by `shares`, and an arrow per transfer into them."""
    cmap = colormaps["YlGn"]
    n, k = len(cells), len(cells[0])
    for d in range(n):
        for c in range(k):
            share = shares[d][c]
            ax.add_patch(_cell(c, d, cmap(0.15 + 0.75 * share)))
            text = cells[d][c]
            ax.text(c, d, text if len(text) <= 9 else text[:8] + "…", ha="center", va="center",
                    fontsize=7, color="white" if share > 0.7 else "black")
    for src, dst, chunk, reduce in transfers:
        shift = 0.25 * (((src - dst) % n) / n - 0.5)  # arrows into one cell fan out instead of overlapping
        ax.annotate("", xy=(chunk + shift, dst), xytext=(chunk + shift, src),
                    arrowprops=dict(arrowstyle="-|>", color=ADD if reduce else COPY, lw=1.2,
                                    connectionstyle="arc3,rad=0.25", shrinkA=6, shrinkB=6))
    ax.set_xlim(-0.5, k - 0.5)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xticks(range(k), [f"c{c}" for c in range(k)], fontsize=7)
    ax.set_yticks(range(n), [f"dev{d}" for d in range(n)], fontsize=7)
    ax.set_title(title, fontsize=8)


def _cell(x: float, y: float, colour):
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.48, y - 0.45), 0.96, 0.9, facecolor=colour, edgecolor="white")
