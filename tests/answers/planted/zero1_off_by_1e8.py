"""A right ZeRO-1 step whose parameters end off by 1e-8 relative: more than the grader's tolerance (1e-10)."""
from manualdp.collectives import all_gather, chunk, reduce_scatter


def zero1_step(params, grads, momenta, lr, momentum):
    for i, (m, g) in enumerate(zip(momenta, reduce_scatter(grads))):
        m.mul_(momentum).add_(g)
        chunk(params[i], i, len(params)).add_(m, alpha=-lr)
    all_gather(params)
    for p in params:
        p.mul_(1 + 1e-8)  # the slip: every parameter off by 1e-8, relatively
