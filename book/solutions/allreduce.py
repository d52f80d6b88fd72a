"""Exercise 1.2, a reference solution.  Check it: manualdp check allreduce book/solutions/allreduce.py"""


def allreduce(tensors):
    """Sum `tensors` (one per device) in place: add everything into device 0, then copy the sum back."""
    for i in range(1, len(tensors)):
        tensors[0].add_(tensors[i].to(tensors[0].device))
    for i in range(1, len(tensors)):
        tensors[i].copy_(tensors[0])  # in place: `tensors[i] = ...` would only change the list
