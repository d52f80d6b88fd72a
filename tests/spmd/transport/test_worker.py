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


def test_run_here_runs_in_the_callers_thread_only_once_every_earlier_call_has_ended(worker):
    gate, ran = threading.Event(), []
    blocked = worker.submit(gate.wait, 10) if isinstance(worker, SerialWorker) else None
    behind = worker.run_here(lambda: ran.append(threading.current_thread()))  # the thread is busy: queued behind
    gate.set()
    behind.result(timeout=10)
    here = worker.run_here(lambda: ran.append(threading.current_thread()))
    assert here.done()  # ran before run_here returned
    assert ran[1] is threading.current_thread()
    assert (ran[0] is threading.current_thread()) == (blocked is None)  # in order: on the thread, after the wait


def test_a_failure_run_here_makes_every_later_call_fail_with_it(worker):
    failed = worker.run_here(_fail)
    with pytest.raises(OSError, match="boom"):
        failed.result(timeout=10)
    with pytest.raises(OSError, match="boom"):
        worker.submit(lambda: 7).result(timeout=10)
    with pytest.raises(OSError, match="boom"):
        worker.run_here(lambda: 7).result(timeout=10)


def test_a_refusal_run_here_leaves_the_worker_serving(worker):
    with pytest.raises(ValueError, match="refused this call alike"):
        worker.run_here(_refuse).result(timeout=10)
    assert worker.run_here(lambda: 7).result(timeout=10) == 7
    assert worker.submit(lambda: 8).result(timeout=10) == 8
