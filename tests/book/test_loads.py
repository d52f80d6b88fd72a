"""The standard allreduces' loads written down without their schedules: equal to the schedules', and fast at any
size."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from manualdp.cost import cost, round_loads
from manualdp.loads import allreduce_loads
from manualdp.schedule import ALGORITHMS, get_schedule
from manualdp.spmd.auto.tune import Link, choose, predict


@settings(max_examples=300, deadline=None)
@given(algorithm=st.sampled_from(sorted(ALGORITHMS)), n=st.integers(1, 40), numel=st.integers(0, 300),
       element_size=st.sampled_from([1, 2, 4, 8]), alpha=st.floats(0, 1e-3), beta=st.floats(0, 1e-8),
       gamma=st.floats(0, 1e-9), duplex=st.floats(0, 2), parallel=st.integers(0, 8),
       segment=st.none() | st.integers(1, 1 << 12))
def test_the_loads_without_the_schedule_are_the_schedules_loads(algorithm, n, numel, element_size, alpha, beta, gamma,
                                                                  duplex, parallel, segment):
    nbytes = numel * element_size
    schedule = get_schedule(algorithm, n)
    assert allreduce_loads(algorithm, n, nbytes, element_size) == round_loads(schedule, nbytes, element_size)
    link = Link(alpha, beta, gamma, duplex, parallel)
    assert predict(algorithm, n, nbytes, link, element_size, segment) == cost(
        schedule, nbytes, alpha, beta, gamma, element_size, duplex, parallel, segment)


def test_a_round_count_of_devices_and_rounds_adds_up():
    # 10 floats on a ring of 4: chunks of 3, 3, 2, 2 elements. Every round, the device that sends chunk 0
    # receives chunk 3; the one sending chunk 2 receives chunk 1; the others send and receive equal chunks.
    (rs, rs_rounds), (ag, ag_rounds) = allreduce_loads("ring", 4, 40, 4)
    assert rs_rounds == ag_rounds == 3
    assert rs == {(1, 1, 12, 8, 8): 1, (1, 1, 12, 12, 12): 1, (1, 1, 8, 12, 12): 1, (1, 1, 8, 8, 8): 1}
    assert ag == {(1, 1, 12, 8, 0): 1, (1, 1, 12, 12, 0): 1, (1, 1, 8, 12, 0): 1, (1, 1, 8, 8, 0): 1}


def test_100000_ranks_are_predicted_at_once_and_as_the_textbook_counts(deadline):
    n, alpha, beta = 100_000, 1e-5, 1e-9
    nbytes = n * 4 * 64  # 64 floats per chunk of a ring: its every rank moves 2(n-1)/n of the buffer
    with deadline(60):
        latency = {a: predict(a, n, nbytes, Link(alpha, 0.0, 0.0)) for a in ALGORITHMS}
        bandwidth = predict("ring", n, nbytes, Link(0.0, beta, 0.0), segment_bytes=None)
        pick = choose(n, nbytes, Link(alpha, 0.0, 0.0))
        rounds = {a: sum(r for _, r in allreduce_loads(a, n, nbytes, 4)) for a in ALGORITHMS}
    # naive: the root takes n-1 messages in, then sends n-1; ring: 2(n-1) rounds of one message each way;
    # tree: 2 ceil(log2 n) = 34 rounds; halving-doubling: 65536 ranks halve and double (2 * 16 rounds),
    # and the other 34464 fold in before and out after: 34 rounds, one message per rank in each; recursive doubling:
    # the same fold around 16 rounds of swaps, 18 rounds, the fewest.
    assert rounds == {"naive": 2, "ring": 2 * (n - 1), "tree": 34, "halving_doubling": 34, "recursive_doubling": 18}
    assert latency == pytest.approx({"naive": 2 * (n - 1) * alpha, "ring": 2 * (n - 1) * alpha, "tree": 34 * alpha,
                                     "halving_doubling": 34 * alpha, "recursive_doubling": 18 * alpha}, rel=1e-9)
    assert pick == "recursive_doubling"
    assert math.isclose(bandwidth, 2 * (n - 1) / n * nbytes * beta, rel_tol=1e-9)


def test_allreduce_loads_checks_its_input():
    with pytest.raises(ValueError, match="algorithm must be one of"):
        allreduce_loads("butterfly", 4, 16)
    with pytest.raises(ValueError, match="n must be a positive int, got 0"):
        allreduce_loads("ring", 0, 16)
    with pytest.raises(ValueError, match="nbytes=6 is not a multiple of element_size=4"):
        allreduce_loads("ring", 4, 6, 4)
    with pytest.raises(ValueError, match="nbytes must be a non-negative int, got -4"):
        predict("ring", 4, -4, Link(0.0, 0.0, 0.0))


def test_segments_are_counted_rounding_up():
    # naive on 2 devices, 6 bytes, 4-byte segments: dev0 receives 6 bytes in ceil(6/4) = 2 segments and adds
    # them, so adding 6 (gamma 1/byte) overlaps moving 6 (beta 1/byte) but for one segment's worth:
    # 6 + 6/2 = 9 s. Round 2, dev0 sends the sum back: 6 s, nothing added. 15 s in all (14 with 2-byte
    # segments, 18 with one segment: no overlap).
    schedule = get_schedule("naive", 2)
    assert cost(schedule, 6, alpha=0.0, beta=1.0, gamma=1.0, segment_bytes=4) == 15.0
    assert cost(schedule, 6, alpha=0.0, beta=1.0, gamma=1.0, segment_bytes=2) == 14.0
    assert cost(schedule, 6, alpha=0.0, beta=1.0, gamma=1.0, segment_bytes=6) == 18.0
    assert cost(schedule, 6, alpha=0.0, beta=1.0, gamma=1.0, segment_bytes=7) == 18.0
