"""Stops its own process: it never answers."""
import os
import signal


def allreduce(tensors):
    os.kill(os.getpid(), signal.SIGSTOP)
