"""Kills its own process."""
import os
import signal


def allreduce(tensors):
    os.kill(os.getpid(), signal.SIGKILL)
