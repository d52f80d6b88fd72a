"""Allreduce benchmark on simulated devices: nccl-tests columns, bandwidth against memcpy, fitted cost model.

    python bench/allreduce.py --devices 4 --json allreduce.json --plot allreduce.png
"""
from manualdp.benchmarks.allreduce import main

if __name__ == "__main__":
    raise SystemExit(main())
