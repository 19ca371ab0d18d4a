"""Benchmarks: the worker, the route, llama.cpp lanes (bench, batched-bench, RPC), the Transformers baseline,
the Transformers shard worker and the release gate."""
