"""Heavy-ball momentum, theta - lr * b: equal to Nesterov with the old buffer while the buffer is zero."""


def outer_step(theta, replicas, momentum, lr, mu):
    delta = sum(theta - t for t in replicas) / len(replicas)
    momentum = mu * momentum + delta
    return theta - lr * momentum, momentum
