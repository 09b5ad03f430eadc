"""Benchmarks: one script per comparison (see README.md); `run_bench.py` runs a set of them."""
