"""auto on a noisy host: a duplex that carries its spread, a pick that holds within it, and drift."""
import os
import random

import pytest
import torch
import torch.distributed as dist

from manualdp.schedule import ALGORITHMS
from manualdp.spmd import launch
from manualdp.cost import MAX_DUPLEX
from manualdp.spmd.auto.pick import Link, choose, predict
from manualdp.spmd.auto.tune import DRIFT_CALLS, LARGE_BYTES, LARGE_REPEATS, duplex_of, fit_duplex, measure_on, moved

HOST = (5e-5, 2.5e-10, 3e-11)  # alpha, beta, gamma as two ranks on this project's 2-core host measure them
SIZES = [(64 << 10) << 2 * k for k in range(6)]  # 64 KiB to 64 MiB


def _calibrate(rng: random.Random, duplex: float, noise: float) -> tuple[float, float, int]:
    """A synthetic calibration on a link of `duplex`: batches of ring/naive timings off by `noise` (relative)."""
    link = Link(*HOST)
    ratio = predict("ring", 2, LARGE_BYTES, Link(*HOST, duplex)) / predict("naive", 2, LARGE_BYTES, link)
    readings = []
    while not readings or measure_on(duplex_of(readings)[1], len(readings)):
        readings += [fit_duplex(link, LARGE_BYTES, ratio * rng.lognormvariate(0, noise)) for _ in range(LARGE_REPEATS)]
    return *duplex_of(readings), len(readings)


def _loses(link: Link, duplex: float) -> list[int]:
    """The sizes where auto's pick with `link` takes more than 5% longer than the fastest, on a link of `duplex`."""
    true = Link(*HOST, duplex)
    out = []
    for size in SIZES:
        times = {a: predict(a, 2, size, true) for a in ALGORITHMS}
        if times[choose(2, size, link)] > 1.05 * min(times.values()):
            out.append(size)
    return out


@pytest.mark.parametrize("low, high, noise", [(0.5, 1.5, 0.2), (0.8, 1.6, 0.2), (0.0, 2.0, 0.2), (0.0, 2.0, 0.05)])
def test_on_forty_fresh_calibrations_auto_is_within_5_percent_of_the_fastest_at_every_size(low, high, noise):
    # noise 0.2: a pair's ring/naive ratio off by 20%, as same-schedule timings on a busy 2-core host differ.
    # One batch of readings and its median alone lose at some size in 6 (5, 7, 0) of these 40 calibrations.
    rng = random.Random(f"{low} {high} {noise}")
    missed = []
    for _ in range(40):
        truth = rng.uniform(low, high)
        duplex, spread, readings = _calibrate(rng, truth, noise)
        if _loses(Link(*HOST, duplex, duplex_spread=spread), truth):
            missed.append((truth, duplex, spread, readings))
    assert len(missed) <= 4, missed  # 90%: every size within 5% of the fastest


def test_the_duplex_that_makes_the_model_match_a_measured_ratio_is_found():
    link = Link(*HOST)
    for duplex in (0.0, 0.3, 1.0, 1.7):
        ratio = predict("ring", 2, LARGE_BYTES, Link(*HOST, duplex)) / predict("naive", 2, LARGE_BYTES, link)
        assert fit_duplex(link, LARGE_BYTES, ratio) == pytest.approx(duplex, abs=1e-6)
    assert fit_duplex(link, LARGE_BYTES, 0.01) == pytest.approx(0.0, abs=1e-6)  # faster than ring can be
    assert fit_duplex(link, LARGE_BYTES, 100.0) == pytest.approx(MAX_DUPLEX, abs=1e-6)
    assert fit_duplex(Link(0.0, 0.0, 0.0), LARGE_BYTES, 1.5) == 0.0  # nothing takes time: nothing to fit


def test_a_quiet_host_needs_one_batch_and_a_busy_one_reads_on_until_the_spread_is_small():
    rng = random.Random(0)
    quiet = [_calibrate(rng, 0.5, 0.01) for _ in range(20)]
    assert all(readings == LARGE_REPEATS and spread <= 0.1 for _, spread, readings in quiet)
    busy = [_calibrate(rng, 0.5, 0.2) for _ in range(20)]
    assert all(readings > LARGE_REPEATS for _, _, readings in busy)
    assert all(spread <= 0.1 or readings >= 36 for _, spread, readings in busy)
    assert duplex_of([0.5]) == (0.5, MAX_DUPLEX)  # one reading says nothing about its noise
    assert duplex_of([0.0, 0.5, 1.0] * 3)[1] > duplex_of([0.0, 0.5, 1.0] * 12)[1]  # same scatter, more readings
    assert duplex_of([-1.0, 5.0, 1.0]) == (1.0, pytest.approx(MAX_DUPLEX))  # readings are taken within 0 and 2


def test_the_pick_loses_least_to_the_fastest_anywhere_in_the_measured_range():
    for duplex, spread in [(0.8, 0.3), (0.5, 0.2), (0.9, 0.1), (0.3, 0.3), (0.6, 0.0)]:
        link = Link(*HOST, duplex, duplex_spread=spread)
        low, high = max(0.0, duplex - spread), min(MAX_DUPLEX, duplex + spread)
        grid = [Link(*HOST, low + (high - low) * i / 20) for i in range(21)]
        for size in [4 << 10, *SIZES]:
            behind = [{a: predict(a, 2, size, g) / min(predict(b, 2, size, g) for b in ALGORITHMS) for a in ALGORITHMS}
                      for g in grid]
            worst = {a: max(b[a] for b in behind) for a in ALGORITHMS}
            assert worst[choose(2, size, link)] == pytest.approx(min(worst.values())), (duplex, spread, size)
    # At two ranks recursive doubling is naive's bytes in one exchange instead of two messages in turn: the faster
    # below a duplex of 1, the slower above. At exactly 1.1, naive; if the duplex may be 0.6 to 1.6, naive is up to 24%
    # behind (at 0.6), recursive doubling up to 29% (at 1.6): naive still loses less. At 0.8 +- 0.5 it is the other way.
    assert choose(2, 1 << 20, Link(*HOST, 1.1)) == "naive"
    assert choose(2, 1 << 20, Link(*HOST, 1.1, duplex_spread=0.5)) == "naive"
    assert choose(2, 1 << 20, Link(*HOST, 0.8)) == "recursive_doubling"
    assert choose(2, 1 << 20, Link(*HOST, 0.8, duplex_spread=0.5)) == "recursive_doubling"
    assert Link(*HOST, 0.5, duplex_spread=0.5).duplexes() == (0.0, 0.5, 1.0) and Link(*HOST, 0.5).duplexes() == (0.5,)
    assert Link(*HOST, 1.8, duplex_spread=0.5).duplexes() == (1.3, 1.8, MAX_DUPLEX)


def test_a_change_in_measured_against_predicted_time_is_drift_a_steady_model_error_is_not():
    steady = [1.4] * DRIFT_CALLS  # the model is 40% off at this size, all along
    assert not moved(steady, [1.5] * DRIFT_CALLS)
    assert moved(steady, [3.0] * DRIFT_CALLS)  # the link got twice as slow
    assert moved(steady, [0.6] * DRIFT_CALLS)  # or faster
    assert not moved(steady, [3.0] * (DRIFT_CALLS - 1))  # too few calls to say
    assert not moved(steady[:-1], [3.0] * DRIFT_CALLS)
    assert not moved(steady, [1.4] * (DRIFT_CALLS - 2) + [50.0, 50.0])  # a late peer now and then is no drift


def test_calls_stalled_on_a_busy_host_are_no_drift_however_many_of_them_a_window_holds():
    # Small calls on this 2-core host: most near the model, some 10-30 times slower, waiting for a core.
    rng = random.Random(0)

    def window(fast: float, stalled: float) -> list[float]:
        return [fast * rng.uniform(0.8, 1.3) if rng.random() >= stalled else fast * rng.uniform(8, 30)
                for _ in range(DRIFT_CALLS)]
    for _ in range(2000):
        assert not moved(window(1.5, rng.uniform(0.0, 0.45)), window(1.5, rng.uniform(0.0, 0.45)))
    assert sum(moved(window(1.5, 0.3), window(4.5, 0.3)) for _ in range(50)) >= 45  # three times slower is drift
    assert sum(moved(window(1.5, 0.3), window(0.4, 0.3)) for _ in range(50)) >= 45  # and so is faster
    assert not moved([0.0] * DRIFT_CALLS, [1.0] * DRIFT_CALLS)  # no time to compare against: no drift, no error
    assert not moved([1.0] * DRIFT_CALLS, [float("nan")] * DRIFT_CALLS)
    assert not moved([float("inf")] * DRIFT_CALLS, [float("inf")] * DRIFT_CALLS)


def _drift(cache: str, given: bool, windows: int):
    """Rank 1 sees its times drift (planted) before `windows` looks in a row (one call in `DRIFT_EVERY`) from the
    second look on, then none."""
    from manualdp.spmd import allreduce
    from manualdp.spmd.auto import tune
    from manualdp.spmd.transport.group import group_state

    os.environ["XDG_CACHE_HOME"] = cache
    os.environ.pop("MANUALDP_LINK", None)
    if given:
        os.environ["MANUALDP_LINK"] = "5e-5,2.5e-10,3e-11,1.0"
    tune.LARGE_BYTES = 1 << 16  # a quick calibration
    # A busy host moves real timings 2-fold now and then (the planted drift below is 100-fold):
    # only the planted drift must count here.
    tune.DRIFT_FACTOR = 20.0
    calibrations, state = [], group_state()
    measure = tune.calibrate
    tune.calibrate = lambda *a, **k: calibrations.append(state.calls) or measure(*a, **k)
    x = torch.ones(1000)
    allreduce(x)  # agrees on the constants: rank 0 measures them with rank 1
    for _ in range(2 * DRIFT_CALLS):
        allreduce(x)
    before = (len(calibrations), tune.drifted())
    if dist.get_rank() == 1 and not given:  # this rank alone sees its calls take 100 times as long as they did
        first, latest = group_state().times[x.numel() * 4]
        latest.extend([100 * r for r in first])
        assert tune.moved(first, latest)
    totals, planted, looks = [], 0, 0
    for _ in range(4 * tune.DRIFT_EVERY):
        look = (state.calls + 1) % tune.DRIFT_EVERY == 0
        looks += look  # the first look confirms the first window (`tune.drift_flag`): planted from the second on
        if dist.get_rank() == 1 and not given and look and looks > 1 and planted < windows:
            first, latest = state.times[x.numel() * 4]  # the latest calls took 100 times as long as the first
            latest.extend([100 * r for r in first])
            planted += 1
        x = torch.full((1000,), float(dist.get_rank() + 1))
        allreduce(x)
        totals.append(x[0].item())
    return before, calibrations[before[0]:], state.remeasures, tune.link_for(), set(totals)


@pytest.mark.parametrize("given", [False, True])
def test_when_one_rank_sees_the_times_drift_every_rank_measures_the_link_again_together(tmp_path, given):
    results = launch(_drift, 2, (str(tmp_path), given, 3), timeout=120)
    for rank, (before, calibrations, remeasures, link, totals) in enumerate(results):
        assert before == ((0 if given else 1), False), (rank, before)  # no drift while nothing changed
        # once, though it lasted 3 looks; never for MANUALDP_LINK's constants (`note` ignores them)
        assert remeasures == (0 if given else 1) and totals == {3.0}, (rank, remeasures, totals)
        assert len(calibrations) == (0 if given else 1), (rank, calibrations)  # MANUALDP_LINK's constants are kept
    assert results[0][1] == results[1][1]  # at the same call on both ranks
    assert results[0][3] == results[1][3]  # the same new constants on both ranks


def test_a_drift_seen_at_one_look_only_measures_nothing(tmp_path):
    for rank, (_, calibrations, remeasures, _, totals) in enumerate(launch(_drift, 2, (str(tmp_path), False, 1),
                                                                           timeout=120)):
        assert remeasures == 0 and calibrations == [] and totals == {3.0}, (rank, remeasures, calibrations)
