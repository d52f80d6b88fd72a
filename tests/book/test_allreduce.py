"""The single-controller allreduce: every device ends with the sum, bitwise identical; bad input is refused."""
import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from manualdp.allreduce import allreduce
from manualdp.schedule import ALGORITHMS
from manualdp.allreduce import run_schedule
from manualdp.runners.grader.properties import STRATEGIES, allreduce_property, make_tensors
from manualdp.schedule import ring

ALGS = sorted(ALGORITHMS)


@settings(deadline=None, max_examples=80)
@given(algorithm=st.sampled_from(ALGS), **STRATEGIES["allreduce"])
def test_every_device_holds_the_sum(algorithm, n, shape, dtype, seed, transpose, wide):
    # The property `manualdp check allreduce` grades a student's allreduce with: every tensor the
    # caller holds ends with the sum, bitwise identical; any shape, non-contiguous views too.
    allreduce_property(functools.partial(allreduce, algorithm=algorithm), n, shape, dtype, seed, transpose, wide)


def test_sum_order_does_not_break_bitwise_identity():
    # Values of very different magnitudes make float addition order-dependent; the devices must agree anyway.
    for algorithm in ALGS:
        tensors = [torch.tensor([1e16, 1.0, -1e16, 3.0] * 5, dtype=torch.float64) * (i + 1) for i in range(7)]
        allreduce(tensors, algorithm)
        assert all(torch.equal(t, tensors[0]) for t in tensors)


def rebinding_naive(data):
    """The classic bug: sums into device 0, then rebinds the list slots instead of writing in place."""
    for i in range(1, len(data)):
        data[0].add_(data[i])
    for i in range(1, len(data)):
        data[i] = data[0].clone()


def test_the_check_catches_the_rebinding_bug():
    with pytest.raises(AssertionError, match=r"device 1 holds .*new tensor into the list"):
        allreduce_property(rebinding_naive, 4, (10,), torch.float32, 0)
    # The buggy variant does fill the list it was given: only a check of the caller's tensors sees the bug.
    data = make_tensors(4, (10,), torch.float32, 0)
    expected = torch.stack(data).sum(0)
    rebinding_naive(data)
    assert all(torch.equal(t, expected) for t in data)
    for algorithm in ALGS:
        allreduce_property(functools.partial(allreduce, algorithm=algorithm), 4, (10,), torch.float32, 0)


def test_parameters_gradients_are_reduced_in_place():
    grads = [torch.nn.Parameter(torch.full((3,), float(i))) for i in range(3)]
    allreduce(grads, "ring")
    assert all(torch.equal(g.detach(), torch.full((3,), 3.0)) for g in grads)


def bad_inputs():
    """(name, tensors, algorithm, error type, message pattern); the tensors are checked unchanged afterwards."""
    a, b = torch.arange(6.0), torch.arange(6.0) + 10
    base = torch.arange(12.0)
    shared = np.arange(8, dtype=np.float32)
    return [
        ("empty list", [], "naive", ValueError, "must not be empty"),
        ("a tensor, not a list", a, "naive", TypeError, "list of tensors"),
        ("not a tensor", [a, [1.0] * 6], "naive", TypeError, r"tensors\[1\]"),
        ("shapes", [a, torch.zeros(2, 3)], "ring", ValueError, r"tensors\[1\] has shape"),
        ("dtypes", [a, torch.zeros(6, dtype=torch.float64)], "ring", TypeError, r"tensors\[1\] has dtype"),
        ("bool", [torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.bool)], "naive", TypeError, "bool"),
        ("complex", [torch.ones(3, dtype=torch.complex64), torch.ones(3, dtype=torch.complex64)], "naive", TypeError,
         "complex"),
        ("same tensor twice", [a, b, a], "naive", ValueError, r"tensors\[2\] and tensors\[0\] share memory"),
        ("overlapping views", [base[0:6], base[4:10]], "ring", ValueError, "share memory"),
        ("a view of another", [base.view(3, 4)[1], base[4:8]], "tree", ValueError, "share memory"),
        ("two storages, one memory", [torch.from_numpy(shared[0:4]), torch.from_numpy(shared[2:6])], "ring", ValueError,
         "share memory"),
        ("expanded", [torch.ones(4), torch.zeros(1).expand(4)], "ring", ValueError, "stride 0"),
        ("unknown algorithm", [a, b], "butterfly", ValueError, "butterfly"),
        ("algorithm not a string", [a, b], ["ring"], ValueError, "algorithm"),
    ]


@pytest.mark.parametrize("name, tensors, algorithm, error, match", bad_inputs(), ids=[case[0] for case in bad_inputs()])
def test_bad_input_is_refused_and_leaves_tensors_unchanged(name, tensors, algorithm, error, match):
    held = [t for t in (tensors if isinstance(tensors, list) else [tensors]) if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in held]
    with pytest.raises(error, match=match):
        allreduce(tensors, algorithm)
    for t, t0 in zip(held, before):
        assert torch.equal(t, t0), f"{name}: a tensor changed before the error"


def test_disjoint_views_of_one_buffer_are_allowed():
    base = torch.arange(12.0)
    views = [base[0:4], base[4:8], base[8:12]]
    expected = torch.stack([v.clone() for v in views]).sum(0)
    allreduce(views, "ring")
    assert all(torch.equal(v, expected) for v in views)



# ---------------------------------------------------------------- edge cases found in review

def test_sparse_gradients_get_a_clear_error():
    t = [torch.zeros(4).to_sparse(), torch.zeros(4).to_sparse()]
    with pytest.raises(TypeError, match="dense tensors only"):
        allreduce(t)


def test_run_schedule_validates_its_tensors():
    tensors = [torch.ones(4), torch.ones(6)]
    with pytest.raises(ValueError, match=r"tensors\[1\] has shape \(6,\)"):
        run_schedule(ring(2), tensors)
    assert torch.equal(tensors[0], torch.ones(4))


def test_run_schedule_refuses_a_schedule_whose_result_would_depend_on_the_order_of_a_rounds_transfers():
    from manualdp.transfers import Schedule, Transfer

    # Device 1 overwrites chunk 0 with device 0's while sending its own to device 0: applied in one order device 0
    # gets 1 + 1, in the other 1 + 2. Transfers of a round happen at once; this round cannot.
    clash = Schedule("clash", 2, 1, ((Transfer(0, 1, 0, False), Transfer(1, 0, 0, True)),), ("x",))
    tensors = [torch.ones(3), torch.full((3,), 2.0)]
    with pytest.raises(ValueError, match="schedule 'clash' cannot run: round 1: a device sends a chunk that it overwr"):
        run_schedule(clash, tensors)
    assert torch.equal(tensors[0], torch.ones(3)) and torch.equal(tensors[1], torch.full((3,), 2.0))
    swap = Schedule("swap", 2, 1, ((Transfer(0, 1, 0, True), Transfer(1, 0, 0, True)),), ("x",))
    run_schedule(swap, tensors)  # both add what the other held when the round began
    assert all(torch.equal(t, torch.full((3,), 3.0)) for t in tensors)


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("n", [3, 4, 5])
def test_execute_refuses_bool_where_its_schedule_adds_and_leaves_the_tensors_alone(algorithm, n):
    """`execute(recursive_doubling(5), five True tensors)` gave True where the sum is 5 (allreduce refuses bool)."""
    from manualdp.allreduce import execute
    from manualdp.schedule import get_collective, get_schedule
    tensors = [torch.tensor([True, False]) for _ in range(n)]
    with pytest.raises(TypeError, match=r"tensors\[0\] has dtype torch.bool; allreduce sums real numbers"):
        execute(get_schedule(algorithm, n), tensors)
    assert all(t.tolist() == [True, False] for t in tensors)
    copies = [torch.tensor([i == 0, True, i == 2]) for i in range(n)]  # a schedule that only copies takes bool
    execute(get_collective("broadcast", "tree", n), copies)
    assert all(t.tolist() == [True, True, False] for t in copies)


@pytest.mark.parametrize("given", [0, 3, 5])
def test_execute_refuses_another_number_of_tensors_than_its_schedule_has_devices(given):
    """3 tensors for recursive_doubling(4) raised an IndexError."""
    from manualdp.allreduce import execute
    from manualdp.schedule import recursive_doubling
    tensors = [torch.full((4,), float(i)) for i in range(given)]
    with pytest.raises(ValueError, match=rf"schedule 'recursive_doubling' is for 4 devices, got {given} tensors"):
        execute(recursive_doubling(4), tensors)
    assert all(torch.equal(t, torch.full((4,), float(i))) for i, t in enumerate(tensors))


@pytest.mark.parametrize("n", [2, 4, 6])
def test_recursive_doubling_allocates_no_copy_of_the_buffer(n):
    """Each round cloned every device's whole buffer (4x its cost model at 64 MiB); a swap adds, then copies back."""
    from torch.profiler import ProfilerActivity, profile
    tensors = [torch.randn(1 << 14, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    expected = functools.reduce(torch.add, tensors)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        allreduce(tensors, "recursive_doubling")
    allocated = sum(max(e.cpu_memory_usage, 0) for e in prof.events())
    assert allocated < tensors[0].nbytes, f"{allocated} bytes allocated for buffers of {tensors[0].nbytes}"
    assert all(torch.equal(t, tensors[0]) for t in tensors)
    torch.testing.assert_close(tensors[0], expected)


def test_a_chunk_sent_to_two_devices_and_added_into_is_sent_as_it_was_when_the_round_began():
    from manualdp.transfers import Schedule, Transfer

    # Devices 0 and 1 swap and add, and device 0 also sends its chunk to device 2: not a plain swap, so
    # device 2 must get 1 (what device 0 held when the round began), not the sum 3.
    mixed = Schedule("mixed", 3, 1, ((Transfer(0, 1, 0, True), Transfer(1, 0, 0, True), Transfer(0, 2, 0, False)),),
                     ("x",))
    tensors = [torch.ones(3), torch.full((3,), 2.0), torch.zeros(3)]
    run_schedule(mixed, tensors)
    assert [t.tolist() for t in tensors] == [[3.0] * 3, [3.0] * 3, [1.0] * 3]
    cycle = Schedule("cycle", 3, 1, (tuple(Transfer(i, (i + 1) % 3, 0, True) for i in range(3)),), ("x",))
    tensors = [torch.full((2,), float(1 << i)) for i in range(3)]
    run_schedule(cycle, tensors)
    assert [t.tolist() for t in tensors] == [[5.0] * 2, [3.0] * 2, [6.0] * 2]
