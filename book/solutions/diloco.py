"""Exercise 8.1, a reference solution.  Check it: manualdp check diloco book/solutions/diloco.py"""
import torch


def outer_step(theta, replicas, buffer, lr, momentum):
    """DiLoCo's outer step: Nesterov SGD on the average change; returns (new theta, new momentum buffer)."""
    delta = sum(theta - t for t in replicas) / len(replicas)  # the outer gradient: the average change
    b = momentum * buffer + delta  # torch's SGD: `momentum` is the coefficient, `b` its momentum_buffer
    return theta - lr * (delta + momentum * b), b


if __name__ == "__main__":
    theta = torch.zeros(3, dtype=torch.float64)
    print(outer_step(theta, [theta - 1, theta - 3], torch.zeros(3, dtype=torch.float64), 0.7, 0.9))
