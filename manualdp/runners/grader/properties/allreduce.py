"""`allreduce(tensors)` (chapter 1): every tensor the caller holds ends as the sum, bitwise identical on every
device; and what hypothesis draws for it (`DRAWN`)."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from .common import FLOATS, Mismatch, apart, called, show

__all__ = ["make_tensors", "allreduce_property", "DRAWN"]

INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]


def make_tensors(n: int, shape: tuple, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """`n` independent tensors with small values, so that integer sums do not overflow."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(n)]
    return [torch.randint(0, 10, shape, generator=g).to(dtype) for _ in range(n)]


def allreduce_property(allreduce, n: int, shape: tuple, dtype: torch.dtype, seed: int, transpose: bool = False) -> None:
    """After `allreduce(tensors)`, every tensor the caller holds is the sum, and all are bitwise identical.

    The check reads the tensors the caller holds, never the list passed in: an allreduce that
    rebinds `tensors[i] = ...` fills that list, but the devices' own tensors keep their old values.
    """
    tensors = make_tensors(n, shape, dtype, seed)
    if transpose and len(shape) >= 2:
        tensors = [t.transpose(0, 1) for t in tensors]  # views: the sum must reach the viewed storage
    shape = tuple(tensors[0].shape)
    expected = torch.stack(tensors).sum(0).to(dtype)
    call = (f"allreduce(tensors) on {n} tensor{'s' * (n != 1)} of shape {shape} and dtype {str(dtype)[6:]}"
            + (" (transposed views)" if transpose and len(shape) >= 2 else "")
            + (f", holding {', '.join(show(t) for t in tensors)}" if expected.numel() <= 6 else ""))
    (held,), (given,), _ = called(call, allreduce, list(tensors))  # the tensors the devices hold; the list passed
    for i, t in enumerate(held):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape != expected.shape:
            what = (f"a tensor of dtype {str(t.dtype)[6:]} and shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                    else show(t))
            raise Mismatch(f"{call}: expected every device to hold the sum, of dtype {str(dtype)[6:]} and shape "
                           f"{shape}, in the very tensor it held; device {i} holds {what}. Write the sum into each "
                           "device's tensor in place (`tensors[i].copy_(...)` keeps its dtype and shape)")
        if t.dtype.is_floating_point:  # to each dtype's precision: a float64 sum taken in float32 is wrong
            tol = 1e-10 if t.dtype == torch.float64 else 1e-5
            right = torch.allclose(t, expected, rtol=tol, atol=tol)
        else:
            right = torch.equal(t, expected)
        if not right:
            rebound = given[i] is not t
            coarse = t.dtype == torch.float64 and torch.allclose(t, expected, rtol=1e-5, atol=1e-5)
            want, got = apart(expected, t)
            raise Mismatch(f"{call}: expected every device to hold the sum {want}; device {i} holds {got}"
                           + (f", off by up to {(t - expected).abs().max().item():.2g}: right to float32's precision "
                              "only. Sum in the tensors' own dtype, float64" if coarse else "")
                           + (". Your allreduce put a new tensor into the list (`tensors[i] = ...`): write into the "
                              "tensor the device holds (`tensors[i].copy_(...)`)" if rebound else ""))
        if not torch.equal(t, held[0]):
            raise Mismatch(f"{call}: devices 0 and {i} hold sums that are close but not bitwise identical "
                           f"({' and '.join(apart(held[0], t))}): every device must end with the very same bits "
                           "(copy one sum to the others rather than adding in another order)")


SHAPES = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
DRAWN = dict(n=st.integers(1, 8), shape=st.one_of(SHAPES, st.integers(0, 10**5).map(lambda k: (k,))),
             dtype=st.sampled_from(INTS + FLOATS), seed=st.integers(0, 2**31 - 1), transpose=st.booleans())
