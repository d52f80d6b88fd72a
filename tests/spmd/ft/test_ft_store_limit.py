"""A value too large for torch's store is refused when it is written, in one line naming the key, its size, the limit.

Before (adversary's S10): torch's TCPStore server takes at most 8 MiB in one buffer of a write; a larger one
closed the writer's connection, so the write itself, and every call after it on that connection, read as
`StoreLost` ("lost the coordinator ... Connection reset by peer"): a replica left saying its coordinator was gone
while it ran on. Now `SignedStore.set`, `append` and `compare_set` refuse the write before sending it, in the open
and the signed mode (whose seal, and an appended chunk's hex, make the bytes sent larger than the value), and the
connection goes on serving. A recovery's state, which the store carries, was one write: a model of more than 8 MiB
could never be sent (`recovery.py` said "a few hundred MiB"); now it goes in pieces, each under the limit.
"""
import datetime

import pytest
import torch
import torch.distributed as dist

from manualdp.spmd.ft import Coordinator, keys
from manualdp.spmd.ft.coordinator import connect
from manualdp.spmd.ft.recovery import forget_state, receive_state, send_state
from manualdp.spmd.ft.signed_store import LIMIT

TOKEN = "a-secret-of-the-run-0123456789"


@pytest.fixture(scope="module", params=["open", "signed"])
def store(request):
    token = TOKEN if request.param == "signed" else None
    with Coordinator(0, token=token) as c:
        yield connect("127.0.0.1", c.port, 5, token=token, namespace="limit")


def test_a_signed_value_grown_past_the_limit_by_a_strangers_appends_is_named_at_the_swap_not_a_lost_store():
    with Coordinator(0, token=TOKEN) as c:
        store = connect("127.0.0.1", c.port, 5, token=TOKEN, namespace="grown")
        stranger = dist.TCPStore("127.0.0.1", c.port, is_master=False, timeout=datetime.timedelta(seconds=5))
        for _ in range(3):  # each append under the limit: the server takes it
            stranger.append(store._name("decided"), b"z" * (LIMIT // 2))
        with pytest.raises(ValueError) as e:  # first writer wins replaces a forged value: this one cannot be sent
            store.compare_set("decided", "", "mine")
        said = str(e.value)
        assert said.startswith(f"the value in place of 'decided' grew to {3 * (LIMIT // 2)} bytes") and \
            "stranger" in said and "\n" not in said, said
        store.set("after", "still here")  # the connection was not closed
        assert store.get("after") == b"still here"


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


def test_a_state_larger_than_one_write_is_sent_in_pieces_received_whole_and_forgotten_whole(store):
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(5 * LIMIT // 8)}, "step": 3}  # 2.5 times the limit in float32
    digest = send_state(store, 9, "a", state)
    pieces = [keys.state(9, "a")] + [f"{keys.state(9, 'a')}/{i}" for i in (1, 2)]
    assert store.check(pieces) and not store.check([f"{keys.state(9, 'a')}/3"]), "three pieces"
    got, received = receive_state(store, 9, "a", timeout=10)
    assert received == digest and got["step"] == 3 and torch.equal(got["model"]["w"], state["model"]["w"])
    small = send_state(store, 10, "a", {"step": 4})
    assert store.get(keys.state_sha256(10, "a")) == small.encode(), "one piece: the sum alone, as before"
    assert receive_state(store, 10, "a", timeout=10)[0] == {"step": 4}
    forget_state(store, 9, "a")
    assert not any(store.check([k]) for k in [*pieces, keys.state_sha256(9, "a")]), "every piece is gone"
