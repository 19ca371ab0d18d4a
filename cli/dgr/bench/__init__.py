"""Benchmarks and baselines (the transformers lane, the release gate)."""
