"""Small statistics shared by the benchmark reports: percentiles of latencies and the agreement
of two token sequences."""

from __future__ import annotations

import numpy as np


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) with linear interpolation between ranks (numpy's default);
    None for no values."""
    return float(np.percentile(values, 100 * q)) if values else None


def prefix_agreement(a: list[int], b: list[int]) -> float:
    """Share of ``b`` (the reference) reproduced before the first differing token."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / len(b) if b else 1.0


def positional_agreement(a: list[int], b: list[int]) -> float:
    """Share of positions (over the shorter sequence) holding the same token."""
    n = min(len(a), len(b))
    return sum(1 for i in range(n) if a[i] == b[i]) / n if n else 1.0
