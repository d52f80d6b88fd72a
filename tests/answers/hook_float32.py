"""A wrong answer to exercise 5.2: right average, but sent as float32: nothing is compressed."""
import torch.distributed as dist


def fp16_compress_hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer().div_(group.size())
    future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return future.then(lambda fut: fut.value()[0])
