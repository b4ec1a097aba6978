"""Benchmarks: side-by-side ratios, run as ``python -m benchmarks.run`` (and the other modules)."""
