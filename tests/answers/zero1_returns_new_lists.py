"""A wrong answer to exercise 6.2: returns the new parameters and momenta, and changes nothing in place."""
from manualdp.collectives import all_gather, chunk, reduce_scatter


def zero1_step(params, grads, momenta, lr, momentum):
    n = len(params)
    summed = reduce_scatter(grads)
    new_momenta = [momentum * momenta[i] + summed[i] for i in range(n)]
    new_params = [p.clone() for p in params]
    for i in range(n):
        chunk(new_params[i], i, n).add_(new_momenta[i], alpha=-lr)
    all_gather(new_params)
    return new_params, new_momenta
