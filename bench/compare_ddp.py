"""manualdp's DistributedDataParallel against torch's: samples/s, step-time percentiles, ratio, parameter difference.

    python bench/compare_ddp.py --model lenet --world-size 2 --json ddp.json --plot ddp.png
"""
from manualdp.benchmarks.ddp import main

if __name__ == "__main__":
    raise SystemExit(main())
