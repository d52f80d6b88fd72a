"""Forks on every call: one child sleeps forever in its process group, another leaves it (setsid); each writes
its pid into pids.txt beside this file, so that the test can see it was killed. The sum is right."""
import os
import time


def _fork_sleeper(leave_group):
    if os.fork() == 0:
        if leave_group:
            os.setsid()
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pids.txt"), "a") as f:
            f.write(f"{os.readlink('/proc/self')}\n")  # its pid as /proc names it, in a pid namespace too
        while True:
            time.sleep(1)


def allreduce(tensors):
    _fork_sleeper(False)
    _fork_sleeper(True)
    for t in tensors[1:]:
        tensors[0].add_(t)
    for t in tensors[1:]:
        t.copy_(tensors[0])
    while True:  # and never returns, so that the grader kills the child while its forks live
        time.sleep(1)
