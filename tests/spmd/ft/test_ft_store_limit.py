"""A value too large for torch's store is refused when it is written, in one line naming the key, its size, the limit.

Before (adversary's S10): torch's TCPStore server takes at most 8 MiB in one buffer of a write; a larger one
closed the writer's connection, so the write itself, and every call after it on that connection, read as
`StoreLost` ("lost the coordinator ... Connection reset by peer"): a replica left saying its coordinator was gone
while it ran on. Now `SignedStore.set`, `append` and `compare_set` refuse the write before sending it, in the open
and the signed mode (whose seal, and an appended chunk's hex, make the bytes sent larger than the value), and the
connection goes on serving.
"""
import pytest

from manualdp.spmd.ft import Coordinator
from manualdp.spmd.ft.coordinator import connect
from manualdp.spmd.ft.signed_store import LIMIT

TOKEN = "a-secret-of-the-run-0123456789"


@pytest.fixture(scope="module", params=["open", "signed"])
def store(request):
    token = TOKEN if request.param == "signed" else None
    with Coordinator(0, token=token) as c:
        yield connect("127.0.0.1", c.port, 5, token=token, namespace="limit")


def _refused(store, write, key: str, sent: int) -> None:
    with pytest.raises(ValueError) as e:
        write()
    said = str(e.value)
    assert said.startswith(f"the value of {key!r} is {sent} bytes") and f"over the {LIMIT} bytes" in said, said
    assert "TCPStore" in said and "\n" not in said, said
    store.set("after", "still here")  # the connection was not closed
    assert store.get("after") == b"still here"


def test_a_value_over_the_stores_limit_is_refused_at_the_write_and_the_connection_goes_on(store):
    seal = 9 + 32 if store.signed else 0  # kind, length, MAC
    fits = b"x" * (LIMIT - seal)
    store.set("fits", fits)
    assert store.get("fits") == fits
    _refused(store, lambda: store.set("big", fits + b"x"), "big", LIMIT + 1)
    _refused(store, lambda: store.compare_set("big", "", fits + b"x"), "big", LIMIT + 1)
    _refused(store, lambda: store.compare_set("fits", fits + b"x", b"1"), "fits", LIMIT + 1)
    assert not store.check(["big"]) and store.get("fits") == fits, "nothing was written"


def test_an_appended_chunk_over_the_limit_is_refused_and_a_value_grown_past_it_by_appends_reads_back(store):
    chunk = LIMIT // 2 if store.signed else LIMIT + 1  # a signed chunk is sent as hex: twice its size, and a line
    sent = 2 * chunk + len("\nA  \n") + 2 * 32 if store.signed else chunk  # "\nA <mac hex> <hex>\n"
    _refused(store, lambda: store.append("grown", b"y" * chunk), "grown", sent)
    for _ in range(3):  # torch's limit is on one write: a value grown past it by appends is read whole
        store.append("grown", b"y" * (LIMIT // 4))
    assert store.get("grown") == b"y" * (3 * (LIMIT // 4))
