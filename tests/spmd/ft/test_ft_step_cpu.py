"""The CPU a steady fault-tolerant step spends beyond the drop-in's, in counts (never times): issue 44's profile of
`bench/ft.py --models mlp --profile 300` (replica 0's ask thread, its bucket thread), each cut held here."""
import collections
import dataclasses
import json
import threading
import types

import torch

from manualdp.spmd.ft import Coordinator, look
from manualdp.spmd.ft.coordinator import connect
from manualdp.spmd.ft.quorum import Member, Quorum
from tests.spmd.ft.test_ft_step_cost import _steady_ask, one_step_of_two


def test_a_steady_ask_deep_copies_nothing_and_writes_what_asdict_wrote(request, monkeypatch):
    """Before: `dataclasses.asdict` for the ask and for the proposal, deep copies of every member's fields: a third of
    the ask thread's CPU in the profile. Now the fields by name; the JSON is the same text."""
    from manualdp.spmd.ft import quorum as quorum_module
    calls, real = [], dataclasses.asdict
    counting = types.SimpleNamespace(**vars(dataclasses))  # the quorum module's view: the test's helpers not counted
    counting.asdict = lambda *a, **k: calls.append(a) or real(*a, **k)
    monkeypatch.setattr(quorum_module, "dataclasses", counting)
    with Coordinator(0) as c:
        quorum, _ = _steady_ask(lambda: connect("127.0.0.1", c.port, 10, namespace=request.node.name))
    assert quorum.ids == ["a", "b"] and calls == []
    monkeypatch.undo()
    for q in (quorum, Quorum(7, (Member("x", 3, False, None, 1), Member("y", 2, True, (4, 2), 2, 5, "d", 9)), 4,
                             False)):
        assert q.to_json() == json.dumps(dataclasses.asdict(q))
        assert Quorum.from_json(q.to_json()) == q


def test_each_buckets_average_is_judged_finite_once(monkeypatch):
    """Before: `finite` on each bucket's average twice (`average_fitting`, then the reducer again): a norm of the whole
    bucket more per step. Now a bucket's elements are normed twice in all: its norm for the guard, its average once."""
    sizes, real = [], torch.linalg.vector_norm
    def norm(t, *args, **kwargs):
        if threading.current_thread().name == "manualdp-ft-buckets":  # not the guard's judging of the bucket norms
            sizes.append(t.numel())
        return real(t, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "vector_norm", norm)
    with Coordinator(0) as c:
        buckets = one_step_of_two(c.port)
    assert buckets == [2, 8, 4, 12]
    assert collections.Counter(sizes) == dict.fromkeys(buckets, 2), sizes


class _Clock:
    """`time` for `look.glance`: a clock that only sleeps move; each sleep recorded."""

    def __init__(self) -> None:
        self.now, self.sleeps = 100.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_a_glance_never_pauses_longer_than_most_and_still_ends_at_its_time(monkeypatch):
    """Before: pauses doubling up to the whole `POLL` (0.2, 0.4, 0.8, 1.6 ms, ...): a quorum or an outcome written
    1.5 ms after the glance began was seen at 3.0 ms. Now a pause is at most `MOST`: at 2.2 ms."""
    clock, peeks = _Clock(), []
    monkeypatch.setattr(look, "time", clock)
    look.glance(lambda: peeks.append(clock.now) or clock.now - 100.0 >= 0.0015)
    assert max(clock.sleeps) <= look.MOST and abs(peeks[-1] - 100.0 - 0.0022) < 1e-9, clock.sleeps
    clock.sleeps.clear()
    look.glance(lambda: False, seconds=look.POLL)  # nothing comes: it ends at its time, not a pause later
    assert abs(sum(clock.sleeps) - look.POLL) < 1e-9 and max(clock.sleeps) <= look.MOST, clock.sleeps


def test_the_first_voter_reads_no_heartbeat_when_the_last_vote_comes_within_a_glance(request, monkeypatch):
    """Before: the member that voted first read every member's heartbeat on its first pass (the last voter's vote is
    missing then, in every step): a round trip or two on the main thread's way to the outcome. Now from the second
    pass only: a member that died is named one glance later."""
    from manualdp.spmd.ft import commit, keys

    class Watched:
        calls = 0

        def live(self, ids):
            Watched.calls += 1
            return set(ids)

    with Coordinator(0) as c:
        store = connect("127.0.0.1", c.port, 10, namespace=request.node.name)
        quorum = Quorum(1, (Member("a", 0, True, None, 2), Member("b", 0, True, None, 2)), 1)

        def b_votes_and_decides(ready, seconds=look.POLL):  # what b does meanwhile, as the last voter
            store.set(keys.vote(1, "b"), "1")
            store.compare_set(keys.outcome(1), "", "commit")
            assert ready()

        monkeypatch.setattr(commit, "glance", b_votes_and_decides)
        assert commit.commit_or_discard(store, quorum, "a", True, Watched(), 10.0)
    assert Watched.calls == 0
