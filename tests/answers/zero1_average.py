"""A wrong answer to exercise 6.2: averages the gradients, which are already each shard's part of the global loss."""
from manualdp.collectives import all_gather, chunk, reduce_scatter


def zero1_step(params, grads, momenta, lr, momentum):
    n = len(params)
    summed = reduce_scatter(grads)
    for i in range(n):
        momenta[i].mul_(momentum).add_(summed[i] / n)
        chunk(params[i], i, n).add_(momenta[i], alpha=-lr)
    all_gather(params)
