"""Benchmark helpers (baseline checkpointers for scripts/bench_overhead.py)."""
