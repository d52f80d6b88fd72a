"""Prints without end."""


def allreduce(tensors):
    while True:
        print("x" * 10000)
