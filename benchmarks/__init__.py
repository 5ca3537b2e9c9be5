"""Benchmarks of MegaTier against its baselines; run them as scripts (python benchmarks/bench_*.py)."""
