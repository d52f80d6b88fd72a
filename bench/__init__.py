"""Benchmarks and QA harnesses, outside the package: run each from the repository, `python bench/NAME.py`."""
