"""One look at the store (`look.py`): each key read once per decision, a check and a get in one round trip."""
import collections
import time

import pytest

from manualdp.spmd.ft import Coordinator
from manualdp.spmd.ft.coordinator import connect
from manualdp.spmd.ft.look import Look, glance, peek

TOKEN = "look-secret-of-twenty-chars"


class Counting:
    """A store client that counts the calls (round trips) made through it."""

    def __init__(self, client) -> None:
        self.client, self.calls = client, collections.Counter()

    def __getattr__(self, name):
        method = getattr(self.client, name)
        if not callable(method):
            return method

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return method(*args, **kwargs)
        return counted


@pytest.fixture(scope="module", params=["open", "signed"])
def connected(request):
    token = TOKEN if request.param == "signed" else None
    with Coordinator(0, token=token) as c:
        yield lambda name: connect("127.0.0.1", c.port, 10, token, namespace=name)


def counted(store):
    store._client = Counting(store._client)
    return store._client.calls


def test_peek_is_one_round_trip_and_writes_nothing(connected):
    store = connected("peek")
    calls = counted(store)
    assert peek(store, "k") is None and store.peek("k") is None
    assert not store.check(["k"])  # peeking at a missing key did not create it
    store.set("k", "v")
    calls.clear()
    assert store.peek("k") == b"v"
    assert sum(calls.values()) == 1


def test_a_value_without_the_secret_peeks_as_absent(connected):
    store = connected("forged")
    store._client.set(store._name("k"), "forged")
    assert store.peek("k") == (None if store.signed else b"forged")  # the open mode reads values as they are


def test_a_look_reads_each_key_once_and_again_after_a_write(connected):
    store = connected("look")
    store.set("a", "1")
    calls = counted(store)
    view = Look(store)
    assert view.check(["a"]) and view.get("a") == b"1" and view.peek("a") == b"1"
    assert view.multi_get(["a"]) == [b"1"]
    assert not view.check(["missing"]) and view.peek("missing") is None
    assert sum(calls.values()) == 2  # one for "a", one for "missing"
    store.set("a", "2")  # another writer: this look keeps what it read
    assert view.get("a") == b"1"
    view.set("a", "3")  # its own write: read again
    assert view.get("a") == b"3"
    assert view.compare_set("a", "3", "4") == b"4" and view.get("a") == b"4"
    view.append("b", "x")
    assert view.get("b") == b"x"
    assert Look(store).get("a") == b"4"  # a new look reads everything again


def test_glance_stops_once_ready_or_after_its_seconds():
    seen = []
    start = time.monotonic()
    glance(lambda: seen.append(1) or len(seen) == 3, seconds=5.0)
    assert len(seen) == 3 and time.monotonic() - start < 5.0
    seen.clear()
    start = time.monotonic()
    glance(lambda: seen.append(1) and False, seconds=0.05)
    assert time.monotonic() - start >= 0.05 and seen
