"""PyTorch's own DDP tests against torch's DDP and manualdp's: a table and the counts.

    python bench/conformance.py --fast
"""
from manualdp.benchmarks.conformance import main

if __name__ == "__main__":
    raise SystemExit(main())
