"""How `Manager.average` makes the members' shares one average: the schedule it runs, and where the divide goes.

Sum then divide (the default) gives the bits every reference holds (torchft's formula, the
one-process runs). Divide first (`divide_first=True`, as torch's DDP) keeps a sum of finite shares
from overflowing where the average fits (two float16 40000s). In float16 and bfloat16 a divided share
rounds, and the rounded shares can still sum past the dtype: three float16 65504s divide to 21840
(65504/3 = 21834.67 rounded), and 3 x 21840 = 65520 rounds to Inf, though the average, 65504, fits.
So half-precision shares are divided and summed in float32, and the average cast back once.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["average_shares", "may_not_sum", "schedule_for", "ONE_ROUND", "HALF"]

ONE_ROUND = 1 << 20  # bytes: at two members, a buffer up to this size is averaged in one round (`schedule_for`)
HALF = (torch.float16, torch.bfloat16)  # dtypes whose divided-first shares are summed in float32


def average_shares(tensor: torch.Tensor, members: int, sum_: Callable[[torch.Tensor], None],
                   divide_first: bool = False) -> None:
    """Make `tensor` the average of the `members`' shares in place; `sum_(t)` sums `t` over them in place."""
    if not divide_first:
        sum_(tensor)
        tensor.div_(members)
        return
    wide = tensor.float() if tensor.dtype in HALF else tensor  # a copy in float32: its sum cannot round past the dtype
    wide.div_(members)
    sum_(wide)
    if wide is not tensor:
        tensor.copy_(wide)


def may_not_sum(share: torch.Tensor, members: int) -> bool:
    """Whether `members` shares might not sum finite if one is `share`: it holds NaN/Inf or an element past
    the dtype's largest / (4 `members`). If no member's share does, every partial sum stays below half the
    largest (rounding included), so sum then divide is finite and no share is needed again."""
    if share.is_complex():
        return True
    if not share.is_floating_point() or share.numel() == 0:  # integers: never averaged again (`bucketed.finite`)
        return False
    low, high = torch.aminmax(share)  # one read of the share, cheaper than copying it; NaN compares False below
    bound = torch.finfo(share.dtype).max / (4 * members)
    return not (-bound <= low.item() and high.item() <= bound)


def schedule_for(algorithm: str, members: int, tensor: torch.Tensor) -> str:
    """The schedule `average` runs: `algorithm`, but at two members one round (recursive doubling) up to `ONE_ROUND`.

    At two members every schedule adds the same two numbers (the partners in opposite order, and
    IEEE addition is commutative): the same bits. The ring's two rounds cost a small buffer twice
    the messages and about 3x the CPU (an mlp's bucket, the guard's norms); from a few MiB on, the
    ring's half-size additions cost less.
    """
    if members == 2 and tensor.numel() * tensor.element_size() <= ONE_ROUND:
        return "recursive_doubling"
    return algorithm
