"""ZeRO-1/2 against DDP: optimizer-state bytes and peak memory per rank, measured.

    python bench/zero.py --world-size 2 --json bench/results/zero_2.json --txt bench/results/zero_2.txt
"""
from manualdp.benchmarks.zero import main

if __name__ == "__main__":
    raise SystemExit(main())
