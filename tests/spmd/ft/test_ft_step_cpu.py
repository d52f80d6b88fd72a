"""The CPU a steady fault-tolerant step spends beyond the drop-in's, in counts (never times): issue 44's profile of
`bench/ft.py --models mlp --profile 300` (replica 0's ask thread, its bucket thread), each cut held here."""
import collections
import dataclasses
import json
import threading
import types

import torch

from manualdp.spmd.ft import Coordinator
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
