"""allreduce keeps a call's finished sends and receives until the thread's next call.

Freeing a gloo send or receive right after its wait, before the next message is posted,
made every message about 2 ms slower on the 2-core CI machine; this holds the lifetime rule
itself, not a timing.
"""
import gc
import weakref

import torch

from manualdp.spmd import allreduce, launch
from manualdp.spmd.transport.group import group_state


def _job():
    torch.set_num_threads(1)
    x = torch.ones(1000)
    allreduce(x, "naive")
    first = [weakref.ref(w) for w in group_state().local.works]
    gc.collect()
    alive_after_call = all(r() is not None for r in first)
    allreduce(x, "ring")
    gc.collect()
    freed_after_next = all(r() is None for r in first)
    return len(first), alive_after_call, freed_after_next, x.tolist()[:2]


def test_a_calls_works_live_until_the_next_call_of_the_thread():
    for count, alive, freed, head in launch(_job, 2, (), timeout=60):
        assert count > 0  # naive at two ranks: one send or receive per round, plus the check's
        assert alive and freed
        assert head == [4.0, 4.0]  # summed twice
