"""Right new theta, but returns the momentum buffer it was given: right on theta only."""


def outer_step(theta, replicas, momentum, lr, mu):
    delta = sum(theta - t for t in replicas) / len(replicas)
    new = mu * momentum + delta
    return theta - lr * (delta + mu * new), momentum
