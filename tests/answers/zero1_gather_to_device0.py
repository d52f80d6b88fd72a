"""A wrong answer to exercise 6.2: each device steps its own chunk, then sends it to device 0 only (a gather, not an
all-gather): device 0 holds the whole updated model, the others only their own chunk of it."""
from manualdp.collectives import chunk, reduce_scatter


def zero1_step(params, grads, momenta, lr, momentum):
    n = len(params)
    summed = reduce_scatter(grads)
    for i in range(n):
        momenta[i].mul_(momentum).add_(summed[i])
        chunk(params[i], i, n).add_(momenta[i], alpha=-lr)
    for i in range(1, n):
        chunk(params[0], i, n).copy_(chunk(params[i], i, n))
