"""Replicas that drift apart: a digest of every parameter, compared across the ranks at steps 0, 1, 2, 4, ..., N, 2N.

Torch's DDP compares the replicas' weights once, at construction; after that nothing tells a user
whose replicas have parted: a rank that loaded other weights between steps, a parameter unfrozen
after wrapping (the wrapper never averages it), a ZeRO optimizer over ranks that built their models
from other seeds. Each rank trains on, and the run ends with as many models as ranks.

So every wrapper (the rungs, the drop-in, ZeRO; HSDP's replicas of each shard in `sharding/fsdp_drift.py`, on
the same schedule: a 1-D `fully_shard` replicates nothing) counts its steps and compares the parameters across
the ranks (`DriftCheck.tick`) at steps 0, 1, 2, 4, 8, ... below `every`, then at every multiple of `every`
(`due`): a run shorter than `every` steps is checked too, within twice the steps a drift began at, and a long
run pays the same per step. A check is one 64-bit digest per parameter, a sum of its bit patterns read as
integers, each weighted by its position (`digests`: a plain sum would miss a permuted parameter, a square weight
loaded transposed on one rank; the weights look random, so that small changes do not cancel), then the ranks'
agreement (`transport.agree.agree`: a round trip of 8 bytes per rank that compares the calls, and one that
compares the digests). Replicas are bitwise equal after every step
(the collectives leave every rank the same bits, and the optimizers step alike), so any difference is drift:
every rank raises, naming the first parameter that differs. `every=0` turns the check off.

Its cost, a weighted sum over the parameters and two small round trips every `every` steps (and
log2(`every`) more at the start), is in `bench/drift_cost.py`.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ...validate import non_negative_int
from ..transport.agree import agree
from .identity import naming_wrappers

__all__ = ["DRIFT_CHECK_EVERY", "DriftCheck", "check_replicas", "digests", "due", "tensor_digest"]

# steps between two checks by default: a check cost about a tenth of a LeNet step on 2 CPU ranks (5 of 60 ms,
# bench/drift_cost.py), so under 0.1% of the run at this interval, while a drift is caught within 100 steps
DRIFT_CHECK_EVERY = 100
# a view of each element size as integers, whose weighted sum is the digest (complex dtypes as their real pairs)
# the integers a tensor's bits are read as; 64-bit elements as two 32-bit halves (`_bits_digest`)
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
# elements weighted at once: the weights (and one product) are this many int64s, 8 MiB, whatever the parameter's size
_CHUNK = 1 << 20
_WEIGHTS: dict[torch.device, torch.Tensor] = {}  # device -> the odd weights mix(0), mix(1), ... of a chunk's elements
# splitmix64's constants as signed 64-bit integers (torch's int64 arithmetic wraps as unsigned arithmetic would)
_SPLITMIX = [c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)]


def _shifted(z: torch.Tensor, bits: int) -> torch.Tensor:
    """`z >> bits` as an unsigned shift (torch shifts int64 arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(k: torch.Tensor) -> torch.Tensor:
    """splitmix64 of int64 `k`, made odd: weights that look random, the same on every rank, machine and version."""
    z = k * _SPLITMIX[0] + _SPLITMIX[0]
    z = (z ^ _shifted(z, 30)) * _SPLITMIX[1]
    z = (z ^ _shifted(z, 27)) * _SPLITMIX[2]
    return (z ^ _shifted(z, 31)) | 1


def _weights(device: torch.device) -> torch.Tensor:
    """The odd weights mix(0), ..., mix(`_CHUNK` - 1) of a chunk's elements on `device`, made once."""
    if device not in _WEIGHTS:
        _WEIGHTS[device] = _mix(torch.arange(_CHUNK, dtype=torch.int64, device=device))
    return _WEIGHTS[device]


@functools.lru_cache(maxsize=None)
def _chunk_factor(index: int) -> int:
    """The odd factor of chunk `index`'s weighted sum: mix(`_CHUNK` + index)."""
    return int(_mix(torch.tensor(_CHUNK + index)))


def _digest(bits: torch.Tensor) -> torch.Tensor:
    """sum(bits[k] * mix(k mod C) * mix(C + k div C)) over a flat integer tensor, wrapping at 64 bits.

    Order-sensitive (two elements that trade places change it unless they are equal); every weight is
    odd, so one changed element always changes it (an odd factor never turns a nonzero difference into
    zero modulo 2**64); and the weights look random (splitmix64), so that small changes of several
    elements do not cancel (with weights 1, 3, 5, ... the integers [3, 0] and [0, 1] summed alike).
    """
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    weights = _weights(bits.device)
    for index, start in enumerate(range(0, bits.numel(), _CHUNK)):
        part = bits[start:start + _CHUNK]
        total += (part * weights[:part.numel()]).sum() * _chunk_factor(index)
    return total


def _bits_digest(t: torch.Tensor) -> torch.Tensor:
    """`t`'s 64-bit digest as a 0-dim tensor on its device: its bits in logical order, read as integers (`_digest`).

    64-bit elements are read as two 32-bit halves: read whole, a flipped sign bit adds 2**63 times an odd weight,
    which is always 2**63, and any two flips cancel (a negated float64 column, or a complex128 element negated).
    A quantized tensor is read by its integers (`int_repr`): viewing its storage as integers crashes torch.
    """
    t = t.detach()
    if t.is_quantized:
        t = t.int_repr()
    flat = t.reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return _digest(flat.view(_INTS[flat.element_size()]))


def digests(named_tensors) -> dict[str, int]:
    """name -> a 64-bit digest of the tensor's bits, in its logical order (a sum weighted by position; `_digest`)."""
    names, sums = [], []
    for name, t in named_tensors:
        names.append(name)
        sums.append(_bits_digest(t))
    values = torch.stack([s.cpu() for s in sums]).tolist() if sums else []  # one copy to the host
    return dict(zip(names, values))


def tensor_digest(t: torch.Tensor) -> int:
    """One tensor's digest, as `digests` gives it: what the ranks compare of a tensor (the drift check, a comm hook's
    bound arguments)."""
    return int(_bits_digest(t))


def due(step: int, every: int, early: bool = True) -> bool:
    """Whether the replicas are compared at `step` (from 0): 0, 1, 2, 4, ... while below `every` (`early`), then its
    multiples."""
    if not every:
        return False
    return step % every == 0 or (early and step < every and step & (step - 1) == 0)


def check_replicas(named_tensors, group=None, *, who: str, step: int, timeout: float | None = None,
                   number: int | None = None, call_step: int = -1) -> None:
    """Raise RuntimeError on every rank of `group` unless every rank holds bitwise the same tensors.

    `named_tensors`: (name, tensor) pairs, the same names in the same order on every rank; `who`
    (the wrapper) and `step` name the check in the error, which names the first tensor that differs.
    `number`: the wrapper's number (`identity.take_number`), compared first: ranks that called two
    different wrappers here are named as such, not as replicas that drifted.
    `call_step`: the step field of the wrapper's own collectives, compared by the first call check.
    Every rank must call it at the same point of the program.
    """
    if dist.get_world_size(group) == 1:
        return
    if number is not None:  # first which wrapper: two wrappers' parameters always differ, and that is not drift
        agree(f"{who}'s replica at step {step}", {"wrapper": f"#{number}"}, group, error=RuntimeError,
              timeout=timeout, check=True, call_step=call_step,
              hint="wrappers are numbered in the order each rank built them: the ranks called different wrappers "
                   "here, as a(b(x)) on one rank and b(a(x)) on another does")
    fields = {f"parameter {name}": value for name, value in digests(named_tensors).items()}
    agree(f"{who}'s replica at step {step}", fields, group, error=RuntimeError, timeout=timeout, check=True,
          call_step=call_step,
          hint="the replicas no longer hold the same parameters (the per-rank values are digests of their bits): "
               "a rank loaded other weights or changed a parameter by hand, a parameter was unfrozen after "
               "wrapping (build the wrapper after unfreezing it), or the ranks built their models from other "
               "seeds; every rank must hold the same model (drift_check_every=0 turns this check off)")


class DriftCheck:
    """A wrapper's drift check: `tick` once per step; it compares the replicas at the steps `due` names."""

    def __init__(self, every: int) -> None:
        self.every = non_negative_int("drift_check_every", every)
        self.steps = 0  # steps begun so far
        self.last: int | None = None  # the last step given to `tick` (the drop-in's count of synchronised backwards)

    def tick(self, named_tensors, group, *, who: str, timeout: float | None = None, number: int | None = None,
             names: list[str] | None = None, step: int | None = None, call_step: int = -1,
             early: bool = True) -> None:
        """A step begins: compare the replicas if it is due (`named_tensors` is read only then); `names`: the
        wrapper's parameters as built, to name one a peer replaced (`identity.naming_wrappers`).

        `step`: the wrapper's own count of finished steps (the drop-in's synchronised backward passes), checked once
        each: a forward without backward on one rank (torch's DDP takes it) must not shift its schedule against its
        peers'; None: count the calls. `call_step`: the step field the wrapper's collectives carry (the step about to
        begin), compared by the check's own call check, so that a rank out of step (one backward more) is named by its
        step where a check meets its peers' buckets, with no exchange of the step's calls alone before the check.
        `early`: also at steps 1, 2, 4, ... below `every` (`due`; the drop-in's debug mode keeps the interval: its
        per-bucket comparison would meet an early check)."""
        if step is None:
            step, self.steps = self.steps, self.steps + 1
        elif step == self.last:
            return
        self.last = step
        if due(step, self.every, early):
            with naming_wrappers(names, who):
                check_replicas(named_tensors() if callable(named_tensors) else named_tensors, group, who=who,
                               step=step, timeout=timeout, number=number, call_step=call_step)
