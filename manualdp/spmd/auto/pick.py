"""`algorithm="auto"`'s pick: the cost model's prediction for each schedule, and the least risky of them.

Pure arithmetic on the constants of a transport (`Link`): `predict` is `manualdp.cost`'s
alpha-beta-gamma time of a schedule, `choose` the algorithm that loses least to the fastest
anywhere within the measured range of the duplex. Measuring and caching the constants is
`manualdp.spmd.auto.tune`'s. (Not in `manualdp.cost` itself: the book prices one schedule at a
time, and `predict` reads the loads that `manualdp.loads` writes down without building it.)
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from ...cost import MAX_DUPLEX, loads_cost
from ...loads import allreduce_loads
from ...schedule import ALGORITHMS
from ...validate import fraction, non_negative_int, non_negative_number, positive_int
from ..transport.plan import DEFAULT_SEGMENT_BYTES  # the model pipelines additions with the executor's segments

__all__ = ["Link", "predict", "choose", "MAX_SECONDS", "MAX_PARALLEL"]

# A second per message or per byte is no link (a typo or a corrupt cache), and larger constants overflow
# the predictions to inf. Ranks receive `parallel` as a float64, exact up to 2**53.
MAX_SECONDS = 1.0
MAX_PARALLEL = 1 << 53


@dataclass(frozen=True)
class Link:
    """The alpha-beta-gamma constants of one transport."""

    alpha: float  # seconds per message (latency, including the posting of it)
    beta: float   # seconds per byte sent or received
    gamma: float  # seconds per byte added
    duplex: float = 0.0  # what sending and receiving at once costs on top of the larger: 0 (free), 1 (in turn), to 2
    parallel: int = 0  # ranks that can work at once, 0 for all; counted from the host (`link_cache.host_parallel`)
    duplex_spread: float = 0.0  # how far the duplex may lie from `duplex`: about two standard errors of it

    def duplexes(self) -> tuple[float, ...]:
        """The duplex at the low end, the middle and the high end of its measured range (one value if exact)."""
        return tuple(sorted({max(0.0, self.duplex - self.duplex_spread), self.duplex,
                             min(MAX_DUPLEX, self.duplex + self.duplex_spread)}))

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            if non_negative_number(name, getattr(self, name)) > MAX_SECONDS:
                raise ValueError(f"{name} must be at most {MAX_SECONDS} s (per message or byte), "
                                 f"got {getattr(self, name)!r}")
        fraction("duplex", self.duplex, MAX_DUPLEX)
        fraction("duplex_spread", self.duplex_spread, MAX_DUPLEX)
        if non_negative_int("parallel", self.parallel) > MAX_PARALLEL:
            raise ValueError(f"parallel must be at most {MAX_PARALLEL} ranks, got {self.parallel!r}")


def predict(algorithm: str, world_size: int, nbytes: int, link: Link, element_size: int = 4,
            segment_bytes: int | None = DEFAULT_SEGMENT_BYTES) -> float:
    """Predicted seconds for an allreduce of `nbytes` per rank with `algorithm`, cut into `segment_bytes`.

    `manualdp.cost.cost` of the schedule, from its loads written down without building it
    (`allreduce_loads`), so that 100,000 ranks take no longer than 8.
    """
    non_negative_int("nbytes", nbytes)
    positive_int("element_size", element_size)
    nbytes -= nbytes % element_size
    return loads_cost(allreduce_loads(algorithm, world_size, nbytes, element_size), link.alpha, link.beta, link.gamma,
                      link.duplex, link.parallel, segment_bytes)


@functools.lru_cache(maxsize=1024)  # a training run asks for the same few bucket sizes again and again
def choose(world_size: int, nbytes: int, link: Link, element_size: int = 4,
           segment_bytes: int | None = DEFAULT_SEGMENT_BYTES) -> str:
    """The algorithm that loses least to the fastest wherever in its measured range the duplex lies.

    With an exact link (`duplex_spread` 0) that is the lowest prediction. A calibration on a
    busy host reads the duplex with noise, and at two ranks it alone decides between naive
    and ring: an algorithm whose lead holds only at one end of the range is not picked when
    another is never far behind at either end. Ties go to the first in `ALGORITHMS`' order.
    """
    positive_int("world_size", world_size)
    non_negative_int("nbytes", nbytes)
    times = [{a: predict(a, world_size, nbytes, replace(link, duplex=d), element_size, segment_bytes)
              for a in ALGORITHMS} for d in link.duplexes()]
    return min(ALGORITHMS, key=lambda a: max(_behind(t[a], min(t.values())) for t in times))


def _behind(time: float, fastest: float) -> float:
    """How many times the fastest's time `time` is (1 for the fastest, also when both are 0)."""
    return time / fastest if fastest > 0 else 1.0 if time == 0 else math.inf

