"""The DDP ladder: four rungs, each the one below plus one idea, each training as torch's DDP does.

1. `naive.py`: after backward, one allreduce per parameter (d2l's algorithm across processes);
2. `flat.py`: one flat buffer per dtype, one allreduce;
3. `overlapped.py`: each parameter's allreduce starts as its gradient is ready, during backward;
4. `bucketed.py`: the book's buckets, each sent when full (`bucket.py`), overlapped with backward.
What every rung keeps, whatever it sends (the ranks agree at construction and at each step, rank 0's
buffers, parameters no rank used), is rung 1's base, `rules.Rung` (`rules.py`).
Rung 5, the drop-in, is the next room (`manualdp.spmd.ddp`): rung 4's buckets plus torch's features.
The ladder uses the collectives and the transport, nothing above them.
"""
from .naive import NaiveDDP
from .flat import FlatDDP
from .overlapped import OverlappedDDP
from .bucketed import BucketedDDP

__all__ = ["NaiveDDP", "FlatDDP", "OverlappedDDP", "BucketedDDP"]
