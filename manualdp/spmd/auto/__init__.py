"""`algorithm="auto"`: measure the link, and let the cost model pick a schedule, as NCCL's tuner does.

- `pick.py`: the cost model's prediction for each schedule on a `Link` (alpha, beta, gamma);
- `tune.py`: fitting the link's constants on the ranks, agreeing on them, noticing drift;
- `link_cache.py`: measured constants kept on disk between runs.
"""
