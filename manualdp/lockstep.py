"""Devices side by side in one process: one thread per device, meeting at every collective.

`train_batch` runs the devices one after another, which is enough when the collectives come
after every device's backward. ZeRO-3 (`manualdp.zero3`) needs a collective *inside* the
forward and backward passes: no device can go on before every device has reached it. So
each device runs in its own thread, as torch's DataParallel runs its replicas, and a
collective is a meeting: every device asks for it, and the last one to arrive runs it for
all of them, on every device's tensors (the single controller's collectives).
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

__all__ = ["DeviceShard", "LockStep", "check_own_gpus"]


def check_own_gpus(devices: list[torch.device]) -> None:
    """Refuse two devices on one GPU: autograd runs a GPU's backward on one thread of its own, so a device
    waiting there for the others would stop their backward too, and no one would arrive."""
    gpus = [d for d in devices if d.type != "cpu"]
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"devices: side by side, every device needs a GPU of its own (or the CPU), got {gpus}")


class LockStep:
    """`num_devices` threads that meet at every collective; `run(work)` runs `work(device)` in each."""

    def __init__(self, num_devices: int) -> None:
        self.num_devices = num_devices
        self.asked: list = [None] * num_devices  # what each device asked for at the meeting under way
        self.barrier = threading.Barrier(num_devices, action=self._run)
        self.log: list = []                       # what every meeting ran, in order

    def meet(self, device: int, what, run: Callable[[], None]) -> None:
        """Wait until every device has asked for `what`; then `run()` has run once, for all of them."""
        self.asked[device] = (what, run)
        self.barrier.wait()

    def _run(self) -> None:  # called by the last device to arrive, while the others wait
        whats = [what for what, _ in self.asked]
        if any(what != whats[0] for what in whats):
            raise RuntimeError(f"the devices reached different collectives ({', '.join(map(str, whats))}): every "
                               "device must run the same modules in the same order")
        self.log.append(whats[0])
        self.asked[0][1]()

    def run(self, work: Callable[[int], object]) -> list:
        """`work(device)` on every device in its own thread; their results, or the first real error raised."""
        results, errors = [None] * self.num_devices, [None] * self.num_devices

        def one(device: int) -> None:
            try:
                results[device] = work(device)
                self.meet(device, "end", lambda: None)  # a device that skipped a collective is caught here
            except BaseException as e:  # noqa: BLE001 (re-raised below, in the caller's thread)
                errors[device] = e
                self.barrier.abort()  # the others stop waiting for this device: BrokenBarrierError

        # daemon: a device stuck in a model's own code cannot keep the interpreter from exiting
        threads = [threading.Thread(target=one, args=(d,), name=f"device {d}", daemon=True)
                   for d in range(self.num_devices)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        raised = [e for e in errors if e is not None]
        real = [e for e in raised if not isinstance(e, threading.BrokenBarrierError)]
        if raised:
            raise (real or raised)[0]
        return results


class DeviceShard:
    """Device `device`'s view of a ShardedOptimizer (`manualdp.zero`): `step` on the last device runs the step.

    The single controller steps the devices one after another; the collectives need every
    device's gradients at once, so the step waits until every device has asked for it.
    Checkpoints hold the whole optimizer (`zero.state_dict()`), never one device's handle.
    """

    def __init__(self, zero, device: int) -> None:
        self.zero, self.device = zero, device
        self.reduces_gradients = zero.reduces_gradients

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad_on(self.device, set_to_none)

    def step(self) -> None:
        self.zero._stepped.add(self.device)
        if len(self.zero._stepped) == self.zero.num_devices:
            self.zero._stepped.clear()
            self.zero.step()
