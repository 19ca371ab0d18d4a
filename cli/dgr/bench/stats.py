"""Small statistics shared by the benchmark reports: percentiles of latencies and the agreement
of two token sequences."""

from __future__ import annotations

from typing import Any

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


def cadence(chunk_times: list[list[float]], tokens: list[int], *, merge_s: float = 0.0) -> dict[str, float | int | None]:
    """How text reached a client: ``chunk_times`` per request, the arrival of each chunk (event)
    that carried text; ``tokens`` per request, the tokens generated. ``chunks_per_token`` is
    the share of tokens that arrived as a chunk of their own (1.0: one event per token); the
    inter-token latency (ITL) is every gap between two consecutive chunks of one request, pooled
    over the requests (the first chunk's wait is the TTFT, not an ITL); ``max_gap_s`` the
    longest. Tokens that arrive together make one chunk and one longer gap: the figures show
    bursts that a tokens-per-second rate hides. ``merge_s``: arrivals closer than this to the
    previous one are the same chunk (a route driver hands over the tokens of one answer one after
    another, microseconds apart)."""
    if merge_s > 0:
        chunk_times = [[t for i, t in enumerate(ts) if i == 0 or t - ts[i - 1] >= merge_s] for ts in chunk_times]
    gaps = [b - a for ts in chunk_times for a, b in zip(ts, ts[1:])]
    n_tok = sum(tokens)
    return {"chunks": sum(len(ts) for ts in chunk_times), "tokens": n_tok,
            "chunks_per_token": sum(len(ts) for ts in chunk_times) / n_tok if n_tok else None,
            "itl_p50_s": percentile(gaps, 0.5), "itl_p90_s": percentile(gaps, 0.9),
            "itl_p99_s": percentile(gaps, 0.99), "max_gap_s": max(gaps) if gaps else None, "gaps": len(gaps)}


def cadence_cells(c: dict[str, Any]) -> str:
    """A cadence (stats.cadence) as table cells: chunks per token, ITL p50/p90/p99, max gap (ms)."""
    def ms(k: str) -> str:
        return "n/a" if c.get(k) is None else f"{c[k] * 1e3:.1f}"
    cpt = "n/a" if c.get("chunks_per_token") is None else f"{c['chunks_per_token']:.2f}"
    return f"{cpt:>10} {ms('itl_p50_s'):>8} {ms('itl_p90_s'):>7} {ms('itl_p99_s'):>7} {ms('max_gap_s'):>8}"
