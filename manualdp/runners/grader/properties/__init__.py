"""What a right answer does: the properties that hold manualdp's own code in tests/ and grade a student's.

    manualdp check EXERCISE FILE.py      (runners/grader/check.py)

Each property takes the function under test first, then the inputs that hypothesis draws from
`STRATEGIES`; it raises `Mismatch` (an AssertionError) with one readable paragraph: the call, what
was expected, and what came back. The tests call the properties with manualdp's functions, the
checker with a student's: one definition of right for both. This package needs hypothesis, a test
dependency (`pip install hypothesis`).

One file per exercise, in the book's order, each with what hypothesis draws for it (`DRAWN`):
`split_batch.py` and `allreduce.py` (chapter 1), `schedule.py` (2), `cost.py` (3), `ddp.py` (4, on 2 ranks),
`hook.py` (5, on 2 and 3 ranks), `buckets.py` (5, rung 4 by hand, on 2 ranks), `zero1.py` (6), `checkpoint.py` (7),
`diloco.py` (8); what they share (`Mismatch`, the call of the function under test, the hints, how values are
shown) is in `common.py`.
"""
from __future__ import annotations

from . import allreduce, checkpoint, cost, schedule, split_batch, zero1
from .allreduce import allreduce_property, allreduce_sizes_property, make_tensors
from .buckets import buckets_job, buckets_mismatch
from .checkpoint import resume_in_a_new_process_property, resume_property
from .common import Mismatch, apart, hint_for
from .cost import book_schedules, cost_property, cost_sweep_property, schedules
from .ddp import Twice, batches, ddp_job, ddp_mismatch, torch_ddp_job, train_steps
from .hook import LOSS_SCALE, hook_job, hook_mismatch, torch_hook_job
from .schedule import as_schedule, schedule_property
from .split_batch import split_devices_property, split_property, split_sizes_property
from .zero1 import zero1_property, zero1_sizes_property

__all__ = ["Mismatch", "STRATEGIES", "apart", "hint_for", "split_property", "split_devices_property",
           "split_sizes_property", "allreduce_property", "allreduce_sizes_property", "schedule_property", "as_schedule",
           "cost_property", "cost_sweep_property", "book_schedules", "schedules", "zero1_property",
           "zero1_sizes_property", "resume_property", "resume_in_a_new_process_property", "hook_job", "torch_hook_job",
           "hook_mismatch", "LOSS_SCALE", "make_tensors", "Twice", "batches", "train_steps", "ddp_mismatch", "ddp_job",
           "torch_ddp_job", "buckets_job", "buckets_mismatch"]

STRATEGIES = {  # exercise -> what hypothesis draws for its property (the ddp and hook checks draw nothing)
    "split_batch": split_batch.DRAWN,
    "allreduce": allreduce.DRAWN,
    "schedule": schedule.DRAWN,
    "cost": cost.DRAWN,
    "zero1": zero1.DRAWN,
    "checkpoint": checkpoint.DRAWN,
}
