"""Reduce-scatter, all-gather, reduce, broadcast and the binomial tree: schedules, bytes, the single controller.

The byte formulas are written here from the textbook (nccl-tests' busbw factors: (n-1)/n for
reduce-scatter and all-gather, 1 for reduce and broadcast), not read back from the code.
"""
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from manualdp import collectives
from manualdp.runners.explain import explain, trace
from manualdp.cost import check_schedule, cost, traffic
from manualdp.schedule import COLLECTIVES, get_collective, owned_chunk
from tests.helpers import device_inputs

NS = range(1, 9)
PARTS = [(c, a) for c, algs in COLLECTIVES.items() if c != "allreduce" for a in algs]
settings_ = settings(deadline=None, max_examples=40)
DTYPES = [torch.float32, torch.float64, torch.int64]


def ceil_log2(n):
    return 0 if n == 1 else (n - 1).bit_length()


def children(v, n):
    """Children of device v in a binomial tree rooted at 0: v + 2**k for every 2**k below v's lowest set bit."""
    k, count = 1, 0
    while v + k < n and (v == 0 or k < (v & -v)):
        count += 1
        k *= 2
    return count


# ---------------------------------------------------------------- schedules on symbols

@pytest.mark.parametrize("collective, algorithm", PARTS)
@pytest.mark.parametrize("n", list(NS) + [13])
def test_each_collective_leaves_what_it_promises(collective, algorithm, n):
    for root in sorted({0, n // 2, n - 1}):
        schedule = get_collective(collective, algorithm, n, root)
        check_schedule(schedule)
        final = trace(schedule)[-1]
        everyone = Counter(range(n))
        if collective == "reduce_scatter":
            assert all(final[d][owned_chunk(d, n)] == everyone for d in range(n))
        elif collective == "all_gather":
            owner = {owned_chunk(d, n): d for d in range(n)}
            assert all(final[d][c] == Counter({owner[c]: 1}) for d in range(n) for c in range(n))
        elif collective == "reduce":
            assert final[root][0] == everyone
        else:
            assert all(final[d][0] == Counter({root: 1}) for d in range(n))


@pytest.mark.parametrize("n", NS)
def test_round_counts(n):
    assert len(get_collective("reduce_scatter", "ring", n).rounds) == n - 1
    assert len(get_collective("all_gather", "ring", n).rounds) == n - 1
    assert len(get_collective("reduce", "tree", n).rounds) == ceil_log2(n)
    assert len(get_collective("broadcast", "tree", n).rounds) == ceil_log2(n)
    tree = get_collective("allreduce", "tree", n)
    assert tree.phases == ("reduce",) * ceil_log2(n) + ("broadcast",) * ceil_log2(n)


@pytest.mark.parametrize("n", NS)
def test_ring_allreduce_is_reduce_scatter_then_all_gather(n):
    rs, ag = get_collective("reduce_scatter", "ring", n), get_collective("all_gather", "ring", n)
    assert get_collective("allreduce", "ring", n).rounds == rs.rounds + ag.rounds


# ---------------------------------------------------------------- bytes and cost against the textbook

sizes = dict(n=st.sampled_from(NS), numel=st.integers(0, 10**5), element_size=st.sampled_from([1, 2, 4, 8]))


@settings_
@given(**sizes)
def test_reduce_scatter_and_all_gather_move_n_minus_1_over_n(n, numel, element_size):
    S = numel * element_size
    for collective in ("reduce_scatter", "all_gather"):
        t = traffic(get_collective(collective, "ring", n), S, element_size)
        for d in range(n):  # n-1 chunks, each within one element of S/n
            assert abs(t["sent"][d] - (n - 1) * S / n) <= (n - 1) * element_size
            assert abs(t["received"][d] - (n - 1) * S / n) <= (n - 1) * element_size
        assert sum(t["sent"]) == sum(t["received"]) == (n - 1) * S
        assert t["reduced"] == (t["received"] if collective == "reduce_scatter" else [0] * n)


@settings_
@given(root=st.integers(0, 7), **sizes)
def test_reduce_and_broadcast_move_S_per_device(n, numel, element_size, root):
    S, root = numel * element_size, root % n
    down = traffic(get_collective("broadcast", "tree", n, root), S, element_size)
    up = traffic(get_collective("reduce", "tree", n, root), S, element_size)
    for d in range(n):
        fan = children((d - root) % n, n)
        assert down["received"][d] == up["sent"][d] == (0 if d == root else S)
        assert down["sent"][d] == up["received"][d] == up["reduced"][d] == fan * S
    assert sum(down["sent"]) == sum(up["sent"]) == (n - 1) * S
    assert down["sent"][root] == ceil_log2(n) * S


@settings_
@given(**sizes)
def test_tree_allreduce_traffic(n, numel, element_size):
    S = numel * element_size
    t = traffic(get_collective("allreduce", "tree", n), S, element_size)
    for d in range(n):
        each_way = (d != 0) * S + children(d, n) * S
        assert t["sent"][d] == t["received"][d] == each_way
    assert sum(t["sent"]) == 2 * (n - 1) * S


@pytest.mark.parametrize("n", NS)
def test_cost_of_the_building_blocks(n):
    S, beta, alpha = 840 * 8, 1e-9, 1e-6  # S divisible by every n up to 8
    rs = get_collective("reduce_scatter", "ring", n)
    assert cost(rs, S, 0, beta, 0) == pytest.approx(beta * (n - 1) * S / n)
    assert cost(rs, S, 0, 0, beta) == pytest.approx(beta * (n - 1) * S / n)
    assert cost(get_collective("all_gather", "ring", n), S, 0, beta, 0) == pytest.approx(beta * (n - 1) * S / n)
    # A binomial tree moves the whole buffer in every round: log n rounds of S each way.
    assert cost(get_collective("broadcast", "tree", n), S, 0, beta, 0) == pytest.approx(beta * ceil_log2(n) * S)
    assert cost(get_collective("allreduce", "tree", n), S, 0, beta, 0) == pytest.approx(2 * beta * ceil_log2(n) * S)
    assert cost(get_collective("reduce", "tree", n), S, alpha, 0, 0) == pytest.approx(alpha * ceil_log2(n))


@pytest.mark.parametrize("collective, algorithm", PARTS)
def test_explain_prints_each_collective(collective, algorithm):
    text = explain(collective, 5, size_bytes=400, root=2)
    schedule = get_collective(collective, algorithm, 5, 2)
    assert text.startswith(f"{collective} ({algorithm}) on 5 devices: {len(schedule.rounds)} rounds")
    assert text.count("\nround ") == len(schedule.rounds)


@pytest.mark.parametrize("call, match", [
    (lambda: get_collective("scatter", "ring", 4), "collective"),
    (lambda: get_collective("reduce", "ring", 4), "algorithm"),
    (lambda: get_collective("broadcast", "tree", 4, root=4), "root"),
    (lambda: collectives.reduce([torch.ones(3)] * 1, root=-1), "root"),
    (lambda: collectives.all_gather([torch.ones(3), torch.ones(4)]), "shape"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ---------------------------------------------------------------- the single-controller executor

@settings_
@given(n=st.sampled_from(NS), numel=st.integers(0, 10**5), dtype=st.sampled_from(DTYPES), root=st.integers(0, 7))
def test_single_controller_collectives_compute_the_sum_or_copy(n, numel, dtype, root):
    root %= n
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=0, atol=1e-9)
    xs = device_inputs(n, numel, dtype)
    total = torch.stack(xs).sum(0)
    shards = collectives.reduce_scatter([x.clone() for x in xs])
    for d, s in enumerate(shards):
        torch.testing.assert_close(s, collectives.chunk(total, d, n), **tol)
    gathered = [x.clone() for x in xs]
    expected = torch.empty_like(total)
    for d in range(n):
        collectives.chunk(expected, d, n).copy_(collectives.chunk(xs[d], d, n))
    collectives.all_gather(gathered)
    assert all(torch.equal(g, expected) for g in gathered)
    reduced = [x.clone() for x in xs]
    collectives.reduce(reduced, root)
    torch.testing.assert_close(reduced[root], total, **tol)
    copies = [x.clone() for x in xs]
    collectives.broadcast(copies, root)
    assert all(torch.equal(c, xs[root]) for c in copies)
