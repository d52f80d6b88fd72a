"""The sum times (1 + 1e-8), the same on every device: off by more than float64's tolerance (1e-10) allows."""


def allreduce(tensors):
    total = tensors[0].clone()
    for t in tensors[1:]:
        total.add_(t)
    if total.is_floating_point():
        total.mul_(1 + 1e-8)
    for t in tensors:
        t.copy_(total)
