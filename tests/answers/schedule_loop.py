"""Loops forever."""


def schedule(n):
    while True:
        pass
