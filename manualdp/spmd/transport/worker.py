"""The group's ordered worker: one daemon thread that runs collectives in submission order, or none at one rank.

A wrapper queues its collectives here (`group.GroupState.worker`): the buckets during
backward, the step's call check. The thread is a daemon (`SerialWorker`): at exit a failing
process waits at most `EXIT_GRACE` (2 s) for it, never for a whole timeout. A group of one
rank sends nothing, so its calls run at once in the caller's thread (`InlineWorker`). Either
way, after a call fails every later one fails with the same error, unless every rank refused
it alike before any data moved (`peers.refused_alike`). Deadlines and `PeerError` are in
`peers.py`; what a group keeps, its worker among them, in `group.py`.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import queue
import threading
import time

from .peers import is_refused_alike

__all__ = ["SerialWorker", "InlineWorker", "EXIT_GRACE"]


class SerialWorker:
    """One daemon thread that runs submitted calls in order and hands back futures.

    Why not a ThreadPoolExecutor: its threads are joined at interpreter exit, so a rank whose
    main thread fails while an allreduce waits for a silent peer would hang there for the
    whole timeout (gloo's waits cannot be interrupted). A daemon thread does not hold the exit
    back; but one that comes back from C++ while Python finalizes aborts the process
    ("terminate called without an active exception"), so at exit `_drain` lets running calls
    finish for up to `EXIT_GRACE` seconds and starts no new ones. After a call fails, every
    later one fails at once with the same error: the ranks are out of step for good. Not after a
    call that every rank refused alike before any data moved (`peers.refused_alike`): the group is
    well, and the next call runs.
    """

    def __init__(self, name: str, initializer=None) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # The thread gets the queue, not self: the owner can be collected while the thread waits.
        self._thread = threading.Thread(target=_serve, args=(self._jobs, initializer), name=name, daemon=True)
        with _state:
            _threads[self._thread] = self._jobs
        self._thread.start()

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def shutdown(self) -> None:
        """Let the thread end once the calls already submitted are done."""
        self._jobs.put(None)

    def is_current(self) -> bool:
        """Whether the caller runs on this worker's thread (a call submitted from there would wait on itself)."""
        return threading.current_thread() is self._thread

    def serving(self) -> bool:
        """Whether the thread still takes calls: not once it has ended, nor while the interpreter exits."""
        return self._thread.is_alive() and not _exiting


class InlineWorker:
    """`SerialWorker.submit` without a thread, for a group of one rank: each call runs at once, in the caller's thread.

    Nothing is sent at world size 1, so a thread would only add a hand-off per call. As on
    the thread, after a call fails every later one fails with the same error (unless every rank
    refused it alike, `peers.refused_alike`).
    """

    def __init__(self) -> None:
        self._failed: BaseException | None = None

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._failed is not None:
            future.set_exception(self._failed)
            return future
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # handed to whoever waits on the future, as the thread does
            self._failed = None if is_refused_alike(e) else e
            future.set_exception(e)
        return future

    def shutdown(self) -> None:
        pass


EXIT_GRACE = 2.0  # seconds the interpreter's exit waits for running calls (a healthy peer answers in far less)
_state = threading.Condition()  # guards the two below
_running = 0  # calls running on SerialWorker threads now
_exiting = False  # the interpreter is exiting: start no call
_threads: dict = {}  # live SerialWorker threads -> their job queues


@atexit.register
def _drain() -> None:
    """At exit: let running calls finish (up to EXIT_GRACE), then end the idle threads and join them.

    An idle thread left to the interpreter's finalization can wake up there (its owner's
    shutdown() from a late __del__) and abort the process, so it is ended here, while
    threads still work; a thread stuck in a wait on a dead peer is left behind, as a daemon.
    """
    global _exiting
    deadline = time.monotonic() + EXIT_GRACE
    with _state:
        _exiting = True
        _state.wait_for(lambda: _running == 0, timeout=EXIT_GRACE)
        threads = list(_threads.items())
    for thread, jobs in threads:
        jobs.put(None)
    for thread, _ in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _serve(jobs: queue.SimpleQueue, initializer) -> None:
    try:
        if initializer is not None:
            initializer()
        failed: BaseException | None = None
        while (job := jobs.get()) is not None:
            failed = _run(job, failed)
            job = None  # do not keep the last bucket alive while idle
    finally:
        with _state:
            _threads.pop(threading.current_thread(), None)


def _run(job, failed: BaseException | None) -> BaseException | None:
    """Run one submitted call unless an earlier one failed; return the first failure so far."""
    global _running
    future, fn, args, kwargs = job
    if not future.set_running_or_notify_cancel():
        return failed
    with _state:
        if failed is None and _exiting:
            failed = RuntimeError("not started: the interpreter is exiting")
        if failed is None:
            _running += 1
    if failed is not None:
        future.set_exception(failed)
        return failed
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as e:  # handed to whoever waits on the future
        future.set_exception(e)
        return None if is_refused_alike(e) else e
    finally:
        with _state:
            _running -= 1
            _state.notify_all()
    return None
