"""A timeline of training steps as Chrome trace-event JSON (opens in Perfetto or chrome://tracing).

    trace = Trace()
    with trace.span("forward", track="dev0"):
        ...
    trace.save("trace.json"); print(trace.summary()); trace.plot("trace.png")

Spans are complete events (`"ph": "X"`), one track (`tid`) per device or rank, plus
tracks for communication. `summary` tells how much communication was hidden behind
backward: the overlap fraction and the exposed communication in ms per step.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time

from .files import atomic_write, write_json_atomic

__all__ = ["Trace", "plot_trace", "COMM", "COMPUTE"]

COMM = "comm"          # category of spans that move data
COMPUTE = "compute"    # category of forward, backward and the optimizer step


class Trace:
    """Events of one process; `pid` tells processes (ranks) apart when their files are merged."""

    def __init__(self, pid: int = 0) -> None:
        self.pid = pid
        self.events: list[dict] = []                    # complete and instant events, in the order they ended
        self.tracks: dict[str, int] = {}                # track name -> tid, in order of first use
        self._t0 = time.perf_counter()
        self.wall0 = time.time()                        # to line up the ranks' traces
        self._lock = threading.Lock()                   # DDP's communication thread records too

    def now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def _tid(self, track: str) -> int:
        return self.tracks.setdefault(track, len(self.tracks))

    def add(self, name: str, track: str, start_us: float, end_us: float, cat: str = COMPUTE, **args) -> None:
        """A span from `start_us` to `end_us` (microseconds since the trace began)."""
        with self._lock:
            self.events.append({"name": name, "cat": cat, "ph": "X", "ts": start_us, "dur": max(0.0, end_us - start_us),
                                "pid": self.pid, "tid": self._tid(track), "args": args})

    def instant(self, name: str, track: str, cat: str = COMM, **args) -> None:
        with self._lock:
            self.events.append({"name": name, "cat": cat, "ph": "i", "s": "t", "ts": self.now_us(),
                                "pid": self.pid, "tid": self._tid(track), "args": args})

    @contextlib.contextmanager
    def span(self, name: str, track: str, cat: str = COMPUTE, **args):
        start = self.now_us()
        try:
            yield
        finally:
            self.add(name, track, start, self.now_us(), cat, **args)

    def to_dict(self) -> dict:
        names = [{"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid, "args": {"name": track}}
                 for track, tid in self.tracks.items()]
        return {"traceEvents": names + sorted(self.events, key=lambda e: e["ts"]), "displayTimeUnit": "ms"}

    def save(self, path: str | os.PathLike) -> None:
        """Write the Chrome trace-event JSON atomically."""
        write_json_atomic(path, self.to_dict())

    def summary(self, steps: int) -> dict:
        """Communication time, the part of it hidden behind backward, and what was left exposed, per step."""
        spans = [e for e in self.events if e["ph"] == "X"]
        comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in spans if e["cat"] == COMM])
        backward = _union([(e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == "backward"])
        total = sum(b - a for a, b in comm)
        hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in backward)
        return {"steps": steps, "comm_ms_per_step": total / 1e3 / max(steps, 1),
                "overlap_fraction": hidden / total if total else 0.0,
                "exposed_comm_ms_per_step": (total - hidden) / 1e3 / max(steps, 1)}

    def plot(self, path: str | os.PathLike) -> None:
        plot_trace(self.to_dict(), path)


def plot_trace(data: dict, path: str | os.PathLike) -> None:
    """A trace (as saved) drawn as a PNG: one row per track of every process, one bar per span."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not os.fspath(path).lower().endswith(".png"):
        raise ValueError(f"path must end in .png, got {path!r}")
    events = data["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M"}
    rows = {key: i for i, key in enumerate(sorted(names))}
    colours = {"forward": "#4c9be8", "backward": "#e8884c", "step": "#59b36b"}
    fig = Figure(figsize=(12, 0.6 * len(rows) + 1.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for e in events:
        if e.get("ph") == "X":
            colour = {"comm": "#b04ad0", "wait": "#d04a4a"}.get(e["cat"], colours.get(e["name"], "#999999"))
            ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (rows[(e["pid"], e["tid"])] - 0.4, 0.8),
                           facecolors=colour)
    multi = len({pid for pid, _ in rows}) > 1
    ax.set_yticks(range(len(rows)), [f"rank {p} {names[(p, t)]}" if multi else names[(p, t)] for p, t in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("ms")
    ax.set_title("forward (blue), backward (orange), step (green), allreduce (purple), waiting for it (red)",
                 fontsize=9)
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
