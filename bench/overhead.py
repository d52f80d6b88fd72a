"""Per-step overhead of manualdp against a plain PyTorch loop.

    python bench/overhead.py --model lenet --batch-size 256 --json overhead.json
"""
from manualdp.benchmarks.overhead import main

if __name__ == "__main__":
    raise SystemExit(main())
