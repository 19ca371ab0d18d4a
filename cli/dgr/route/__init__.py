"""Inference Routes: local worker processes, the worker supervisor, the route driver, reports and parity."""
