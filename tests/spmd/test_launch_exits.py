"""`launch` names a rank whose `fn` ended without returning (os._exit, SystemExit, KeyboardInterrupt), and how."""
import os

import pytest

from manualdp.spmd import launch


def _leave_on_rank1(how):
    if os.environ["RANK"] == "1":
        if how == "os._exit":
            os._exit(0)
        raise {"SystemExit": SystemExit(0), "KeyboardInterrupt": KeyboardInterrupt()}[how]
    return 7


@pytest.mark.parametrize("how, words", [
    ("os._exit", "rank 1: its process exited with code 0 before fn returned"),
    ("SystemExit", "rank 1: fn raised SystemExit(0)"),
    ("KeyboardInterrupt", "rank 1: fn raised KeyboardInterrupt()"),
])
def test_a_rank_that_ends_without_returning_is_named_with_how(how, words):
    with pytest.raises(RuntimeError) as info:
        launch(_leave_on_rank1, 2, (how,), init=False, timeout=120)
    line = str(info.value)
    assert words in line and "_leave_on_rank1 ended without returning on 1 of 2 ranks" in line
    assert "rank 0" not in line and "\n" not in line


def _ok():
    return 1


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), True, "10", None])
def test_a_bad_timeout_is_refused_in_words_that_match_what_is_accepted(timeout):
    with pytest.raises(ValueError, match=r"^timeout must be a positive number of seconds, got ") as info:
        launch(_ok, 1, timeout=timeout, init=False)
    assert "None" not in str(info.value).replace(f"got {timeout!r}", "")
