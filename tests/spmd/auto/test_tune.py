"""algorithm="auto": the cost model's pick, with constants every rank agrees on."""
import json
import math
import os
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st

from manualdp.cost import shared_cores, traffic
from manualdp.schedule import ALGORITHMS, get_schedule
from manualdp.spmd import launch
from manualdp.spmd.auto.tune import CALIBRATION, Link, cache_path, choose, host_parallel, predict


@given(n=st.integers(2, 8), nbytes=st.integers(0, 1 << 26).map(lambda b: b - b % 4),
       alpha=st.floats(0, 1e-3), beta=st.floats(0, 1e-8), gamma=st.floats(0, 1e-9))
def test_the_choice_is_the_lowest_prediction(n, nbytes, alpha, beta, gamma):
    link = Link(alpha, beta, gamma)
    pick = choose(n, nbytes, link)
    assert all(predict(pick, n, nbytes, link) <= predict(a, n, nbytes, link) for a in ALGORITHMS)


@pytest.mark.parametrize("n", [3, 4, 8])
def test_bandwidth_bound_choice_moves_the_fewest_bytes(n):
    link = Link(alpha=0.0, beta=1e-9, gamma=0.0)
    nbytes = 64 << 20
    pick = choose(n, nbytes, link)
    busiest = {a: max(max(t["sent"]), max(t["received"]))
               for a in ALGORITHMS for t in [traffic(get_schedule(a, n), nbytes, 4)]}
    # The textbook's root sends (n-1)S; a bandwidth-optimal schedule 2(n-1)/n S per device.
    assert busiest[pick] == min(busiest.values()) < busiest["naive"]


def test_latency_bound_choice_takes_the_fewest_message_rounds():
    n, link = 8, Link(alpha=1e-4, beta=0.0, gamma=0.0)
    pick = choose(n, 4096, link)
    rounds = {a: len(get_schedule(a, n).rounds) for a in ALGORITHMS}
    assert rounds[pick] < rounds["ring"]  # ring needs 2(n-1) = 14 rounds


def test_link_constants_are_checked():
    with pytest.raises(ValueError, match="beta must be a non-negative number"):
        Link(1e-6, -1.0, 0.0)
    with pytest.raises(ValueError, match="duplex must be a number from 0 to 2, got 2.5"):
        Link(1e-6, 1e-9, 0.0, 2.5)
    with pytest.raises(ValueError, match="duplex_spread must be a number from 0 to 2, got -0.1"):
        Link(1e-6, 1e-9, 0.0, 1.5, duplex_spread=-0.1)


@given(n=st.integers(2, 8), nbytes=st.integers(0, 1 << 26).map(lambda b: b - b % 4),
       alpha=st.floats(0, 1e-3), beta=st.floats(0, 1e-8), gamma=st.floats(0, 1e-9), duplex=st.floats(0, 2))
def test_duplex_only_charges_rounds_that_send_and_receive_at_once(n, nbytes, alpha, beta, gamma, duplex):
    for a in ALGORITHMS:
        full, shared = (predict(a, n, nbytes, Link(alpha, beta, gamma)),
                        predict(a, n, nbytes, Link(alpha, beta, gamma, duplex)))
        assert shared >= full
        one_way = all(not ({t.src for t in rnd} & {t.dst for t in rnd}) for rnd in get_schedule(a, n).rounds)
        if one_way:  # naive and tree: no device sends and receives in the same round
            assert shared == full


def test_a_link_that_takes_turns_makes_the_naive_schedule_win_at_two_ranks():
    # At two ranks ring and naive move the same bytes per rank; ring's two rounds are exchanges,
    # which cost twice a message where the directions take turns, and all it saves is additions.
    turns, full = Link(1e-4, 4e-10, 0.0, duplex=1.0), Link(1e-4, 4e-10, 0.0, duplex=0.0)
    sizes = [4 << k for k in range(0, 25, 2)]
    assert {choose(2, s, turns) for s in sizes} <= {"naive", "tree"}  # the same schedule at two ranks
    assert choose(2, 64 << 20, full) in ("ring", "halving_doubling", "recursive_doubling")


@given(n=st.integers(2, 8), nbytes=st.integers(0, 1 << 26).map(lambda b: b - b % 4), alpha=st.floats(0, 1e-3),
       beta=st.floats(0, 1e-8), gamma=st.floats(0, 1e-9), duplex=st.floats(0, 2), parallel=st.integers(1, 8))
def test_fewer_ranks_at_once_never_make_a_schedule_faster(n, nbytes, alpha, beta, gamma, duplex, parallel):
    for a in ALGORITHMS:
        free = predict(a, n, nbytes, Link(alpha, beta, gamma, duplex))
        shared = predict(a, n, nbytes, Link(alpha, beta, gamma, duplex, parallel))
        assert shared >= free * (1 - 1e-12)
        if parallel >= n:  # every rank has a core: the textbook's model
            assert shared == free
        assert shared <= free * n / min(parallel, n) * (1 + 1e-12) + 1e-18  # at worst all ranks' work over the cores


@pytest.mark.parametrize("n,parallel", [(4, 2), (4, 1), (8, 2), (8, 3)])
def test_a_ring_on_shared_cores_costs_every_ranks_messages_over_the_cores(n, parallel):
    # Every ring round, each rank sends one message and receives one: alpha each (full duplex).
    # n ranks on `parallel` cores: each round lasts n * alpha / parallel, and there are 2(n - 1).
    alpha = 1e-4
    assert math.isclose(predict("ring", n, 1 << 20, Link(alpha, 0.0, 0.0, 0.0, parallel)),
                        2 * (n - 1) * n * alpha / parallel)


@given(work=st.lists(st.floats(0, 10), max_size=8), parallel=st.integers(0, 8))
def test_shared_cores_lies_between_the_two_bounds_of_scheduling_on_fewer_cores(work, parallel):
    t = shared_cores(work, parallel)
    assert shared_cores(sorted(work, reverse=True), parallel) == t  # who is who does not matter
    busy = [w for w in work if w > 0]
    if not busy:
        assert t == 0.0
        return
    if parallel == 0 or parallel >= len(busy):  # a core each: the longest work
        assert t == max(busy)
        return
    # no core does more than all of it; no device runs faster than one core
    lower = max(max(busy), sum(busy) / parallel)
    # Graham's bound for any schedule that never idles a core
    graham = sum(busy) / parallel + (1 - 1 / parallel) * max(busy)
    assert lower * (1 - 1e-12) <= t <= graham * (1 + 1e-12)
    if len(set(busy)) == 1:  # equal work packs the cores exactly
        assert math.isclose(t, sum(busy) / parallel, rel_tol=1e-12)


def test_shared_cores_rejects_a_negative_number_of_cores_and_work_that_is_not_a_time():
    with pytest.raises(ValueError, match="parallel must be a non-negative int"):
        shared_cores([1.0], -1)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"work\[1\] must be a non-negative number"):
            shared_cores([1.0, bad], 2)


def test_on_two_cores_naive_root_waits_its_turn_and_tree_wins_at_four_ranks():
    # Moving n bytes costs beta*n on each side; sending and receiving take turns (duplex 1); no alpha, no adds.
    # naive: 3 senders with n each and a root with 3n share 2 cores, so each runs at half speed until the
    # senders finish (2n of time, the root has done n) and the root does its other 2n alone: 4n a round,
    # two rounds. tree: four rounds; the first and last have 4 busy ranks with n each (2n over 2 cores),
    # the middle two one pair (n). ring: six rounds of 4 ranks each moving n/4 both ways (n/2): n a round.
    beta, n = 1e-9, 1 << 20
    shared = Link(0.0, beta, 0.0, duplex=1.0, parallel=2)
    times = {a: predict(a, 4, n, shared, segment_bytes=None) / (beta * n) for a in ("naive", "tree", "ring")}
    assert times == pytest.approx({"naive": 8.0, "tree": 6.0, "ring": 6.0}, rel=1e-12)
    assert predict("naive", 4, n, Link(0.0, beta, 0.0, duplex=1.0), segment_bytes=None) == pytest.approx(6 * beta * n)
    assert choose(4, n, Link(1e-4, beta, 0.0, duplex=1.0, parallel=2)) == "tree"  # fewer messages than ring


@given(n=st.integers(2, 8), nbytes=st.integers(0, 1 << 26).map(lambda b: b - b % 4), alpha=st.floats(0, 1e-3),
       beta=st.floats(0, 1e-8), gamma=st.floats(0, 1e-9), duplex=st.floats(0, 2), segment=st.integers(4, 1 << 24))
def test_segments_overlap_additions_with_transfers_and_nothing_else(n, nbytes, alpha, beta, gamma, duplex, segment):
    link = Link(alpha, beta, gamma, duplex)
    for a in ALGORITHMS:
        textbook = predict(a, n, nbytes, link, segment_bytes=None)
        pipelined = predict(a, n, nbytes, link, segment_bytes=segment)
        assert pipelined <= textbook * (1 + 1e-12)
        if segment >= n * nbytes or gamma == 0:  # one segment per round, or nothing to add: nothing overlaps
            assert math.isclose(pipelined, textbook, rel_tol=1e-12, abs_tol=1e-18)
        # The overlap saves at most the additions: every byte is still moved.
        assert pipelined >= predict(a, n, nbytes, Link(alpha, beta, 0.0, duplex), segment_bytes=None) * (1 - 1e-12)


def test_naive_at_two_ranks_with_segments_pipelined_beats_the_ring_at_every_size():
    # At two ranks ring's only gain over naive is that each rank adds half; with additions
    # overlapped by the transfers that gain is gone, and ring's exchanges cost two messages a round.
    link = Link(1e-4, 5e-10, 7e-11, duplex=1.0)
    sizes = [4 << k for k in range(0, 25, 2)]
    assert {choose(2, s, link) for s in sizes} <= {"naive", "tree"}
    assert choose(2, 64 << 20, link, segment_bytes=None) == "ring"  # the textbook's sum: ring's halved additions win


def test_host_parallel_counts_cores_per_host(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert host_parallel("gloo", 2) == 0  # a core per rank
    assert host_parallel("gloo", 4) == 2  # 4 ranks take turns on 2 cores
    assert host_parallel("nccl", 4) == 0  # each rank has its own GPU
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_parallel("gloo", 8) == 4  # two hosts of 4 ranks on 2 cores each
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert host_parallel("gloo", 8) == 0
    with pytest.raises(ValueError, match="parallel must be a non-negative int"):
        Link(1e-6, 1e-9, 0.0, 0.0, -1)


def _agree(links: list, sizes: list, cache: str):
    from manualdp.spmd import allreduce
    from manualdp.spmd.auto.tune import link_for, resolve

    os.environ["XDG_CACHE_HOME"] = cache
    if links[dist.get_rank()] is not None:
        os.environ["MANUALDP_LINK"] = links[dist.get_rank()]
    link = link_for()
    picks = [resolve("auto", s, 4) for s in sizes]
    x = torch.arange(1000, dtype=torch.float32) * (dist.get_rank() + 1)
    allreduce(x, "auto")
    return link, picks, x


def test_ranks_agree_on_rank_zeros_constants_though_their_own_differ(tmp_path):
    # Rank 0 says "latency is everything", the others "bandwidth is everything": they must follow rank 0.
    links = ["1e-3,0,0", "0,1e-9,0", "0,1e-9,0"]
    sizes = [4 << k for k in range(0, 25, 4)]
    out = launch(_agree, 3, (links, sizes, str(tmp_path)), timeout=120)
    assert all(link == Link(1e-3, 0.0, 0.0) for link, _, _ in out)
    assert all(picks == out[0][1] for _, picks, _ in out)
    assert out[0][1] == [choose(3, s * 4, Link(1e-3, 0.0, 0.0)) for s in sizes]
    expected = torch.arange(1000, dtype=torch.float32) * 6
    for _, _, x in out:
        assert torch.equal(x, expected)


def _calibrate_twice(cache: str):
    import manualdp.spmd.auto.tune as tune
    from manualdp.spmd.transport.group import group_state

    os.environ["XDG_CACHE_HOME"] = cache
    os.environ.pop("MANUALDP_LINK", None)
    if dist.get_rank() == 0:  # a cache of an older calibration (no "calibration" in it): it must be measured again
        os.makedirs(os.path.dirname(tune.cache_path("gloo", 2)), exist_ok=True)
        with open(tune.cache_path("gloo", 2), "w") as f:
            json.dump({"alpha": 9.0, "beta": 9.0, "gamma": 9.0, "duplex": 0.0}, f)
    first = tune.link_for()
    group_state().link = None  # a new run: the constants now come from rank 0's cache, not a calibration
    tune.calibrate = None  # calling it would fail
    second = tune.link_for()
    return first, second


def test_calibration_measures_once_and_rank_zero_caches_it(tmp_path, monkeypatch):
    first, second = launch(_calibrate_twice, 2, (str(tmp_path),), timeout=120)
    assert first[0] == first[1] == second[0] == second[1]
    link = first[0]
    assert all(math.isfinite(v) and v >= 0 for v in (link.alpha, link.beta, link.gamma))
    assert link.alpha > 0  # a message never takes no time
    assert link.alpha != 9.0 and 0 <= link.duplex <= 2  # measured, not read from the old cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with open(cache_path("gloo", 2)) as f:
        saved = json.load(f)
    assert saved.pop("calibration") == CALIBRATION and 0 <= time.time() - saved.pop("measured_at") < 120
    assert Link(**saved) == link


# ---------------------------------------------------------------- a hostile cache, a bad MANUALDP_LINK

def _json(text):
    def write(path):
        with open(path, "w") as f:
            f.write(text)
    return write


NOW = repr(time.time())
GOOD = '"beta": 1e-9, "gamma": 1e-10, "duplex": 0.5, "duplex_spread": 0.0, "measured_at": %s, "calibration": %d' % (
    NOW, CALIBRATION)
HOSTILE_CACHES = {
    "huge float": _json('{"alpha": 1e308, %s}' % GOOD),                     # overflows every prediction to inf
    "float past the largest": _json('{"alpha": 1e999, %s}' % GOOD),         # json reads inf
    "int of 4000 digits": _json('{"alpha": %s, %s}' % ("9" * 4000, GOOD)),  # fits the file; no float holds it
    "int of a million digits": _json('{"alpha": %s, %s}' % ("9" * 10**6, GOOD)),
    "NaN": _json('{"alpha": NaN, %s}' % GOOD),
    "negative": _json('{"alpha": -1e-6, %s}' % GOOD),
    "string": _json('{"alpha": "fast", %s}' % GOOD),
    "bool": _json('{"alpha": true, %s}' % GOOD),
    "list": _json('{"alpha": [1e-6], %s}' % GOOD),
    "duplex past 2": _json('{"alpha": 1e-6, %s}' % GOOD.replace('"duplex": 0.5', '"duplex": 3')),
    "measured_at a string": _json('{"alpha": 1e-6, %s}' % GOOD.replace(NOW, '"now"')),
    "measured_at of 4000 digits": _json('{"alpha": 1e-6, %s}' % GOOD.replace(NOW, "9" * 4000)),
    "extra key": _json('{"alpha": 1e-6, "parallel": 1, %s}' % GOOD),
    "missing key": _json('{%s}' % GOOD),
    "calibration not a number": _json('{"alpha": 1e-6, "beta": 1e-9, "gamma": 1e-10, "duplex": 0.5, '
                                      '"calibration": [2]}'),
    "top level a list": _json("[1e-6, 1e-9, 1e-10, 0.5]"),
    "top level a number": _json("1e308"),
    "nested 2000 deep": _json("[" * 2000 + "]" * 2000),                 # fits the file; json raises RecursionError
    "nested 100000 deep": _json("[" * 100000 + "]" * 100000),
    "truncated": _json('{"alpha": 1e-6, "be'),
    "empty": _json(""),
    "not UTF-8": lambda path: open(path, "wb").write(b'{"alpha": "\xff\xfe"}'),
    "a FIFO": os.mkfifo,                                                   # opened for reading, it blocks for a writer
    "a link to /dev/zero": lambda path: os.symlink("/dev/zero", path),     # read to the end, it never ends
    "a directory": os.mkdir,
}


@pytest.mark.parametrize("case", sorted(HOSTILE_CACHES))
def test_a_hostile_cache_is_named_in_one_warning_and_measured_again(case, tmp_path, monkeypatch, deadline):
    import warnings

    from manualdp.spmd.auto.tune import known_link

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MANUALDP_LINK", raising=False)
    path = cache_path("gloo", 2)
    os.makedirs(os.path.dirname(path))
    HOSTILE_CACHES[case](path)
    with deadline(20), warnings.catch_warnings(record=True) as caught:  # a FIFO or /dev/zero read as a file would hang
        warnings.simplefilter("always")
        assert known_link("gloo", 2) == (None, path)  # None: the link is measured again
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert path in message and "\n" not in message and len(message) < 500 + len(path)


def test_an_older_manualdps_cache_is_measured_again_without_a_warning(tmp_path, monkeypatch):
    import warnings

    from manualdp.spmd.auto.tune import known_link

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MANUALDP_LINK", raising=False)
    path = cache_path("gloo", 2)
    os.makedirs(os.path.dirname(path))
    for old in ('{"alpha": 1e-6, "beta": 1e-9, "gamma": 1e-10}', '{"alpha": 1e-6, %s}' % GOOD.replace(
            f'"calibration": {CALIBRATION}', '"calibration": 1')):
        _json(old)(path)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert known_link("gloo", 2) == (None, path)
    _json('{"alpha": 1e-6, %s}' % GOOD)(path)  # and this version's is read
    assert known_link("gloo", 2)[0] == Link(1e-6, 1e-9, 1e-10, 0.5, host_parallel("gloo", 2))


def test_constants_measured_a_day_ago_or_later_than_now_are_measured_again_without_a_warning(tmp_path, monkeypatch):
    import warnings

    from manualdp.spmd.auto.tune import MAX_CACHE_AGE, known_link

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MANUALDP_LINK", raising=False)
    path = cache_path("gloo", 2)
    os.makedirs(os.path.dirname(path))
    for age, kept in ((MAX_CACHE_AGE + 60, False), (-3600, False), (MAX_CACHE_AGE - 60, True), (0, True)):
        _json('{"alpha": 1e-6, %s}' % GOOD.replace(NOW, repr(time.time() - age)))(path)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            link, _ = known_link("gloo", 2)
        assert (link == Link(1e-6, 1e-9, 1e-10, 0.5, host_parallel("gloo", 2))) if kept else link is None, age


@pytest.mark.parametrize("case", ["a FIFO", "a link to /dev/zero", "nested 100000 deep"])
def test_the_calibration_replaces_a_hostile_cache(case, tmp_path, monkeypatch, deadline):
    import manualdp.spmd.auto.link_cache as link_cache
    import manualdp.spmd.auto.tune as tune

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MANUALDP_LINK", raising=False)
    monkeypatch.setattr(tune.dist, "get_backend", lambda group=None: "gloo")
    path = cache_path("gloo", 2)
    os.makedirs(os.path.dirname(path))
    HOSTILE_CACHES[case](path)
    measured = Link(2e-5, 3e-10, 4e-11, 0.25)
    with deadline(20):  # writing into a FIFO blocks until someone reads it
        link_cache.save("gloo", 2, measured)
    assert os.path.isfile(path) and not os.path.islink(path)
    assert tune.known_link("gloo", 2)[0] == Link(2e-5, 3e-10, 4e-11, 0.25, host_parallel("gloo", 2))


@pytest.mark.parametrize("value, words", [
    ("1e308,0,0", "alpha must be at most 1.0"),
    ("0,1e400,0", "beta must be a non-negative number, got inf"),
    ("nan,0,0", "alpha must be a non-negative number, got nan"),
    ("-1e-6,0,0", "got -1e-06"),
    ("1e-6,1e-9", "2 values, not 3 to 5"),
    ("1e-6,1e-9,0,0,2,7", "6 values, not 3 to 5"),
    ("1e-6,1e-9,0,2.5", "duplex must be a number from 0 to 2"),
    ("1e-6,1e-9,0,0,2.5", "invalid literal for int"),
    ("1e-6,1e-9,0,0," + "9" * 4000, "parallel must be at most"),
    ("1e-6,1e-9,0,0," + "9" * 10**6, "Exceeds the limit"),
    ("1" * 10**6 + ",0,0", "alpha must be a non-negative number, got inf"),
    ("fast,0,0", "could not convert string to float: 'fast'"),
])
def test_a_bad_manualdp_link_is_one_line_naming_the_variable_and_its_value(value, words, monkeypatch):
    from manualdp.spmd.auto.tune import known_link

    monkeypatch.setenv("MANUALDP_LINK", value)
    with pytest.raises(ValueError) as e:
        known_link("gloo", 2)
    message = str(e.value)
    assert message.startswith("MANUALDP_LINK must be 'alpha,beta,gamma[,duplex[,parallel]]'") and words in message
    assert repr(value)[:60] in message and "\n" not in message and len(message) < 500


def _agree_with_a_bad_link(cache: str):
    from manualdp.spmd.auto.tune import link_for

    os.environ["XDG_CACHE_HOME"] = cache
    if dist.get_rank() == 0:
        os.environ["MANUALDP_LINK"] = "1e308,0,0"
    else:
        os.environ.pop("MANUALDP_LINK", None)
    try:
        link_for()
    except ValueError as e:
        return str(e)
    return None


def test_a_bad_manualdp_link_on_rank_zero_stops_every_rank_with_a_value_error(tmp_path):
    first, second = launch(_agree_with_a_bad_link, 2, (str(tmp_path),), timeout=60)
    assert first.startswith("MANUALDP_LINK must be") and "'1e308,0,0'" in first
    assert second == "rank 0 refused its MANUALDP_LINK (its error names it); nothing was measured"
    assert not os.path.exists(os.path.join(str(tmp_path), "manualdp"))  # nothing measured, nothing cached
