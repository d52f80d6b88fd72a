import contextlib
import importlib
import signal

import pytest
import torch
from hypothesis import settings

# Tests run on 2 cores next to multi-process tests; one thread per process keeps them fair.
torch.set_num_threads(1)
settings.register_profile("ci", deadline=None, max_examples=30)
settings.load_profile("ci")

# The ranks that tests launch import these as well: the fork server imports them once for all.
importlib.import_module("manualdp.spmd.launch").PRELOAD.extend(["pytest", "hypothesis", "tests.helpers"])


@pytest.fixture
def deadline():
    """`with deadline(seconds):` fails the test with TimeoutError where a call hangs (a FIFO read, a runaway loop)."""
    @contextlib.contextmanager
    def within(seconds: int):
        def stop(*_):
            raise TimeoutError(f"took more than {seconds} s")
        previous = signal.signal(signal.SIGALRM, stop)
        signal.alarm(seconds)
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
    return within
