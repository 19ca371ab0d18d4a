"""The release gate's judging (dgr.bench.gate_judge) on synthetic gate documents: results in the
contract's format, the contract lock, gains kept apart, exactly one recommendation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dgr.bench import gate_judge as gj
from dgr.bench.contract import check

from gitfixtures import git

REPO = Path(__file__).resolve().parent.parent
CONTRACT = json.loads((REPO / gj.CONTRACT).read_text())
BASELINE = json.loads((REPO / gj.BASELINE).read_text())


SCALE = {1: 1.0, 4: 2.0, 8: 3.0}   # aggregate decode vs one session


def _timing(decode, prefill, ttft, p95, c, mode="chained", failures=()):
    return {"sessions": c, "mode": mode, "failures": list(failures), "ttft_s": ttft, "prefill_tok_s": prefill,
            "decode_tok_s": decode, "token_latency_p50_s": p95 / 2, "token_latency_p95_s": p95,
            "seam_bytes_per_decode_token": 2400.0, "hop_decode_rtt_s": [0.02, 0.01],
            "workers": [{"range": "0:15", "rss_peak_bytes": 1, "kv_cells_peak": 10 * c, "kv_cells_total": 100,
                         "active_sessions_peak": c, "mean_batch_rows": c, "mean_queue_wait_s": 0.0,
                         "sessions_left": 0, "kv_cells_left": 0}]}


def _route(speed, rss, nbytes, ppl, argmax, greedy, mode="chained"):
    return {"artifact_bytes": nbytes, "peak_rss_bytes": [rss, rss], "greedy": greedy,
            "score": {"argmax": argmax, "perplexity": ppl, "n_scored": 4, "clipped": 0},
            "timing": {str(c): _timing(speed * SCALE[c], speed * 5, 1 / speed, 1 / speed, c, mode)
                       for c in (1, 4, 8)}}


def _whole(speed, rss, ppl, greedy):
    return {"greedy": greedy, "score": {"perplexity": ppl, "argmax": [1, 2, 3, 4]}, "peak_rss_bytes": rss,
            "worker_timing": {"1": _timing(speed, speed * 5, 1 / speed, 1 / speed, 1)},
            "llama_bench": {"tg_tok_s": speed, "pp_tok_s": speed * 5},
            "llama_batched_bench": {str(c): {"tg_tok_s": speed * SCALE[c]} for c in (4, 8)}}


def doc(q4_speed_vs_whole=1.0, st_speed=10.0):
    g = [[5, 6, 7], [8, 9]]
    return {"config": {"split": ["0:15", "15:30"]},
            "routes": {"safetensors-fp32": _route(st_speed, 600, 540, 10.0, [1, 2, 3, 4], g, "stepwise"),
                       "gguf-f32": _route(12.0, 300, 540, 10.0, [1, 2, 3, 4], g),
                       "gguf-q8_0": _route(25.0, 120, 145, 10.05, [1, 2, 3, 5], g),
                       "gguf-q4_1": _route(30.0 * q4_speed_vs_whole, 100, 98, 10.06, [1, 2, 3, 4], g)},
            "whole": {"gguf-f32": _whole(12.0, 500, 10.0, g), "gguf-q8_0": _whole(25.0, 200, 10.05, g),
                      "gguf-q4_1": _whole(30.0, 180, 10.06, g)}}


def test_results_are_what_bench_check_reads():
    d = doc()
    res = gj.results_for(d, "gguf-q4_1")
    assert res["schema"] == "dgr.bench.results/1"
    r, w, ref = res["route"], res["whole_model"], res["transformers_fp32"]
    assert r["decode_tokens_per_second"] == 30.0 and w["decode_tokens_per_second"] == 30.0
    assert r["throughput_c4_tokens_per_second"] == 60.0 and w["throughput_c4_tokens_per_second"] == 60.0
    assert r["max_shard_peak_rss_bytes"] == 100 and r["peak_rss_bytes"] == 200
    assert r["greedy_agreement_vs_whole_model"] == 1.0 and r["failures"] == 0
    assert ref["decode_tokens_per_second"] == 10.0 and ref["artifact_bytes"] == 540
    verdicts = {v.id: v.status for v in check(CONTRACT, res)}
    assert verdicts["route_decode_vs_whole_model"] == "pass"
    assert verdicts["stop_condition"] == "pass"          # 3x the safetensors route, a fifth of its size
    slow = gj.results_for(doc(q4_speed_vs_whole=0.5), "gguf-q4_1")
    assert {v.id: v.status for v in check(CONTRACT, slow)}["route_decode_vs_whole_model"] == "fail"


def test_gains_keep_runtime_apart_from_quantization():
    g = gj.gains(doc())
    assert g["runtime_transport"]["decode_tokens_per_second"] == pytest.approx(12.0 / 10.0)
    assert g["runtime_transport"]["artifact_bytes"] == 1.0          # same fp32 weights
    assert g["quantization"]["gguf-q4_1"]["decode_tokens_per_second"] == pytest.approx(30.0 / 12.0)
    assert g["quantization"]["gguf-q8_0"]["artifact_bytes"] == pytest.approx(145 / 540)
    assert g["quantization"]["gguf-q8_0"]["top1_agreement_vs_transformers_fp32"] == 0.75


def _judged(d):
    return gj.judge(CONTRACT, {n: gj.results_for(d, n) for n in ("gguf-f32", "gguf-q8_0", "gguf-q4_1")})


def test_exactly_one_recommendation():
    d = doc()
    promote = gj.recommend(_judged(d), d)
    # every route meets every required threshold; q4_1 and q8_0 pass the stop condition, q4_1 is faster
    assert (promote["decision"], promote["recipe"]) == ("promote", "gguf-q4_1")
    # q4_1 at half its whole model's speed misses thresholds and q8_0 drifts (top-1 0.75 < 0.9):
    # optimize q4_1's worst miss (prefill: 0.5 against 0.95 is the largest shortfall)
    slow = doc(q4_speed_vs_whole=0.5)
    rec = gj.recommend(_judged(slow), slow)
    assert (rec["decision"], rec["recipe"], rec["bottleneck"]) == ("optimize", "gguf-q4_1",
                                                                  "route_prefill_vs_whole_model")
    # safetensors route as fast as any GGUF route and GGUF without a fit advantage: stop
    d_stop = doc(st_speed=40.0)
    for n in ("gguf-q8_0", "gguf-q4_1"):
        d_stop["routes"][n]["artifact_bytes"] = 540
        d_stop["routes"][n]["peak_rss_bytes"] = [600, 600]
    assert gj.recommend(_judged(d_stop), d_stop)["decision"] == "stop"


def test_optimize_names_the_worst_measured_miss():
    d = doc(q4_speed_vs_whole=0.5)
    d["routes"]["gguf-f32"]["timing"]["1"]["decode_tok_s"] = 1.0   # f32 also far off, q8 too
    d["routes"]["gguf-q8_0"]["timing"]["1"]["decode_tok_s"] = 5.0
    j = _judged(d)
    rec = gj.recommend(j, d)
    assert rec["decision"] == "optimize"
    assert rec["bottleneck"] == j[rec["recipe"]]["misses"][0]["id"]
    assert rec["bottleneck"] in rec["text"] and "ms" in rec["text"]


def test_contract_lock_refuses_a_changed_contract(tmp_path):
    repo = tmp_path / "r"
    (repo / "evidence" / "DGR-001").mkdir(parents=True)
    for name in ("performance-contract.json", "baseline.json"):
        shutil.copy(REPO / "evidence" / "DGR-001" / name, repo / "evidence" / "DGR-001" / name)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "DGR-001 evidence")
    ok = gj.contract_lock(repo, CONTRACT, BASELINE)
    assert ok["ok"] and ok["thresholds_match_baseline"], ok
    moved = json.loads(json.dumps(CONTRACT))
    moved["thresholds"][0]["value"] = 0.5
    (repo / gj.CONTRACT).write_text(json.dumps(moved))
    dirty = gj.contract_lock(repo, moved, BASELINE)
    assert not dirty["ok"] and dirty["uncommitted_change"] and not dirty["thresholds_match_baseline"]
    git(repo, "commit", "-q", "-am", "loosen a threshold")
    later = gj.contract_lock(repo, moved, BASELINE)
    assert not later["ok"] and "changed at" in later["reasons"][0]
