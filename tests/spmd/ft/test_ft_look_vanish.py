"""A key deleted between a look's `check` and its `multi_get` (`Look.prefetch`): a short wait, one line, right values.

torch's `multi_get` waits for a missing key up to the client's timeout (60 s by default): before, a
stranger who deleted a key at that moment stalled the quorum's ask a whole store timeout, silently.
"""
import datetime
import logging

import pytest

from manualdp.spmd.ft import Coordinator
from manualdp.spmd.ft.coordinator import connect
from manualdp.spmd.ft.look import VANISH, look

TOKEN = "vanish-secret-of-twenty-chars"
STORE_TIMEOUT = 4.0  # the connection's own timeout: what the multi_get waited before


@pytest.fixture(scope="module", params=["open", "signed"])
def connected(request):
    token = TOKEN if request.param == "signed" else None
    with Coordinator(0, token=token) as c:
        yield lambda name: connect("127.0.0.1", c.port, STORE_TIMEOUT, token, namespace=name)


class DeletingOnRead:
    """A store client whose `multi_get` sees `victim` deleted first (a stranger's delete right after the check)."""

    def __init__(self, client, victim: str) -> None:
        self.client, self.victim, self.waits = client, victim, []

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def multi_get(self, names: list[str]):
        self.waits.append(self.client.timeout.total_seconds())  # how long this multi_get may wait for a key
        self.client.delete_key(self.victim)
        return self.client.multi_get(names)


@pytest.mark.parametrize("victim", ["committed", "settings", "round/1/quorum"])
def test_a_key_deleted_before_the_multi_get_costs_a_short_wait_and_one_line(connected, request, caplog, victim):
    store = connected(request.node.name)
    names = ["round/2/asks", "committed", "settings", "round/1/quorum"]
    for key in names:
        store.set(key, key.encode())
    deleting = store._client.raw = DeletingOnRead(store._client.raw, store._name(victim))
    with caplog.at_level(logging.WARNING, logger="manualdp.spmd.ft"):
        view = look(store)
        view.prefetch(names)
        values = [view.peek(key) for key in names]
        look(store).prefetch(names)  # another look, the key still gone: no multi_get (the check says so), no line
    assert deleting.waits == [VANISH] and VANISH < STORE_TIMEOUT  # was: the store's whole timeout
    assert store._client.timeout == datetime.timedelta(seconds=STORE_TIMEOUT)  # the connection's own, put back
    assert values == [None if key == victim else key.encode() for key in names]  # each key read alone
    lines = [r.getMessage() for r in caplog.records if "deleted between its check and its read" in r.getMessage()]
    assert len(lines) == 1 and victim in lines[0], lines


class Reading:
    """A store client that lists the size of each `multi_get`."""

    def __init__(self, client) -> None:
        self.client, self.reads = client, []

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def multi_get(self, names: list[str]):
        self.reads.append(len(names))
        return self.client.multi_get(names)


def test_keys_that_stay_are_read_in_one_multi_get_and_the_connections_timeout_is_put_back(connected, request):
    store = connected(request.node.name)
    names = ["a", "b", "c"]
    for key in names:
        store.set(key, key * 2)
    reading = store._client.raw = Reading(store._client.raw)
    view = look(store)
    view.prefetch(names)
    assert [view.peek(k) for k in names] == [b"aa", b"bb", b"cc"] and reading.reads == [3]  # no read after it
    assert store._client.timeout == datetime.timedelta(seconds=STORE_TIMEOUT)
