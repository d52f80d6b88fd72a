"""The record of a training run: per-epoch curves, written as JSON or plotted."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .files import write_json_atomic

__all__ = ["History"]


@dataclass
class History:
    """Per-epoch results of `train`; `to_json` / `plot` write them out."""

    train_loss: list[float] = field(default_factory=list)
    train_acc: list[float] = field(default_factory=list)
    test_acc: list[float] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    samples_per_second: list[float] = field(default_factory=list)
    config: dict = field(default_factory=dict)

    def record_epoch(self, train_loss: float, train_acc: float, test_acc: float, seconds: float,
                     samples_per_second: float) -> None:
        """Append one epoch's results."""
        self.train_loss.append(train_loss)
        self.train_acc.append(train_acc)
        self.test_acc.append(test_acc)
        self.epoch_seconds.append(seconds)
        self.samples_per_second.append(samples_per_second)

    def to_json(self, path: str) -> None:
        """Write the history as JSON, atomically (a temporary file renamed into place)."""
        write_json_atomic(path, asdict(self))

    @classmethod
    def from_json(cls, path: str) -> "History":
        """Read a history that `to_json` wrote."""
        with open(path) as f:
            return cls(**json.load(f))

    def plot(self, path: str) -> None:
        """Plot loss and accuracies against epochs into a PNG at `path`."""
        from .plot import plot_history
        plot_history(self, path)
