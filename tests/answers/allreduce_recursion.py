"""Recurses without end."""


def allreduce(tensors):
    return allreduce(tensors)
