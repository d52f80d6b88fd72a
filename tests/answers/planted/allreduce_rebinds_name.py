"""Computes the sum, then gives the loop's name the sum: no device's tensor is written into."""


def allreduce(tensors):
    total = sum(tensors)
    for t in tensors:
        t = total  # noqa: F841 (the slip: rebinds t, writes nothing)
