"""A stranger who replays what it recorded: from another coordinator's life, an older heartbeat, a chunk it forged.

As in `test_ft_stranger.py`, the stranger holds a plain `TCPStore` client and no secret, and is
given every name (torch's store lists them). Here it replays values that were signed, once,
with the run's secret: each must be ignored, never end or steer the run.
"""
from __future__ import annotations

import datetime
import logging

import pytest
import torch.distributed as dist

from manualdp.spmd.ft import Coordinator
from manualdp.spmd.ft import keys
from manualdp.spmd.ft.coordinator import connect
from manualdp.spmd.ft.durable import committed_step, finished_at, mark_finished, record_committed
from manualdp.spmd.ft.heartbeat import Heartbeat, Liveness, register
from manualdp.spmd.ft.trust import checked_claims

from .harness import member

TOKEN = "a-secret-of-the-run-0123456789"


def stranger(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))


@pytest.mark.parametrize("port", ["same", "another"])
def test_nothing_signed_in_one_coordinators_life_verifies_in_the_next(port):
    """Case 8/9 of issue 42's adversary: a finished run, recorded and replayed, must not end the next run."""
    with Coordinator(0, token=TOKEN) as first:
        store = connect("127.0.0.1", first.port, 5, token=TOKEN, namespace="replay")
        record_committed(store, 7)
        mark_finished(store, 7)
        assert finished_at(store) == 7
        s = stranger(first.port)
        recorded = {k: s.get(k) for k in s.list_keys()}
        old_port = first.port
        del s, store
    with Coordinator(old_port if port == "same" else 0, token=TOKEN) as second:
        s = stranger(second.port)
        for k, v in recorded.items():
            if not s.check([k]):
                s.set(k, v)
        store = connect("127.0.0.1", second.port, 5, token=TOKEN, namespace="replay")
        assert finished_at(store) is None  # the run did not end: it was another life's
        assert committed_step(store) == 0


def test_a_replayed_leave_of_an_older_process_ejects_nobody():
    """B9 of issue 42: a -1 counts only under the nonce that moved last; an old process's, replayed, does not."""
    with Coordinator(0, token=TOKEN) as c:
        store = connect("127.0.0.1", c.port, 5, token=TOKEN, namespace="old-leave")
        name = store._name(keys.heartbeat("a"))
        register(store, "a")
        Heartbeat(store, "a", 0.05).stop(leave=True)  # the first process of "a" left: "NONCE0 -1", signed
        s = stranger(c.port)
        old_leave = s.get(name)
        register(store, "a")  # "a" started again: a new nonce
        beat = Heartbeat(store, "a", 0.05)
        liveness = Liveness(store, 5.0)
        try:
            assert liveness.live(["a"]) == {"a"}
            s.set(name, old_leave)  # signed with the secret, but under the old process's nonce
            assert liveness.live(["a"]) == {"a"}
            assert "a" not in liveness.left
        finally:
            beat.stop(leave=True)
        assert liveness.live(["a"]) == set()  # its own leave, under its current nonce, counts at once


def test_an_appended_chunk_with_a_wrong_mac_is_dropped_alone(caplog):
    """B15 of issue 42: a well-formed `A <mac> <hex>` line whose MAC does not verify adds nothing."""
    with Coordinator(0, token=TOKEN) as c:
        store = connect("127.0.0.1", c.port, 5, token=TOKEN, namespace="chunks")
        store.append(keys.REPLICAS, "a\n")
        forged = b"\nA " + (b"00" * 32) + b" " + b"evil\n".hex().encode() + b"\n"
        stranger(c.port).append(store._name(keys.REPLICAS), forged)
        store.append(keys.REPLICAS, "b\n")
        with caplog.at_level(logging.WARNING, "manualdp.spmd.ft"):
            assert store.get(keys.REPLICAS) == b"a\nb\n"
        assert any("does not carry this run's secret" in r.getMessage() for r in caplog.records)


def test_a_claim_is_checked_at_the_exact_committed_boundary():
    """B6 of issue 42: a holder may claim exactly the committed steps; one more and it is no source."""
    asks = {"at": member("at", step=5), "over": member("over", step=6), "behind": member("behind", step=4)}
    checked = checked_claims(None, asks, 5)
    assert {rid: m.synced for rid, m in checked.items()} == {"at": True, "over": False, "behind": True}
    assert checked_claims(None, asks, None) == asks  # no record (a fresh store): nothing to check against
