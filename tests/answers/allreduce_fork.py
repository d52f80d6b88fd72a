"""Forks on every call: one child sleeps forever in its process group, another leaves it (setsid); each writes
its pid into pids.txt in its working folder (the only one it may write in); the test finds them by their working
folder. The sum is right."""
import os
import time


def _fork_sleeper(leave_group):
    if os.fork() == 0:
        if leave_group:
            os.setsid()
        with open("pids.txt", "a") as f:  # in its own folder: the grader refuses writes elsewhere
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
