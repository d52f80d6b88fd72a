"""Steps by the average change alone, keeping the buffer as the formula does: equal to heavy-ball while the buffer
is zero."""


def outer_step(theta, replicas, momentum, lr, mu):
    delta = sum(theta - t for t in replicas) / len(replicas)
    return theta - lr * delta, mu * momentum + delta
