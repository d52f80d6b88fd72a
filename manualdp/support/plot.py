"""Training curves as a PNG: loss and accuracies against epochs."""
from __future__ import annotations

import os
from collections.abc import Mapping

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .files import atomic_write

__all__ = ["plot_history", "new_figure", "save_figure"]

_CURVES = ("train_loss", "train_acc", "test_acc")


def _curves(history) -> dict[str, list[float]]:
    """The per-epoch lists of a `History`, or of a dict such as its JSON."""
    get = history.get if isinstance(history, Mapping) else lambda k: getattr(history, k, None)
    curves = {}
    for key in _CURVES:
        values = get(key)
        if not isinstance(values, (list, tuple)):
            raise TypeError(f"history.{key} must be a list of numbers, got {values!r}")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise TypeError(f"history.{key} must contain only numbers, got {values!r}")
        curves[key] = [float(v) for v in values]
    lengths = {key: len(v) for key, v in curves.items()}
    if len(set(lengths.values())) != 1 or not curves["train_loss"]:
        raise ValueError(f"history needs the same, non-zero number of epochs in each curve, got {lengths}")
    return curves


def _check_png_path(path) -> str:
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"path must be a non-empty str or os.PathLike, got {path!r}")
    path = os.fspath(path)
    if not path.lower().endswith(".png"):
        raise ValueError(f"path must end in .png, got {path!r}")
    if os.path.isdir(path):
        raise ValueError(f"path {path!r} is a directory")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ValueError(f"path {path!r}: directory {folder!r} does not exist")
    return path


def plot_history(history, path) -> None:
    """Draw loss and train/test accuracy against epochs into the PNG file `path`, atomically."""
    curves = _curves(history)
    path = _check_png_path(path)
    epochs = range(1, len(curves["train_loss"]) + 1)

    fig = Figure(figsize=(8, 3.2), layout="constrained")
    FigureCanvasAgg(fig)  # draw with Agg directly: no pyplot, no global backend switch
    loss_ax, acc_ax = fig.subplots(1, 2)
    loss_ax.plot(epochs, curves["train_loss"], "o-", label="train loss")
    loss_ax.set(xlabel="epoch", ylabel="loss", title="training loss")
    acc_ax.plot(epochs, curves["train_acc"], "o-", label="train acc")
    acc_ax.plot(epochs, curves["test_acc"], "s--", label="test acc")
    acc_ax.set(xlabel="epoch", ylabel="accuracy", title="accuracy", ylim=(0, 1))
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.legend()
        ax.xaxis.get_major_locator().set_params(integer=True)

    # Save next to the target and rename: a crash leaves the old file or the new one, never half of one.
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=100)


def new_figure(rows: int = 1, cols: int = 1, width: float = 6.4, height: float = 4.0):
    """A figure drawn with Agg (no pyplot, no global backend) and its axes as a flat list."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def save_figure(fig, path, dpi: int = 110) -> None:
    """Write `fig` as a PNG at `path`, atomically."""
    with atomic_write(_check_png_path(path)) as f:
        fig.savefig(f, format="png", dpi=dpi)
