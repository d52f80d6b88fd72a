"""A schedule's plan for one rank: its messages match the other ranks' and compute the single controller's sum;
a swap adds each segment once its own send has gone, and planning stays linear in the segments."""
import torch
from hypothesis import given, strategies as st

from manualdp.allreduce import run_schedule
from manualdp.distributed import plan
from manualdp.schedule import ALGORITHMS, get_schedule


@given(algorithm=st.sampled_from(sorted(ALGORITHMS)), n=st.integers(1, 9), numel=st.integers(0, 60),
       segment=st.integers(1, 8))
def test_plan_messages_match_and_compute_the_single_controller_sum(algorithm, n, numel, segment):
    schedule = get_schedule(algorithm, n)
    plans = [plan(schedule, r, numel, segment) for r in range(n)]
    g = torch.Generator().manual_seed(numel)
    inputs = [torch.randn(numel, generator=g, dtype=torch.float64) for _ in range(n)]
    flats = [x.clone() for x in inputs]
    for rnd in range(len(schedule.rounds)):
        sent = {}  # (src, dst) -> the slices src sends, in order
        for r in range(n):
            for m in plans[r][rnd].sends:
                assert 0 < m.hi - m.lo <= segment
                sent.setdefault((r, m.peer), []).append((m.lo, m.hi, flats[r][m.lo:m.hi].clone()))
        for r in range(n):
            assert plans[r][rnd].scratch == sum(m.hi - m.lo for m in plans[r][rnd].recvs if m.reduce)
            here = plans[r][rnd]  # what a rank receives and also sends in a round (partners swap) is added only
            for k, m in enumerate(here.recvs):  # once every send of it has gone: they are among the first sends_before
                overlapping = [j for j, x in enumerate(here.sends) if m.lo < x.hi and x.lo < m.hi]
                if overlapping:
                    assert m.reduce and here.sends_before[k] > max(overlapping), (algorithm, n, r, rnd, m)
            for m in plans[r][rnd].recvs:
                lo, hi, data = sent[(m.peer, r)].pop(0)  # FIFO per direction, as isend/irecv match
                assert (lo, hi) == (m.lo, m.hi)
                if m.reduce:
                    flats[r][lo:hi].add_(data)
                else:
                    flats[r][lo:hi].copy_(data)
        assert all(not rest for rest in sent.values()), "a send without its receive"
    expected = [x.clone() for x in inputs]
    run_schedule(schedule, expected)
    for got, want in zip(flats, expected):
        assert torch.equal(got, want)


def test_a_swap_adds_each_segment_once_its_own_send_has_gone_and_plan_stays_linear_in_segments(deadline):
    # Recursive doubling at two ranks, 8 elements in segments of 2: segment k is added once sends 0..k have gone,
    # while the later ones are still going out.
    (swap,) = plan(get_schedule("recursive_doubling", 2), 0, 8, 2)
    assert [(m.lo, m.hi) for m in swap.sends] == [(m.lo, m.hi) for m in swap.recvs] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert swap.sends_before == (1, 2, 3, 4)
    assert all(r.sends_before == () for r in plan(get_schedule("ring", 2), 0, 8, 2))  # nothing sent is received
    with deadline(30):  # one-element segments: comparing every pair of them took 87 s for the ring of four
        for algorithm in ("ring", "recursive_doubling"):
            plan(get_schedule(algorithm, 4), 0, 1 << 16, 1)
