"""Rung 5: `DistributedDataParallel`, the drop-in for torch's, allreducing with manualdp's schedules.

- `wrapper.py`: the wrapper: its arguments checked once, forward, `no_sync`, copies, and the
  ordered list of its features;
- `reducer.py`: rung 4's buckets (`bucket.py`: the ladder's bucket plus two flags per parameter),
  filled by the gradient hooks and reduced on the group's worker during backward;
- one file per feature, each an object whose named hooks the reducer calls in list order:
  `step_check.py` (the ranks compare each step's calls; debug mode), `buffers.py` (rank 0's
  buffers before forward), `graph.py` (unused parameters, static graph), `comm_hook.py`
  (torch's comm hooks), `join.py` (uneven inputs), `private.py` (torch's private methods that
  its tests call), `init_sync.py` (what the ranks compare and copy at construction).
"""
from .wrapper import DistributedDataParallel, NoParametersError

__all__ = ["DistributedDataParallel", "NoParametersError"]
