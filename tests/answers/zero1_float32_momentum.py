"""A wrong answer to exercise 6.2: keeps the momentum in float32, right to 7 digits where the grader asks 10."""
from manualdp.collectives import all_gather, chunk, reduce_scatter


def zero1_step(params, grads, momenta, lr, momentum):
    n = len(params)
    summed = reduce_scatter(grads)
    for i in range(n):
        momenta[i].copy_((momentum * momenta[i].float() + summed[i].float()).double())
        chunk(params[i], i, n).add_(momenta[i], alpha=-lr)
    all_gather(params)
