"""Exercise 6.2, a reference solution.  Check it: manualdp check zero1 book/solutions/zero1.py"""
from manualdp.collectives import all_gather, chunk, reduce_scatter


def zero1_step(params, grads, momenta, lr, momentum):
    """One step of SGD with momentum, ZeRO-1's way: device i keeps the momentum of its own chunk only."""
    n = len(params)
    summed = reduce_scatter(grads)  # device i: the sum over the devices of its own chunk
    for i in range(n):
        momenta[i].mul_(momentum).add_(summed[i])  # b = momentum * b + g, as torch's SGD
        chunk(params[i], i, n).add_(momenta[i], alpha=-lr)  # step only the chunk you own
    all_gather(params)  # then every device gets every updated chunk
