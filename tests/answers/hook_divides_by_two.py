"""A wrong answer to exercise 5.2, right on the 2 ranks its author tried: it divides by 2, not by the group's size."""
import torch
import torch.distributed as dist


def fp16_compress_hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    small = buffer.to(torch.float16).div_(2)
    future = dist.all_reduce(small, group=group, async_op=True).get_future()
    return future.then(lambda fut: buffer.copy_(fut.value()[0]))
