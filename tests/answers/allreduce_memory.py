"""Asks for far more memory than the grader allows."""
import torch


def allreduce(tensors):
    hog = torch.ones(1 << 40, dtype=torch.uint8)
    tensors[0].add_(hog[0])
