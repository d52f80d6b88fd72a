"""Averages the change of the first 5 replicas only: right on 1 to 5 replicas, wrong from 6."""


def outer_step(theta, replicas, momentum, lr, mu):
    used = replicas[:5]
    delta = sum(theta - t for t in used) / len(used)
    momentum = mu * momentum + delta
    return theta - lr * (delta + mu * momentum), momentum
