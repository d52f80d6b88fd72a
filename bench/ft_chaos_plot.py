"""A replica-group chaos run's membership over its steps, drawn: `bench/ft_chaos.py --group-size 2 --plot PNG`.

One row per group, one column per step: a filled cell where the group was in the quorum that
committed the step, a hatched one where it was in a round of that step that was discarded, and
a red cross where a rank of the group was killed (in the step the run was then attempting).
"""
from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from manualdp.support.plot import save_figure

__all__ = ["membership", "plot_membership"]


def membership(summary: dict) -> dict:
    """The cells of the picture: committed and discarded (step, group) pairs and the kills' (step, group)."""
    missing = [k for k in ("committed", "killed", "procs", "total") if k not in summary]
    if missing:
        raise ValueError(f"summary must be group_chaos's (bench/ft_chaos_groups.py); it lacks {', '.join(missing)}")
    committed = {(step, g) for step, ids in summary["committed"].values() for g in ids}
    discarded = {(step, g) for step, ids in summary.get("discarded", {}).values() for g in ids}
    decided = {int(r): ("commit", s) for r, (s, _) in summary["committed"].items()}
    decided |= {int(r): ("discard", s) for r, (s, _) in summary.get("discarded", {}).items()}
    kills = []
    for (gid, _, _), before in zip(summary["killed"], summary.get("kill_rounds", [])):
        outcome, step = decided.get(before, ("commit", -1))  # round 0: nothing decided yet, step 0 under way
        kills.append((step + 1 if outcome == "commit" else step, gid))
    return {"committed": committed, "discarded": discarded - committed, "kills": kills,
            "groups": sorted(summary["procs"]), "steps": summary["total"]}


def plot_membership(summary: dict, path: str) -> dict:
    """Draw `summary`'s membership (`membership`) as a PNG at `path`; the cells drawn."""
    cells = membership(summary)
    groups, steps = cells["groups"], cells["steps"]
    fig = Figure(figsize=(min(14.0, 3.0 + steps / 10), 1.2 + 0.45 * len(groups)), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for kind, style in (("committed", {"color": "C0"}), ("discarded", {"fill": False, "hatch": "///",
                                                                       "edgecolor": "grey"})):
        for step, gid in cells[kind]:
            ax.add_patch(_cell(step, groups.index(gid), **style))
    for step, gid in cells["kills"]:
        ax.plot(step, groups.index(gid), "x", color="red", ms=9, mew=2.5)
    ax.set(xlim=(-0.5, steps - 0.5), ylim=(-0.6, len(groups) - 0.4), yticks=range(len(groups)),
           yticklabels=[f"group {g}" for g in groups], xlabel="step")
    ax.set_title(f"{len(cells['kills'])} kills (red x): filled, the step's committed quorum; hatched, a "
                 "discarded attempt", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    return cells


def _cell(step: int, row: int, **style) -> Rectangle:
    return Rectangle((step - 0.45, row - 0.35), 0.9, 0.7, **style)
