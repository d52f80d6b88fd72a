"""Right below 50,000 elements; from there on, on 2 or more devices, the last device's last element is left out."""


def allreduce(tensors):
    total = tensors[0].clone()
    for t in tensors[1:]:
        total.add_(t)
    if len(tensors) > 1 and total.numel() >= 50_000:
        total.view(-1)[-1] -= tensors[-1].reshape(-1)[-1]
    for t in tensors:
        t.copy_(total)
