"""Every rung copies rank 0's buffers before a forward pass with grad as one message of bytes: buffers of any dtype,
size (0, odd, not a multiple of 8 bytes) and layout (not contiguous) arrive whole, at their place, on every rank."""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from manualdp.spmd import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP, launch

RUNGS = {"naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP,
         "bucketed": functools.partial(BucketedDDP, bucket_cap_mb=0.0001)}


class Odd(nn.Module):
    """A layer and buffers whose byte sizes leave the next one misaligned if packed end to end."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("f32", torch.zeros(3))  # 12 bytes: an int64 right after would sit at offset 12
        self.register_buffer("i64", torch.zeros((), dtype=torch.int64))
        self.register_buffer("f16", torch.zeros(5, dtype=torch.float16))
        self.register_buffer("c128", torch.zeros(2, dtype=torch.complex128))
        self.register_buffer("strided", torch.zeros(3, 2).t())  # not contiguous
        self.register_buffer("empty", torch.zeros(0))
        self.register_buffer("flags", torch.zeros(3, dtype=torch.bool))

    def forward(self, x):
        return self.lin(x)


def _job(rung):
    torch.set_num_threads(1)
    r = dist.get_rank()
    model = RUNGS[rung](Odd(), timeout=20)
    with torch.no_grad():  # after construction (which copies rank 0's too): each rank's own values
        for name, b in model.module.named_buffers():
            b.copy_(torch.arange(b.numel()).reshape(b.shape) * (r + 1) + 7 if b.dtype != torch.bool
                    else torch.tensor([r == 0, True, r == 1]))
    model(torch.randn(2, 3)).sum().backward()
    return {name: b.clone() for name, b in model.module.named_buffers()}, model.module.strided.stride()


@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_odd_buffers_arrive_whole_from_rank0(rung):
    res = launch(_job, 2, (rung,), timeout=60)
    (zero, stride0), (one, stride1) = res
    assert stride0 == stride1 == (1, 2)  # copied into the buffer itself, its layout kept
    for name, b in zero.items():
        assert torch.equal(one[name], b), (name, one[name], b)
        want = (torch.arange(b.numel()).reshape(b.shape) + 7).to(b.dtype) if b.dtype != torch.bool \
            else torch.tensor([True, True, False])
        assert torch.equal(b, want), (name, b, want)  # rank 0's values, not rank 1's
