"""Exercise 5.2, a reference solution.  Check it: manualdp check hook book/solutions/hook.py"""
import torch
import torch.distributed as dist


def fp16_compress_hook(process_group, bucket):
    """Average the bucket over the ranks, sending float16: divide first, so that the sum cannot overflow."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()  # the bucket's gradients, flat, float32
    small = buffer.to(torch.float16).div_(group.size())
    future = dist.all_reduce(small, group=group, async_op=True).get_future()

    def decompress(fut):
        return buffer.copy_(fut.value()[0])  # back to float32, into the bucket

    return future.then(decompress)
