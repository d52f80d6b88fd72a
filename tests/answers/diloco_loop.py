"""Loops forever on 3 replicas or more."""


def outer_step(theta, replicas, momentum, lr, mu):
    while len(replicas) >= 3:
        pass
    delta = sum(theta - t for t in replicas) / len(replicas)
    momentum = mu * momentum + delta
    return theta - lr * (delta + mu * momentum), momentum
