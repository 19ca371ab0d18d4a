"""`dgr bench route` pieces that need no model: the per-step profile (compute per shard vs
hand-offs) and the llama.cpp RPC summary."""

from __future__ import annotations

import pytest

from dgr.route_bench import _median_profile, _profile, _rpc_summary, profile_lines


def counters(busy: float, batches: float, rows: float) -> dict[str, float]:
    return {"dgr_decode_only_busy_seconds_total": busy, "dgr_decode_only_batches_total": batches,
            "dgr_decode_only_rows_total": rows}


def test_profile_splits_a_step_into_compute_and_handoffs():
    before = [counters(1.0, 10, 10), counters(2.0, 10, 10)]
    # 100 single-row decode batches on each shard: 6 ms and 9 ms of compute each
    after = [counters(1.6, 110, 110), counters(2.9, 110, 110)]
    p = _profile(before, after, decode_tok_s=1000 / 16.0)   # 16 ms per token
    assert [w["compute_ms_per_batch"] for w in p["workers"]] == pytest.approx([6.0, 9.0])
    assert [w["rows_per_batch"] for w in p["workers"]] == pytest.approx([1.0, 1.0])
    assert p["step_ms"] == pytest.approx(16.0)
    assert p["compute_ms_per_step"] == pytest.approx(15.0)
    assert p["handoff_ms_per_step"] == pytest.approx(1.0)
    # 4 sessions: a step carries 4 rows, so it lasts 4 tokens' worth of the aggregate rate
    after4 = [counters(2.0, 60, 210), counters(3.0, 60, 210)]   # 20 ms per batch each
    p4 = _profile(before, after4, decode_tok_s=100.0)
    assert p4["workers"][0]["rows_per_batch"] == pytest.approx(4.0)
    assert p4["step_ms"] == pytest.approx(40.0)
    assert p4["handoff_ms_per_step"] == pytest.approx(0.0, abs=1e-9)


def test_profile_without_decode_batches_is_empty_not_an_error():
    p = _profile([counters(1, 5, 5)], [counters(1, 5, 5)], decode_tok_s=0.0)
    assert p["step_ms"] == 0.0 and p["workers"][0]["decode_batches"] == 0


def test_profile_lines_and_median():
    runs = [{"profile": _profile([counters(0, 0, 0)], [counters(0.1, 10, 10)], decode_tok_s=1000 / 12.0)},
            {"profile": _profile([counters(0, 0, 0)], [counters(0.12, 10, 10)], decode_tok_s=1000 / 14.0)}]
    med = _median_profile(runs)
    assert med["step_ms"] == pytest.approx(13.0)
    assert med["worker_compute_ms_per_batch"] == pytest.approx([11.0])
    lines = profile_lines({"whole_worker": {"1": {"profile": med}}})
    assert len(lines) == 1 and lines[0].startswith("profile whole worker, 1 session(s): step 13.00 ms")


def test_rpc_summary_medians_and_skips():
    assert _rpc_summary([])["skipped"]
    assert _rpc_summary([{"skipped": True, "reason": "no rpc-server"}]) == {"skipped": True, "reason": "no rpc-server"}
    runs = [{"skipped": False, "command": ["x"], "pp_tok_s": 100.0, "tg_tok_s": 40.0, "warnings": ["w"]},
            {"skipped": False, "command": ["x"], "pp_tok_s": 120.0, "tg_tok_s": 50.0, "warnings": []},
            {"skipped": True, "reason": "flaky"}]
    s = _rpc_summary(runs)
    assert not s["skipped"] and s["pp_tok_s"] == 110.0 and s["tg_tok_s"] == 45.0 and s["warnings"] == ["w"]
