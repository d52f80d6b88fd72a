"""Replicas that drift apart raise on every rank naming the first parameter that differs (torch's DDP and ZeRO go
on silently): one rank loads other weights between steps; a parameter unfrozen after wrapping is never averaged;
ZeRO over ranks of which one loads other weights after construction (built from other seeds, the ranks start from rank
0's model, as DDP copies it). `drift_check_every=0` turns the check off.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from manualdp.distributed import DistributedDataParallel, ZeroRedundancyOptimizer
from manualdp.spmd import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP, launch
from manualdp.spmd.ladder.drift import DRIFT_CHECK_EVERY, DriftCheck, check_replicas, digests
from tests.helpers import error_of

WRAPPERS = {"NaiveDDP": NaiveDDP, "FlatDDP": FlatDDP, "OverlappedDDP": OverlappedDDP, "BucketedDDP": BucketedDDP,
            "DistributedDataParallel": functools.partial(DistributedDataParallel, algorithm="ring")}


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def _train(model, x, steps, between=None):
    """`steps` steps of SGD on `model`; `between(step)` runs before each step's forward; returns the error or None."""
    opt = torch.optim.SGD([p for p in model.parameters()], lr=0.1)

    def run():
        for step in range(steps):
            if between is not None:
                between(step)
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    return error_of(run)


def _job():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, make in WRAPPERS.items():
        model = make(_net(), timeout=20, drift_check_every=1)
        other = _net(seed=7).state_dict()

        def load(step, model=model, other=other):
            if step == 2 and rank == 1:  # between steps 1 and 2, rank 1 alone loads other weights
                model.module.load_state_dict(other)
        out[name, "loaded"] = _train(model, x, 4, load)
        net = _net()
        net[0].weight.requires_grad_(False)
        model = make(net, timeout=20, drift_check_every=2)
        net[0].weight.requires_grad_(True)  # unfrozen after wrapping: no wrapper averages it
        out[name, "unfrozen"] = _train(model, x, 4)
        del model
        model = make(_net(), timeout=20, drift_check_every=0)
        out[name, "off"] = _train(model, x, 4, functools.partial(load, model=model))
    for every in (None, 0):  # ZeRO over models built from other seeds: rank 0's is copied at construction, as DDP's
        net = _net(seed=rank)
        kwargs = {} if every is None else {"drift_check_every": every}
        opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1, timeout=20, **kwargs)
        out["zero start", every] = [p.detach().clone() for p in net.parameters()]
        net(x).pow(2).sum().backward()
        out["zero", every] = error_of(opt.step)
    net = _net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1, timeout=20)
    if rank == 1:  # after construction, rank 1 alone loads other weights: the default checks at the first step
        net.load_state_dict(_net(seed=7).state_dict())
    net(x).pow(2).sum().backward()
    out["zero loaded"] = error_of(opt.step)
    return out


def _raised(message, rank, who, step, name):
    assert message is not None, (who, rank)
    head = f"RuntimeError: rank {rank}: {who}'s replica at step {step} differs across ranks: parameter {name} "
    assert message.startswith(head), (head, message)
    assert "drift_check_every=0 turns this check off" in message, message


def test_replicas_that_drift_apart_raise_on_every_rank_naming_the_first_parameter_that_differs():
    results = launch(_job, 2, timeout=240)
    for rank, out in enumerate(results):
        for who in WRAPPERS:
            _raised(out[who, "loaded"], rank, who, 2, "0.weight")  # checked at every step: the step after the load
            _raised(out[who, "unfrozen"], rank, who, 1, "0.weight")  # every 2 steps: 0, 1, then 2
            assert out[who, "off"] is None, (who, rank, out[who, "off"])
        _raised(out["zero loaded"], rank, "ZeroRedundancyOptimizer", 0, "0")
        for every in (None, 0):
            assert out["zero", every] is None, (rank, out["zero", every])
            for got, want in zip(out["zero start", every], _net(seed=0).parameters()):
                assert torch.equal(got, want.detach()), (rank, every)


def _permuted_job():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    out = {}
    for name in ("FlatDDP", "DistributedDataParallel"):
        net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        net[0].weight.requires_grad_(False)  # frozen: no step would ever bring the ranks' copies together
        model = WRAPPERS[name](net, timeout=20, drift_check_every=1)

        def transpose(step, net=net):
            if step == 0 and rank == 1:  # loaded transposed: the same elements, in another order
                with torch.no_grad():
                    net[0].weight.copy_(net[0].weight.t().clone())
        out[name, "transposed"] = _train(model, x, 2, transpose)
        net = _net()
        model = WRAPPERS[name](net, timeout=20, drift_check_every=1)

        def last(step, net=net):
            if step == 0 and rank == 1:  # the last element of the last parameter
                with torch.no_grad():
                    net[2].bias.view(-1)[-1] = torch.nextafter(net[2].bias[-1], net[2].bias[-1] + 1)
        out[name, "last"] = _train(model, x, 2, last)
    return out


def test_a_permuted_parameter_or_a_changed_last_element_is_caught_at_the_first_check():
    for rank, out in enumerate(launch(_permuted_job, 2, timeout=240)):
        for who in ("FlatDDP", "DistributedDataParallel"):
            _raised(out[who, "transposed"], rank, who, 0, "0.weight")
            _raised(out[who, "last"], rank, who, 0, "2.bias")


def test_a_digest_changes_with_the_order_of_the_elements_and_with_the_last_one():
    torch.manual_seed(0)
    square, long = torch.randn(5, 5), torch.randn(3 * 1024 * 1024 + 7)  # over three chunks of weights
    assert digests([("w", square)]) != digests([("w", square.t())])
    swapped = long.clone()
    swapped[[1, 1024 * 1024 + 1]] = swapped[[1024 * 1024 + 1, 1]]  # the same place in two chunks
    assert digests([("w", long)]) != digests([("w", swapped)])
    for t in (square, long):
        changed = t.clone()
        changed.view(-1)[-1] = torch.nextafter(changed.view(-1)[-1], changed.view(-1)[-1] + 1)
        assert digests([("a", t), ("w", t)])["w"] != digests([("a", t), ("w", changed)])["w"]


def test_a_digest_changes_with_one_bit_of_any_dtype_or_layout():
    tensors = {"f32": torch.randn(3, 4), "f16": torch.randn(5).half(), "f64": torch.randn(2, 3).double().t(),
               "c64": torch.randn(3, dtype=torch.complex64), "empty": torch.zeros(0), "int": torch.arange(6)}
    before = digests(tensors.items())
    assert before == digests((k, v.clone()) for k, v in tensors.items())  # equal values, equal digests
    for name, t in tensors.items():
        if t.numel() == 0:
            continue
        changed = t.clone()
        flat = changed.view(-1) if changed.is_contiguous() else changed.t().reshape(-1)
        if changed.is_complex():
            flat = torch.view_as_real(changed).view(-1)
        flat[0] = torch.nextafter(flat[0], flat[0] + 1) if flat.is_floating_point() else flat[0] + 1
        if not changed.is_contiguous():
            changed = flat.view(changed.t().shape).t()
        assert digests([(name, changed)])[name] != before[name], name


def _negative_pair() -> list[torch.Tensor]:
    """Two one-element int8 tensors whose digests are negative, the first's shorter as text than the second's."""
    by_length = {}
    for k in range(-128, 128):
        t = torch.tensor([k], dtype=torch.int8)
        digest = digests([("w", t)])["w"]
        if digest < 0:
            by_length.setdefault(len(str(digest)), t)
    lengths = sorted(by_length)
    assert len(lengths) > 1, by_length  # the digests of 256 values spread over more than one length
    return [by_length[lengths[0]], by_length[lengths[-1]]]


NEGATIVE = _negative_pair()  # each rank's weight: its digest is negative


def _negative_job():
    torch.set_num_threads(1)
    return error_of(lambda: check_replicas([("w", NEGATIVE[dist.get_rank()])], who="W", step=0, timeout=20))


def test_the_drift_message_orders_negative_digests_numerically():
    low, high = sorted(digests([("w", t)])["w"] for t in NEGATIVE)  # the expectation: numbers, not strings
    assert low < high < 0 and len(str(low)) > len(str(high))  # sorted as text (shorter first), the range reads back
    for rank, message in enumerate(launch(_negative_job, 2, timeout=120)):
        assert message is not None and f"parameter w {low}..{high} (per rank: {high}, {low})" in message, message


def test_the_check_is_on_by_default_and_refuses_a_bad_interval():
    assert DRIFT_CHECK_EVERY > 0
    assert DriftCheck(DRIFT_CHECK_EVERY).every == DRIFT_CHECK_EVERY
    for bad in (-1, 1.5, "10", None):
        with pytest.raises(ValueError, match="drift_check_every must be a non-negative int, got"):
            DriftCheck(bad)
