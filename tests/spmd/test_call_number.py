"""One rank makes one allreduce more, of the same size as its peers' next one, and loses it to an error of its own
(here a failure planted in the executor, before any message): only the call number differs, and the next call
raises on every rank naming each rank's call number, with the tensors unchanged. A call counter that never
advances would let the ranks' next calls pair silently.
"""
import torch
import torch.distributed as dist

from manualdp.spmd import launch
from manualdp.spmd.transport.group import group_state
from tests.helpers import error_of


def _job(odd: int):
    import manualdp.spmd.collectives as collectives
    torch.set_num_threads(1)
    rank = dist.get_rank()
    t = torch.full((6,), float(rank + 1))
    collectives.allreduce(t, "ring", timeout=20)  # in step: the first call agrees
    before = group_state().calls
    if rank == odd:  # one call more on this rank, lost before anything was sent
        real = collectives.run_allreduce

        def lost(*args, **kwargs):
            raise RuntimeError("planted: this rank's call failed before sending")
        collectives.run_allreduce = lost
        extra = error_of(lambda: collectives.allreduce(t.clone(), "ring", timeout=20))
        collectives.run_allreduce = real
    else:
        extra = None
    kept = t.clone()
    out = {"extra": extra, "calls": (before, group_state().calls)}
    out["next"] = error_of(lambda: collectives.allreduce(t, "ring", timeout=20))
    out["unchanged"] = torch.equal(t, kept)
    return out


def test_a_rank_a_call_ahead_with_same_sized_calls_raises_on_every_rank_naming_the_call_numbers():
    for n, odd in ((2, 0), (3, 1)):
        results = launch(_job, n, (odd,), timeout=120)
        before = results[0]["calls"][0]
        numbers = [str(before + 1 + (r == odd)) for r in range(n)]
        for rank, out in enumerate(results):
            assert (out["extra"] is not None) == (rank == odd), out
            message = out["next"]
            assert message is not None and message.startswith(f"ValueError: rank {rank}: allreduce called "), message
            assert f"call {min(numbers)}..{max(numbers)} (per rank: {', '.join(numbers)})" in message, message
            assert "elements" not in message and "dtype" not in message, message  # the call number only
            assert out["unchanged"], rank
