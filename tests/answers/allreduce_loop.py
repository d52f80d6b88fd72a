"""Loops forever."""


def allreduce(tensors):
    while True:
        pass
