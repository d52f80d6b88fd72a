"""auto's drift, look by look, on injected times: a busy moment, in the first window or later, measures nothing."""
from types import SimpleNamespace

from manualdp.spmd.auto import tune
from manualdp.spmd.auto.tune import DRIFT_CALLS, DRIFT_LOOKS, drift_flag

QUIET, BUSY = 1.0, 3.0  # measured / predicted time of a call on a quiet host, and while it is busy (past DRIFT_FACTOR)


def _looks(first: float, windows: list[float]) -> list[bool]:
    """`drift_flag` at each look, for one size whose first calls took `first` and the calls before each look
    `windows[i]` (ratios, a little spread as real ones are)."""
    state = SimpleNamespace(times={}, confirmed=set(), drifted=False, drift_looks=0)
    ratios, latest = [], []
    state.times[1 << 20] = (ratios, latest)
    ratios += [first * (1 + i / 100) for i in range(DRIFT_CALLS)]
    flags = []
    for window in windows:
        latest[:] = [window * (1 + i / 100) for i in range(DRIFT_CALLS)]
        flags.append(drift_flag(state))
    return flags


def test_a_first_window_taken_while_the_host_was_busy_measures_nothing():
    assert _looks(BUSY, [QUIET] * 20) == [False] * 20  # was: measured again at the second look
    assert _looks(QUIET / BUSY, [QUIET] * 20) == [False] * 20  # first calls faster than the rest: the same


def test_a_busy_moment_at_any_one_look_measures_nothing():
    for at in range(6):
        windows = [QUIET] * 6
        windows[at] = BUSY
        assert _looks(QUIET, windows) == [False] * 6, at


def test_a_change_that_lasts_measures_again_once_it_has_been_seen_at_the_looks_in_a_row():
    flags = _looks(QUIET, [QUIET] + [BUSY] * 5)  # confirmed at the first look, slower from the second on
    assert flags.index(True) == DRIFT_LOOKS  # looks 2..DRIFT_LOOKS + 1 saw it
    flags = _looks(QUIET, [QUIET, QUIET / BUSY, QUIET / BUSY, QUIET / BUSY])  # or faster
    assert flags.index(True) == DRIFT_LOOKS


def test_a_first_window_replaced_is_itself_confirmed_before_a_drift_counts():
    # The second window is the busy one: it replaces the first, the third replaces it back, then all agree.
    assert _looks(QUIET, [BUSY, QUIET, QUIET, QUIET, QUIET]) == [False] * 5
    # Busy from the first look on: that is the host now; it becomes the first window, and nothing moves from it.
    assert _looks(QUIET, [BUSY] * 6) == [False] * 6


def test_drifted_says_nothing_before_a_first_window_is_confirmed():
    state = SimpleNamespace(times={1: ([QUIET] * DRIFT_CALLS, [BUSY] * DRIFT_CALLS)}, confirmed=set(), drifted=False,
                            drift_looks=0)
    assert not tune._has_drifted(state)
    state.confirmed.add(1)
    assert tune._has_drifted(state)
