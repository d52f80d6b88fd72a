"""What a feature of the drop-in is to the reducer: an object with up to five named hooks, called in list order.

The wrapper builds one list of its features (`wrapper.py`, `_wire`); the reducer calls, at each
moment of a step, that hook of every feature that has one, in the list's order. The order is
data, visible in that one place.
"""
from __future__ import annotations

__all__ = ["Feature", "HOOKS"]


class Feature:
    """A feature of the drop-in, as the reducer sees it: five named hooks, each a no-op unless overridden.

    The wrapper hands the reducer its features as one ordered list (`Reducer.use`); at each
    moment the reducer calls that hook of every feature that has one, in the list's order.
    """

    def backward_start(self) -> None:
        """The first gradient hook of a synchronised backward pass."""

    def grad_ready(self, param) -> None:
        """Each gradient hook of a synchronised backward pass, before the gradient goes into its bucket."""

    def before_reduce(self, index: int, bucket) -> None:
        """On the group's worker, before bucket `index` is reduced."""

    def backward_end(self, used: frozenset[int]) -> None:
        """After the averages are in `.grad`; `used`: the indices of the parameters this rank's backward reached."""

    def reset(self) -> None:
        """The backward pass is forgotten (done, failed, or a forward found it unfinished)."""


HOOKS = ("backward_start", "grad_ready", "before_reduce", "backward_end", "reset")
