"""Raises KeyboardInterrupt, as if Ctrl-C had been pressed."""


def allreduce(tensors):
    raise KeyboardInterrupt
