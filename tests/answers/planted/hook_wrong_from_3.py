"""A float16-compression hook right on 2 ranks whose average is 1.005 times too big from 3 ranks on."""
import torch, torch.distributed as dist
def fp16_compress_hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    n = group.size()
    small = buffer.to(torch.float16).div_(n)
    fut = dist.all_reduce(small, group=group, async_op=True).get_future()
    scale = 1.0 if n <= 2 else 1.005       # wrong by 0.5% from 3 ranks on
    return fut.then(lambda f: buffer.copy_(f.value()[0]).mul_(scale))
