"""Parity and isolation judgements of dgr.route.parity (pure Python, no worker)."""

from __future__ import annotations

from dgr.route.sessions import RunReport, SessionReport
from dgr.route.parity import compare, isolation


def _s(i, tokens, tops):
    return SessionReport(index=i, prompt="", prompt_tokens=1, tokens=tokens, text="", finish_reason="length",
                         status="completed", error=None, ttft_s=0, prefill_tok_s=0, decode_tok_s=0,
                         decode_start_s=0, decode_end_s=0, seam_bytes_per_decode_token=[], hop_decode_rtt_s=[],
                         telemetry={}, top_logprobs=tops)


def _r(*sessions):
    return RunReport("x", [], list(sessions), 0.0)


def test_compare_is_exact():
    a = _r(_s(0, [1, 2, 3], [[(1, -0.1)], [(2, -0.2)], [(3, -0.3)]]))
    assert compare(a, a).ok and compare(a, a).max_logprob_diff == 0
    b = _r(_s(0, [1, 2, 4], [[(1, -0.1)], [(2, -0.2)], [(4, -0.3)]]))
    p = compare(a, b)
    assert not p.ok and p.first_divergence == [2] and p.agreeing_tokens == 2


def test_isolation_tolerates_divergence_at_a_near_tie_only():
    seq = _r(_s(0, [1, 2, 3], [[(1, -0.1), (9, -3)], [(2, -1.00), (7, -1.01)], [(3, -0.3), (8, -2)]]))
    tie = _r(_s(0, [1, 7, 5], [[(1, -0.12), (9, -3)], [(7, -1.0), (2, -1.02)], [(5, -0.5), (3, -2)]]))
    iso = isolation(tie, seq)
    assert iso.ok and iso.near_tie_divergences == 1
    corrupt = _r(_s(0, [1, 9, 5], [[(1, -0.1), (9, -3)], [(9, -0.1), (2, -4)], [(5, -0.5), (3, -2)]]))
    bad = isolation(corrupt, seq)
    assert not bad.ok and "not near a tie" in bad.violations[0]
    noisy = _r(_s(0, [1, 2, 3], [[(1, -2.5), (9, -3)], [(2, -1.0), (7, -1.01)], [(3, -0.3), (8, -2)]]))
    assert not isolation(noisy, seq).ok
