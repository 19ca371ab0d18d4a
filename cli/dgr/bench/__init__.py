"""Benchmarks: the worker, the route, llama.cpp lanes (bench, batched-bench, RPC), the Transformers baseline."""
