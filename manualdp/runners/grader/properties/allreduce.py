"""`allreduce(tensors)` (chapter 1): every tensor the caller holds ends as the sum, bitwise identical on every
device; what hypothesis draws for it (`DRAWN`), and the sizes checked once beside (`allreduce_sizes_property`).

The rule for integers is torch's (`torch.distributed.all_reduce`): the sum in the tensors' own dtype, wrapping
around as integer addition does, so that an int16 sum past 32767 is that sum modulo 2**16."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from .common import FLOATS, Mismatch, apart, called, show, sum_within

__all__ = ["make_tensors", "allreduce_property", "allreduce_sizes_property", "wrapped_sum", "DRAWN", "SIZES"]

INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]


def make_tensors(n: int, shape: tuple, dtype: torch.dtype, seed: int, wide: bool = False) -> list[torch.Tensor]:
    """`n` independent tensors with small values; with `wide`, integers drawn over their dtype's whole range, so
    that their sum overflows."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(n)]
    if wide:
        info = torch.iinfo(dtype)  # randint's high is exclusive, and int64's max + 1 does not fit in an int64
        return [torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype) for _ in range(n)]
    return [torch.randint(0, 10, shape, generator=g).to(dtype) for _ in range(n)]


def wrapped_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum the exercise asks for: floats summed as torch sums them, integers added in their own dtype."""
    if tensors[0].dtype.is_floating_point:
        return torch.stack(tensors).sum(0)
    total = tensors[0].clone()
    for t in tensors[1:]:
        total.add_(t)  # in the dtype: wraps past its largest value, as torch.distributed.all_reduce does
    return total


def allreduce_property(allreduce, n: int, shape: tuple, dtype: torch.dtype, seed: int, transpose: bool = False,
                       wide: bool = False) -> None:
    """After `allreduce(tensors)`, every tensor the caller holds is the sum, and all are bitwise identical.

    The check reads the tensors the caller holds, never the list passed in: an allreduce that
    rebinds `tensors[i] = ...` fills that list, but the devices' own tensors keep their old values.
    """
    tensors = make_tensors(n, shape, dtype, seed, wide)
    if transpose and len(shape) >= 2:
        tensors = [t.transpose(0, 1) for t in tensors]  # views: the sum must reach the viewed storage
    shape = tuple(tensors[0].shape)
    expected, kept = wrapped_sum(tensors), [t.clone() for t in tensors]
    numel = expected.numel()
    call = (f"allreduce(tensors) on {n} tensor{'s' * (n != 1)} of shape {shape} and dtype {str(dtype)[6:]}"
            + (" (transposed views)" if transpose and len(shape) >= 2 else "")
            + (f", holding {', '.join(show(t) for t in tensors)}" if numel <= 6 else "")
            + (f" (values over the dtype's whole range: the sum wraps around, as torch.distributed.all_reduce's "
               "does)" if wide and not dtype.is_floating_point else ""))
    (held,), (given,), _ = called(call, allreduce, list(tensors))  # the tensors the devices hold; the list passed
    for i, t in enumerate(held):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape != expected.shape:
            what = (f"a tensor of dtype {str(t.dtype)[6:]} and shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                    else show(t))
            raise Mismatch(f"{call}: expected every device to hold the sum, of dtype {str(dtype)[6:]} and shape "
                           f"{shape}, in the very tensor it held; device {i} holds {what}. Write the sum into each "
                           "device's tensor in place (`tensors[i].copy_(...)` keeps its dtype and shape)")
    for i, t in enumerate(held):
        if t.dtype.is_floating_point:  # as any order of summation rounds, in the dtype: a float64 sum taken in float32
            right = bool(sum_within(t, kept).all())  # is wrong, and so is a sum scaled by 1 + 4e-6
        else:
            right = torch.equal(t, expected)
        if not right:
            raise Mismatch(_wrong(call, i, t, expected, given[i] is not t,
                                  n > 1 and all(torch.equal(a, b) for a, b in zip(held, kept)), _overflows(kept)))
        if not torch.equal(t, held[0]):
            raise Mismatch(f"{call}: devices 0 and {i} hold sums that are close but not bitwise identical "
                           f"({' and '.join(apart(held[0], t))}): every device must end with the very same bits "
                           "(copy one sum to the others rather than adding in another order)")


def _wrong(call: str, i: int, t: torch.Tensor, expected: torch.Tensor, rebound: bool, untouched: bool,
           wrapped: bool) -> str:
    """What device `i`'s wrong sum says, with the slip it shows."""
    worst = int((t.to(torch.float64) - expected.to(torch.float64)).abs().reshape(-1).argmax()) if t.numel() else 0
    at = (f" (element {worst} of {expected.numel()} is {t.reshape(-1)[worst].item()}, expected "
          f"{expected.reshape(-1)[worst].item()})" if expected.numel() > 12 else "")
    coarse = t.dtype == torch.float64 and torch.allclose(t, expected, rtol=1e-5, atol=1e-5)
    want, got = apart(expected, t)
    return (f"{call}: expected every device to hold the sum {want}; device {i} holds {got}{at}"
            + (f", off by up to {(t - expected).abs().max().item():.2g}: right to float32's precision "
               "only. Sum in the tensors' own dtype, float64" if coarse else "")
            + (". Your allreduce put a new tensor into the list (`tensors[i] = ...`): write into the "
               "tensor the device holds (`tensors[i].copy_(...)`)" if rebound else "")
            + (". No device's tensor changed: your allreduce wrote into none of them (`for t in tensors: t = total` "
               "only gives the name t another tensor): write into each (`t.copy_(total)`)"
               if untouched and not rebound else "")
            + (f". The sum overflows {str(t.dtype)[6:]} here: the exercise's rule, torch.distributed.all_reduce's, "
               "is the sum in the tensors' own dtype, wrapping around; add in place in that dtype "
               "(`tensors[0].add_(...)`), not through a float or a wider integer" if wrapped and not untouched else ""))


def _overflows(tensors: list[torch.Tensor]) -> bool:
    """Whether the exact sum of integer `tensors` leaves their dtype's range (float64 is near enough to tell)."""
    if tensors[0].dtype.is_floating_point or not tensors[0].numel():
        return False
    info, exact = torch.iinfo(tensors[0].dtype), torch.stack([t.to(torch.float64) for t in tensors]).sum(0)
    return bool((exact > info.max).any() or (exact < info.min).any())


def allreduce_sizes_property(allreduce) -> None:
    """The sizes checked once, beside what hypothesis draws: a million elements on 2 and 3 devices (an answer may
    take another path past some size), integer sums that overflow int16 and int32 on 2 and 8 devices, 16 devices."""
    for case in SIZES:
        allreduce_property(allreduce, **case)


SHAPES = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
DRAWN = dict(n=st.integers(1, 8), shape=st.one_of(SHAPES, st.integers(0, 10**5).map(lambda k: (k,))),
             dtype=st.sampled_from(INTS + FLOATS), seed=st.integers(0, 2**31 - 1), transpose=st.booleans(),
             wide=st.booleans())
SIZES = [dict(n=2, shape=(2**20 + 3,), dtype=torch.float32, seed=1), dict(n=3, shape=(1000, 1001), dtype=torch.int64,
                                                                        seed=2, transpose=True),
         dict(n=2, shape=(10**6,), dtype=torch.int16, seed=3, wide=True),
         dict(n=8, shape=(5,), dtype=torch.int16, seed=4, wide=True),
         dict(n=2, shape=(100,), dtype=torch.int32, seed=5, wide=True),
         dict(n=8, shape=(5,), dtype=torch.int32, seed=6, wide=True),
         dict(n=16, shape=(5,), dtype=torch.float32, seed=7)]
"""Checked once by `allreduce_sizes_property` (a million elements once, not for every example hypothesis draws):
2**20 + 3 elements, past a power-of-two chunk with a partial one left over (an answer that works in 2**20-element
chunks must sum the tail), and 16 devices, twice what hypothesis draws (an answer with a table of 8 must grow it)."""
