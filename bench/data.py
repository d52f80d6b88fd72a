"""Data time per rank: whole global batches sliced, against only the rank's own shard.

    python bench/data.py --world-sizes 2 4 --rounds 3
"""
from manualdp.benchmarks.data import main

if __name__ == "__main__":
    raise SystemExit(main())
