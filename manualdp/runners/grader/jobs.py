"""What the grader's child runs with a student's functions (`JOBS`): the checkpoint exercise's run.

The child imports this module, and torch only, when a job is asked for; the grader imports it too,
to run the same loop uninterrupted in its own process (`properties.checkpoint.resume_property`).
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

__all__ = ["JOBS", "Resumed", "resume_run", "resume_save", "resume_load", "train_resumed"]

JOBS = {"resume": "resume_run", "resume_save": "resume_save", "resume_load": "resume_load"}  # job -> its function here


class Resumed(nn.Module):
    """The checkpoint exercise's model: dropout, so that torch's random number generator matters."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 4))

    def forward(self, x):
        return self.net(x)


def _resume_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(64, 6, generator=g), torch.randint(0, 4, (64,), generator=g)


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _train(model: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    """Steps `start` to `stop - 1`: each draws its batch of 8 rows with torch.randint, and dropout its masks."""
    X, y = _resume_data()
    for _ in range(start, stop):
        rows = torch.randint(0, len(X), (8,))
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[rows]), y[rows]).backward()
        opt.step()


def resume_save(save_checkpoint, load_checkpoint, optimizer: str, steps: int, stop_at: int, seed: int,
                path: str = "checkpoint.pt") -> None:
    """The first half of the checkpoint exercise's run: train `stop_at` steps from `torch.manual_seed(seed)`, then
    `save_checkpoint(path, model, optimizer, stop_at)`."""
    with _one_thread():
        torch.manual_seed(seed)
        model = Resumed()
        opt = _optimizer(optimizer, model)
        _train(model, opt, 0, stop_at)
        save_checkpoint(path, model, opt, stop_at)


def resume_load(save_checkpoint, load_checkpoint, optimizer: str, steps: int, reseed: int,
                path: str = "checkpoint.pt") -> dict:
    """The second half: a fresh model and optimizer (torch seeded anew by `reseed`, drawn apart from the run's seed,
    as a new process would be), `load_checkpoint(path, model, optimizer)`, and the steps from the one it returns to
    `steps`. Nothing here holds the run's seed: a resume can come from the file only, not from a replay."""
    with _one_thread():
        torch.manual_seed(reseed)
        model = Resumed()
        opt = _optimizer(optimizer, model)
        step = load_checkpoint(path, model, opt)
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= steps:
            return {"step": step}
        _train(model, opt, step, steps)
        return {"step": step, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def resume_run(save_checkpoint, load_checkpoint, optimizer: str, steps: int, stop_at: int, seed: int, reseed: int,
               path: str = "checkpoint.pt") -> dict:
    """Both halves in one process (the grader also runs them in two: `properties.checkpoint.resume_property`);
    {"unsaved": path} if save_checkpoint wrote nothing at `path`."""
    resume_save(save_checkpoint, load_checkpoint, optimizer, steps, stop_at, seed, path)
    if not os.path.exists(path):
        return {"unsaved": path}
    return resume_load(save_checkpoint, load_checkpoint, optimizer, steps, reseed, path)


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_resumed(model: nn.Module, optimizer: str, start: int, stop: int) -> None:
    """The uninterrupted run's steps, with a new optimizer named `optimizer`."""
    _train(model, _optimizer(optimizer, model), start, stop)
