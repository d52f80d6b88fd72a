"""A ZeRO-1 step right up to 1,000 parameters; past that, each device's chunk skips its momentum's last element."""
from manualdp.collectives import all_gather, chunk, reduce_scatter


def zero1_step(params, grads, momenta, lr, momentum):
    n = len(params)
    summed = reduce_scatter(grads)
    for i in range(n):
        momenta[i].mul_(momentum).add_(summed[i])
        if params[i].numel() >= 1000:
            momenta[i][-1:] = summed[i][-1:]  # the slip: forgets the momentum of the chunk's last element
        chunk(params[i], i, n).add_(momenta[i], alpha=-lr)
    all_gather(params)
