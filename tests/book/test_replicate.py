import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

from manualdp import allreduce, broadcast, cpu_devices, replicate, replicate_params


def _pointers(module):
    return {p.untyped_storage().data_ptr() for p in list(module.parameters()) + list(module.buffers())}


@given(n=st.integers(1, 8))
def test_replicas_never_share_storage(n):
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    replicas = replicate(net, cpu_devices(n))
    seen = _pointers(net)
    for r in replicas:
        ptrs = _pointers(r)
        assert not ptrs & seen
        seen |= ptrs
        for a, b in zip(r.state_dict().values(), net.state_dict().values()):
            assert torch.equal(a, b)


def test_writing_one_replica_leaves_the_others_alone():
    replicas = replicate(nn.Linear(2, 2), cpu_devices(3))
    with torch.no_grad():
        replicas[1].weight.fill_(7.0)
    assert not torch.equal(replicas[0].weight, replicas[1].weight)
    assert not torch.equal(replicas[2].weight, replicas[1].weight)


def test_replicate_params_copies_and_requires_grad():
    params = [torch.randn(3, requires_grad=True), torch.randn(2, 2)]
    copies = replicate_params(params, "cpu")
    for p, c in zip(params, copies):
        assert torch.equal(p, c)
        assert c.requires_grad and c.is_leaf
        assert c.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()


def test_gradients_equal_across_replicas_after_allreduce():
    torch.manual_seed(0)
    replicas = replicate(nn.Linear(4, 3), cpu_devices(3))
    for i, r in enumerate(replicas):
        r(torch.randn(5, 4) * (i + 1)).sum().backward()
    expected = [sum(r.weight.grad for r in replicas).clone(), sum(r.bias.grad for r in replicas).clone()]
    for k, name in enumerate(["weight", "bias"]):
        allreduce([getattr(r, name).grad for r in replicas])
        for r in replicas:
            assert torch.equal(getattr(r, name).grad, getattr(replicas[0], name).grad)
        torch.testing.assert_close(getattr(replicas[0], name).grad, expected[k])


def test_broadcast_writes_in_place():
    tensors = [torch.full((3,), float(i)) for i in range(4)]
    originals = list(tensors)
    broadcast(tensors, src=2)
    for t, o in zip(tensors, originals):
        assert t is o and torch.equal(t, torch.full((3,), 2.0))


@pytest.mark.parametrize("bad, error, match", [
    ("not a module", TypeError, "module must be an nn.Module, got str"),
])
def test_replicate_bad_module(bad, error, match):
    with pytest.raises(error, match=match):
        replicate(bad, cpu_devices(2))


def test_replicate_params_bad_input():
    with pytest.raises(TypeError, match=r"params\[1\] must be a torch.Tensor"):
        replicate_params([torch.zeros(1), 3.0], "cpu")
    with pytest.raises(ValueError, match="src must index tensors"):
        broadcast([torch.zeros(1)], src=3)



# ---------------------------------------------------------------- edge cases found in review

@pytest.mark.parametrize("device, match", [("cuda:0", "GPU"), ("meta", "'meta'")])
def test_devices_that_do_not_exist_are_refused(device, match):
    if device.startswith("cuda") and torch.cuda.is_available():
        device = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=match):
        replicate(nn.Linear(2, 2), ["cpu", device])


def test_broadcast_checks_shapes_before_writing():
    tensors = [torch.ones(3), torch.zeros(3), torch.zeros(4)]
    with pytest.raises(ValueError, match=r"tensors\[2\] has shape \(4,\)"):
        broadcast(tensors)
    assert torch.equal(tensors[1], torch.zeros(3))
    with pytest.raises(ValueError, match="src must index tensors"):
        broadcast(tensors[:2], src=True)
