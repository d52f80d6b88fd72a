"""The group's worker (`transport/worker.py`): calls run in order; a failure stops it for good, a refusal does not.

(tests/runners/test_train_spmd_faults.py holds that the queued calls behind a failure never run.)
"""
import threading

import pytest

from manualdp.spmd.transport.peers import refused_alike
from manualdp.spmd.transport.worker import InlineWorker, SerialWorker


def _refuse():
    raise refused_alike(ValueError("every rank refused this call alike"))


def _fail():
    raise OSError("boom")


@pytest.fixture(params=["serial", "inline"])
def worker(request):
    worker = SerialWorker("test") if request.param == "serial" else InlineWorker()
    yield worker
    worker.shutdown()


def test_calls_run_in_submission_order_on_one_thread(worker):
    ran = []
    futures = [worker.submit(lambda i=i: ran.append((i, threading.current_thread()))) for i in range(5)]
    for f in futures:
        f.result(timeout=10)
    assert [i for i, _ in ran] == list(range(5))
    assert len({thread for _, thread in ran}) == 1
    on_caller = ran[0][1] is threading.current_thread()
    assert on_caller == isinstance(worker, InlineWorker)  # the thread only where there are peers


def test_a_call_every_rank_refused_alike_leaves_the_worker_serving(worker):
    with pytest.raises(ValueError, match="refused this call alike"):
        worker.submit(_refuse).result(timeout=10)
    assert worker.submit(lambda: 7).result(timeout=10) == 7


def test_after_a_failure_every_later_call_fails_with_it(worker):
    with pytest.raises(OSError, match="boom"):
        worker.submit(_fail).result(timeout=10)
    with pytest.raises(OSError, match="boom"):
        worker.submit(lambda: 7).result(timeout=10)
