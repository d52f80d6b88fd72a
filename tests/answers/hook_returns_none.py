"""A wrong answer to exercise 5.2: starts the allreduce but returns nothing (torch's DDP crashes on None)."""
import torch
import torch.distributed as dist


def fp16_compress_hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    small = bucket.buffer().to(torch.float16).div_(group.size())
    dist.all_reduce(small, group=group, async_op=True)
