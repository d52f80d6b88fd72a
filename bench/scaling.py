"""torch DDP and manualdp at world sizes 1-4 for lenet, mlp and resnet18: samples/s, p50-p95, ratio, speedup.

    python bench/scaling.py --json bench/results/scaling.json --plot bench/results/scaling.png
"""
from manualdp.benchmarks.scaling import main

if __name__ == "__main__":
    raise SystemExit(main())
