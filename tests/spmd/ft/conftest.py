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


@pytest.fixture
def store(coordinator, request):
    """New connections to the coordinator, in a namespace of this test's own."""
    return lambda: connect("127.0.0.1", coordinator.port, 10, namespace=request.node.name)
