"""Schedules as data: validity, correctness on symbols, round counts, bytes against the textbook, cost."""
import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from manualdp.runners.explain import trace
from manualdp.schedule import ALGORITHMS, Schedule, Transfer, chunk_bounds, chunk_sizes, get_schedule, ring
from manualdp.cost import check_schedule, cost, traffic
from manualdp.runners.grader.properties import schedule_property

NS = range(1, 9)
ALGS = sorted(ALGORITHMS)
settings_ = settings(deadline=None, max_examples=60)


def pow2_below(n):
    return 1 << (n.bit_length() - 1)


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("n", list(NS) + [13, 16])
def test_schedule_is_valid_and_sums_every_contribution_once(algorithm, n):
    # The property `manualdp check schedule` grades a student's schedule with.
    schedule = schedule_property(lambda n: get_schedule(algorithm, n), n)
    assert schedule.num_devices == n and len(schedule.phases) == len(schedule.rounds)


def test_trace_catches_a_schedule_that_stops_early():
    full = ring(4)
    cut = Schedule("ring", 4, 4, full.rounds[:-1], full.phases[:-1])
    check_schedule(cut)  # still valid transfer by transfer ...
    final = trace(cut)[-1]
    assert any(final[d][c] != Counter(range(4)) for d in range(4) for c in range(4))  # ... but not an allreduce
    with pytest.raises(AssertionError, match=r"schedule\(4\): after its 5 rounds, device 0 holds .* it misses device"):
        schedule_property(lambda n: cut, 4)


@pytest.mark.parametrize("n", NS)
def test_round_counts(n):
    p = pow2_below(n)
    assert len(get_schedule("naive", n).rounds) == (2 if n > 1 else 0)
    assert len(get_schedule("ring", n).rounds) == 2 * (n - 1)
    assert len(get_schedule("halving_doubling", n).rounds) == 2 * int(math.log2(p)) + (2 if n != p else 0)
    phases = get_schedule("ring", n).phases
    assert phases == ("reduce-scatter",) * (n - 1) + ("all-gather",) * (n - 1)


@settings_
@given(numel=st.integers(0, 10**5), k=st.integers(1, 16))
def test_chunks_are_near_equal_and_cover_the_buffer(numel, k):
    sizes = chunk_sizes(numel, k)
    assert len(sizes) == k and sum(sizes) == numel and max(sizes) - min(sizes) <= 1
    bounds = chunk_bounds(numel, k)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


@settings_
@given(n=st.sampled_from(NS), numel=st.integers(0, 10**5), element_size=st.sampled_from([1, 4, 8]))
def test_naive_traffic_is_the_textbook(n, numel, element_size):
    S = numel * element_size
    t = traffic(get_schedule("naive", n), S, element_size)
    assert t["sent"][0] == t["received"][0] == t["reduced"][0] == (n - 1) * S
    for d in range(1, n):
        assert t["sent"][d] == t["received"][d] == S and t["reduced"][d] == 0


@settings_
@given(n=st.sampled_from(NS), numel=st.integers(0, 10**5), element_size=st.sampled_from([1, 4, 8]))
def test_ring_traffic_is_the_textbook_up_to_chunk_rounding(n, numel, element_size):
    S = numel * element_size
    t = traffic(get_schedule("ring", n), S, element_size)
    # Each device sends 2(n-1) chunks, each within one element of S/n.
    slack = 2 * (n - 1) * element_size
    for d in range(n):
        assert abs(t["sent"][d] - 2 * (n - 1) * S / n) <= slack
        assert abs(t["received"][d] - 2 * (n - 1) * S / n) <= slack
        assert abs(t["reduced"][d] - (n - 1) * S / n) <= slack
    # Every round moves each chunk exactly once, so the total is exact.
    assert sum(t["sent"]) == sum(t["received"]) == 2 * (n - 1) * S
    if numel % n == 0:
        assert t["sent"] == [2 * (n - 1) * S // n] * n


@settings_
@given(n=st.sampled_from(NS), numel=st.integers(0, 10**5), element_size=st.sampled_from([1, 4, 8]))
def test_halving_doubling_traffic_is_its_docstring_formula(n, numel, element_size):
    S = numel * element_size
    p = pow2_below(n)
    r = n - p
    t = traffic(get_schedule("halving_doubling", n), S, element_size)
    halving = 2 * (p - 1) * S / p
    slack = 2 * (p - 1) * element_size  # 2(p-1) chunks, each within one element of S/p
    for d in range(n):
        expected = S if d >= p else halving + (S if d < r else 0)
        assert abs(t["sent"][d] - expected) <= slack
        assert abs(t["received"][d] - expected) <= slack
    for d in range(p, n):  # extra devices send and receive their whole buffer, exactly
        assert t["sent"][d] == t["received"][d] == S and t["reduced"][d] == 0
    assert sum(t["sent"]) == sum(t["received"]) == 2 * (p - 1) * S + 2 * r * S


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("n", NS)
def test_alpha_only_cost_counts_messages(algorithm, n):
    # Every device sends at most one message per round and receives at most one, except in naive
    # where device 0 receives n-1, then sends n-1: so the busiest device handles this many.
    expected = 2 * (n - 1) if algorithm == "naive" else len(get_schedule(algorithm, n).rounds)
    assert cost(get_schedule(algorithm, n), 4096, alpha=1e-6, beta=0, gamma=0) == pytest.approx(1e-6 * expected)


@settings_
@given(algorithm=st.sampled_from(ALGS), n=st.sampled_from(NS), units=st.integers(0, 1000), factor=st.integers(2, 5))
def test_beta_and_gamma_cost_scale_linearly_with_size(algorithm, n, units, factor):
    schedule = get_schedule(algorithm, n)
    S = units * schedule.num_chunks  # divisible: no rounding, so exactly linear
    for beta, gamma in ((1e-9, 0), (0, 1e-9), (1e-9, 3e-10)):
        assert cost(schedule, factor * S, 0, beta, gamma) == pytest.approx(factor * cost(schedule, S, 0, beta, gamma))


@pytest.mark.parametrize("n", NS)
def test_beta_only_cost_matches_the_textbook(n):
    S = 840 * 8  # divisible by every n and p up to 8
    p = pow2_below(n)
    beta = 1e-9
    assert cost(get_schedule("naive", n), S, 0, beta, 0) == pytest.approx(beta * 2 * (n - 1) * S)
    assert cost(get_schedule("ring", n), S, 0, beta, 0) == pytest.approx(beta * 2 * (n - 1) * S / n)
    assert cost(get_schedule("ring", n), S, 0, 0, beta) == pytest.approx(beta * (n - 1) * S / n)
    folds = 2 * S if n != p else 0
    assert cost(get_schedule("halving_doubling", n), S, 0, beta, 0) == pytest.approx(
        beta * (2 * (p - 1) * S / p + folds))


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "1"])
def test_cost_rejects_bad_coefficients(bad):
    for name in ("alpha", "beta", "gamma"):
        kwargs = {"alpha": 0.0, "beta": 0.0, "gamma": 0.0, name: bad}
        with pytest.raises(ValueError, match=name):
            cost(ring(4), 1024, **kwargs)


def test_traffic_rejects_bad_sizes():
    with pytest.raises(ValueError, match="nbytes"):
        traffic(ring(4), -4)
    with pytest.raises(ValueError, match="element_size"):
        traffic(ring(4), 10, element_size=4)
    with pytest.raises(ValueError, match="element_size"):
        traffic(ring(4), 8, element_size=0)


@pytest.mark.parametrize("rnd, match", [
    ((Transfer(0, 1, 0, False), Transfer(1, 0, 0, True)), "sends a chunk that it overwrites"),
    ((Transfer(0, 1, 1, True), Transfer(2, 0, 1, False)), "sends a chunk that it overwrites"),
    ((Transfer(0, 0, 0, True),), "bad transfer"),
    ((Transfer(0, 3, 0, True),), "bad transfer"),
    ((Transfer(0, 1, 5, True),), "bad transfer"),
    ((Transfer(0, 2, 0, False), Transfer(1, 2, 0, True)), "overwritten"),
    ((Transfer(1, 2, 0, True), Transfer(0, 2, 0, False)), "overwritten"),
])
def test_check_schedule_rejects_unsafe_rounds(rnd, match):
    with pytest.raises(ValueError, match=match):
        check_schedule(Schedule("bad", 3, 2, (rnd,), ("x",)))


def test_partners_may_swap_a_chunk_and_both_add():
    """Recursive doubling's round: each sends what it held when the round began, then adds."""
    check_schedule(Schedule("swap", 2, 1, ((Transfer(0, 1, 0, True), Transfer(1, 0, 0, True)),), ("x",)))


def test_several_adds_into_one_chunk_are_allowed():
    check_schedule(Schedule("gather", 3, 1, ((Transfer(1, 0, 0, True), Transfer(2, 0, 0, True)),), ("reduce",)))


@pytest.mark.parametrize("algorithm, n, match", [
    ("butterfly", 4, "algorithm"), (["ring"], 4, "algorithm"),
    ("ring", 0, "n"), ("ring", True, "n"), ("ring", 2.0, "n"),
])
def test_get_schedule_rejects_bad_input(algorithm, n, match):
    with pytest.raises(ValueError, match=match):
        get_schedule(algorithm, n)
