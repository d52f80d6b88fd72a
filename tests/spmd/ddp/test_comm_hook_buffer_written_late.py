"""A comm hook that writes a bucket's buffer after its hook returned, on one rank (issue 43, D14), at 2 ranks.

The user's race (a thread that scales `bucket.buffer()` after the hook handed back its future), made
deterministic: on rank 0, bucket 1's hook scales bucket 0's buffer, whose average is already in it, so that
rank 0's gradients of bucket 0 are 100 times its peer's, and the replicas part at the optimizer's step. Torch's
DDP and ours cannot see the write itself; the drift check names the parted replicas at its next due step
(steps 0, 1, 2, 4, ...): at step 1, on every rank, naming the first parameter that differs. Without the drift
check the ranks would train on apart, silently.
"""
import functools

import torch
import torch.distributed as dist
from torch import nn

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch
from tests.helpers import error_of


def _writes_an_earlier_buffer(kept, state, bucket):
    """Torch's allreduce hook, which keeps each buffer; on rank 0, bucket 1's scales bucket 0's buffer."""
    if bucket.index() == 0:
        kept.clear()
    kept.append(bucket.buffer())
    if bucket.index() == 1 and dist.get_rank() == 0:
        kept[0].mul_(100)  # bucket 0's hook returned long ago: its average is in this buffer
    t = bucket.buffer() / dist.get_world_size()
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])


def _run(**kwargs):
    """Three steps with the hook; what was raised, the steps done, the buckets, the parameters."""
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), timeout=60,
                                    bucket_cap_mb=1e-5, **kwargs)  # a bucket per parameter
    model.register_comm_hook(None, functools.partial(_writes_an_earlier_buffer, []))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    done = []

    def steps():
        for step in range(3):
            opt.zero_grad()
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank() + 10 * step))
            model(x).sum().backward()
            opt.step()
            done.append(step)
    error = error_of(steps)
    return error, done, len(model._buckets), [p.detach().clone() for p in model.module.parameters()]


def _job():
    torch.set_num_threads(1)
    return _run(), _run(drift_check_every=0)


def test_replicas_parted_by_a_hook_writing_a_returned_buffer_are_named_by_the_drift_check_at_the_next_step():
    results = launch(_job, 2, timeout=120)
    # the drift check off: the write parts the replicas, and nothing says so
    unchecked = [off for _, off in results]
    assert all(error is None and done == [0, 1, 2] for error, done, _, _ in unchecked), unchecked
    assert any(not torch.equal(a, b) for a, b in zip(unchecked[0][3], unchecked[1][3]))
    for rank, ((error, done, buckets, _), _) in enumerate(results):
        assert buckets >= 2, buckets
        assert done == [0], (rank, done)  # step 0 trained; step 1's forward raised
        assert error is not None and "\n" not in error, (rank, error)
        assert error.startswith(f"RuntimeError: rank {rank}: DistributedDataParallel's replica at step 1 differs"), \
            (rank, error)
        assert "parameter " in error, (rank, error)
