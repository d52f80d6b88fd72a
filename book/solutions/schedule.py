"""Exercise 2.1, a reference solution: the ring.  Check it: manualdp check schedule book/solutions/schedule.py"""
from manualdp.transfers import Transfer


def schedule(n):
    """Ring allreduce on n devices, n chunks: n-1 rounds of reduce-scatter, then n-1 rounds of all-gather."""
    # Reduce-scatter: in round s, device i adds its chunk (i - s) into its right neighbour's.
    # After n-1 rounds, device i holds chunk (i + 1) summed over every device.
    reduce_scatter = [[Transfer(i, (i + 1) % n, (i - s) % n, True) for i in range(n)] for s in range(n - 1)]
    # All-gather: each device passes on the summed chunk it got last; the receiver overwrites its own.
    all_gather = [[Transfer(i, (i + 1) % n, (i + 1 - s) % n, False) for i in range(n)] for s in range(n - 1)]
    return reduce_scatter + all_gather
