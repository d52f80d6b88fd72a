"""The one digest by which the ranks compare a tensor (`ladder.drift.tensor_digest`): the drift check's per parameter
and a comm hook's bound tensors (`ddp/hook_identity.py`); equal exactly when the bits are, as far as 64 bits tell."""
import functools

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing._internal.two_tensor import TwoTensor

from manualdp.spmd.ddp.hook_identity import hook_identity
from manualdp.spmd.ladder.drift import _mix, digests, tensor_digest

MASK = (1 << 64) - 1


def _splitmix64(k: int) -> int:
    """splitmix64 of counter `k` in Python's integers (the reference), made odd, as a signed 64-bit value."""
    z = (k + 1) * 0x9E3779B97F4A7C15 & MASK
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & MASK
    z = (z ^ (z >> 31)) | 1
    return z - (1 << 64) if z >> 63 else z


def _bound(t: torch.Tensor) -> str:
    """What the ranks compare of a hook with `t` bound by `functools.partial`."""
    return hook_identity(functools.partial(_hook, scale=t))


def _hook(state, bucket, scale):
    return bucket


def test_the_weights_are_splitmix64_on_any_machine():
    ks = [0, 1, 2, 7, 1 << 20, (1 << 20) + 5, 2**40 + 3]
    assert _mix(torch.tensor(ks)).tolist() == [_splitmix64(k) for k in ks]


def test_small_changes_of_several_elements_do_not_cancel():
    # with the weights 1, 3, 5, ... these summed alike: 3 * 1 + 0 * 3 == 0 * 1 + 1 * 3
    assert tensor_digest(torch.tensor([3, 0])) != tensor_digest(torch.tensor([0, 1]))
    x = torch.randn(8)
    y = x.view(torch.int32).clone()
    y[0] += 3
    y[1] -= 1  # three ulps up at 0 and one down at 1: the same digest with weights 1, 3
    assert tensor_digest(x) != tensor_digest(y.view(torch.float32))


def test_two_sign_flips_of_64_bit_elements_do_not_cancel():
    # read as one int64, a flipped sign bit adds 2**63 times an odd weight, which is 2**63: two flips cancelled
    x = torch.randn(6, 2, dtype=torch.float64)
    assert tensor_digest(x) != tensor_digest(x * torch.tensor([1.0, -1.0], dtype=torch.float64))  # a column negated
    flipped = x.clone().view(torch.int64)
    flipped[0, 0] ^= 1 << 63
    flipped[3, 1] ^= 1 << 63
    assert tensor_digest(x) != tensor_digest(flipped.view(torch.float64))
    z = torch.randn(4, dtype=torch.complex128)
    negated = z.clone()
    negated[1] = -negated[1]
    assert tensor_digest(z) != tensor_digest(negated)


def test_a_quantized_tensor_is_digested_by_its_integers():
    x = torch.quantize_per_tensor(torch.tensor([0.5, -0.2, 1.0]), 0.1, 0, torch.qint8)
    y = torch.quantize_per_tensor(torch.tensor([0.5, -0.3, 1.0]), 0.1, 0, torch.qint8)
    assert tensor_digest(x) == tensor_digest(x.int_repr()) != tensor_digest(y)
    assert _bound(x) != _bound(y)


def test_a_hooks_bound_tensor_is_named_by_the_drift_checks_digest():
    t = torch.randn(3, 2)
    assert digests([("t", t)])["t"] == tensor_digest(t)
    assert f"scale=tensor(float32, [3, 2], digest {tensor_digest(t) & MASK:016x})" in _bound(t)


def test_tensors_without_bits_of_their_own_are_compared_by_dtype_and_shape():
    for t in (torch.zeros(2, 3, device="meta"), torch.eye(3).to_sparse(), TwoTensor(torch.ones(2), torch.ones(2))):
        assert f"scale=tensor(float32, {list(t.shape)}))" in _bound(t), t


_DTYPES = [torch.float32, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool, torch.complex64]


@given(st.sampled_from(_DTYPES), st.lists(st.integers(-3, 3), min_size=0, max_size=6),
       st.lists(st.integers(-3, 3), min_size=0, max_size=6), st.booleans())
def test_bound_tensors_name_alike_exactly_when_their_dtype_shape_and_bits_are_alike(dtype, a, b, transpose):
    def tensor(values: list) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.int64).to(dtype)
        return t.view(2, -1).t() if transpose and len(values) % 2 == 0 else t
    x, y = tensor(a), tensor(b)
    alike = x.shape == y.shape and torch.equal(_bits(x), _bits(y))
    assert (_bound(x) == _bound(y)) == alike, (x, y)


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    flat = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat
    return flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
