"""The fault table: kill, stop, damage and special-path cases; tried / handled / silent / crash / hang / lost.

    python bench/faults.py
    python bench/faults.py --check-cost
"""
from manualdp.benchmarks.faults import main

if __name__ == "__main__":
    raise SystemExit(main())
