"""The data a collective is made of: transfers, grouped in rounds, in a `Schedule`.

See `manualdp.schedule` for the schedules themselves and what is computed from them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Transfer", "Schedule", "then"]


class Transfer(NamedTuple):
    src: int      # device that sends
    dst: int      # device that receives
    chunk: int    # which slice of the flat buffer
    reduce: bool  # True: dst adds the chunk to its own; False: dst overwrites its own


@dataclass(frozen=True)
class Schedule:
    algorithm: str
    num_devices: int
    num_chunks: int
    rounds: tuple[tuple[Transfer, ...], ...]
    phases: tuple[str, ...]  # one label per round, e.g. "reduce-scatter"

    def __str__(self) -> str:
        return f"{self.algorithm}({self.num_devices}): {len(self.rounds)} rounds, {self.num_chunks} chunks"


def then(name: str, first: Schedule, second: Schedule) -> Schedule:
    """`first`'s rounds followed by `second`'s, on the same devices and chunks."""
    assert (first.num_devices, first.num_chunks) == (second.num_devices, second.num_chunks)
    return Schedule(name, first.num_devices, first.num_chunks, first.rounds + second.rounds,
                    first.phases + second.phases)
