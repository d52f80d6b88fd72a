"""A wrong answer to exercise 5.2: returns the allreduce's own future, whose value is a list of float16 tensors, not
the bucket's float32 tensor (torch's DDP fails an internal assert on it)."""
import torch
import torch.distributed as dist


def fp16_compress_hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    small = bucket.buffer().to(torch.float16).div_(group.size())
    return dist.all_reduce(small, group=group, async_op=True).get_future()
