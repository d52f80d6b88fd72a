"""The fixtures of the fault-tolerance tests that run in this process: a coordinator, and connections to it."""
import pytest

from manualdp.spmd.ft import Coordinator
from manualdp.spmd.ft.coordinator import connect


@pytest.fixture(scope="module")
def coordinator():
    # One per file: torch's store, shut down while a connection is still open, stalls a new one
    # in this process for 5 s (libuv's "uv_loop_close failed ... EBUSY").
    with Coordinator(0) as c:
        yield c


def _connect(port: int, namespace: str):
    # torch's TCPStore client now and then takes 5 s to connect (about one in 20-25 connections of a process, idle
    # or loaded, libuv or not); two such stalls under load pass the 10 s each wait is given. The coordinator is up,
    # so a connection that failed is tried again: the test's waits keep their 10 s.
    for attempt in range(3):
        try:
            return connect("127.0.0.1", port, 10, namespace=namespace)
        except ConnectionError:
            if attempt == 2:
                raise


@pytest.fixture
def store(coordinator, request):
    """New connections to the coordinator, in a namespace of this test's own."""
    return lambda: _connect(coordinator.port, request.node.name)
