"""A wrong answer to exercise 6.2: each device steps its own chunk, and no one gathers the updated chunks."""
from manualdp.collectives import chunk, reduce_scatter


def zero1_step(params, grads, momenta, lr, momentum):
    n = len(params)
    summed = reduce_scatter(grads)
    for i in range(n):
        momenta[i].mul_(momentum).add_(summed[i])
        chunk(params[i], i, n).add_(momenta[i], alpha=-lr)
