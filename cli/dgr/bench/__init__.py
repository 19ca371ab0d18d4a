"""Benchmarks against baselines (JSON out)."""
