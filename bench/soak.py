"""Soak test: resident memory over thousands of training steps.

    python bench/soak.py --mode single --steps 3000
    python bench/soak.py --mode spmd --world-size 2 --steps 3000
"""
from manualdp.benchmarks.soak import main

if __name__ == "__main__":
    raise SystemExit(main())
