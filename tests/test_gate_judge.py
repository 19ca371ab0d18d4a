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


# ---- repeats: medians judged, every repeat kept ------------------------------------------------------

def test_combine_takes_medians_worst_cases_and_every_failure():
    from dgr.bench.gate import combine

    runs = [_timing(10.0, 50.0, 0.1, 0.02, 4, failures=()), _timing(14.0, 40.0, 0.3, 0.01, 4, failures=("x",)),
            _timing(11.0, 45.0, 0.2, 0.05, 4, failures=())]
    runs[1]["workers"][0]["sessions_left"] = 2
    runs[2]["token_latency_p95_s"] = None                  # a repeat without the figure is left out
    runs[2]["hop_decode_rtt_s"] = [0.04, 0.03]
    c = combine(runs)
    assert c["decode_tok_s"] == 11.0 and c["prefill_tok_s"] == 45.0 and c["ttft_s"] == 0.2
    assert c["token_latency_p95_s"] == pytest.approx(0.015)
    assert c["hop_decode_rtt_s"] == [0.02, 0.01]
    assert c["failures"] == ["x"] and c["mode"] == "chained" and c["sessions"] == 4
    w = c["workers"][0]
    assert w["sessions_left"] == 2 and w["kv_cells_peak"] == 40 and w["range"] == "0:15"
    assert combine([]) is None


def test_make_refuses_repeats_out_of_range():
    from dgr.bench.gate import GateConfig
    from dgr.errors import DgrError

    assert GateConfig.make(threads=1).repeats == 3 and GateConfig.make(threads=1, quick=True).repeats == 1
    assert GateConfig.make(threads=1, repeats=5).repeats == 5
    for bad in (0, -1, 10):
        with pytest.raises(DgrError):
            GateConfig.make(threads=1, repeats=bad)


def _with_repeats(d, q4_factors):
    """Repeats in which the q4_1 route ran at ``factor`` x its whole model; the top level holds
    the medians, as run_gate leaves it."""
    from dgr.bench.gate import combine

    reps = []
    for f in q4_factors:
        r = doc(q4_speed_vs_whole=f)
        reps.append({"order": [], "routes": {n: {"timing": v["timing"]} for n, v in r["routes"].items()},
                     "whole": {n: {k: v[k] for k in ("worker_timing", "llama_bench", "llama_batched_bench")}
                               for n, v in r["whole"].items()}})
    d["repeats"] = reps
    for n in d["routes"]:
        d["routes"][n]["timing"] = combine([r["routes"][n]["timing"] for r in reps])
    return d


def test_paired_repeats_report_every_repeat_beside_the_judged_median():
    d = _with_repeats(doc(), [0.8, 1.0, 0.85])
    p = gj.paired_repeats(CONTRACT, d)
    dec = p["gguf-q4_1"]["route_decode_vs_whole_model"]
    assert dec["repeats"] == pytest.approx([0.8, 1.0, 0.85]) and dec["repeats_met"] == 1
    assert dec["judged"] == pytest.approx(0.85) and dec["median_of_repeats"] == pytest.approx(0.85)
    assert "route_p95_token_latency_vs_whole_model" in p["gguf-q4_1"]
    # memory and quality thresholds are measured once: not among the paired ratios
    assert "route_max_shard_rss_vs_whole_model" not in p["gguf-q4_1"]
    assert "route_perplexity_vs_whole_model" not in p["gguf-q4_1"]
    # the judged route is the median one: one slow repeat of three does not make a miss
    verdicts = {v.id: v.status for v in check(CONTRACT, gj.results_for(_with_repeats(doc(), [0.5, 1.0, 0.95]),
                                                                       "gguf-q4_1"))}
    assert verdicts["route_decode_vs_whole_model"] == "pass"
    assert gj.repeat_doc(d, 0)["routes"]["gguf-q4_1"]["timing"]["1"]["decode_tok_s"] == pytest.approx(24.0)


def test_the_gate_reads_another_models_contract_only_from_a_folder_in_the_repository(tmp_path, monkeypatch):
    from dgr.accept.stories.dgr014 import _contract_paths
    from dgr.errors import DgrError

    repo = tmp_path / "r"
    (repo / "evidence" / "other" / "DGR-001").mkdir(parents=True)
    monkeypatch.delenv("DGR_GATE_CONTRACT_DIR", raising=False)
    assert _contract_paths(repo) == (gj.CONTRACT, gj.BASELINE)
    monkeypatch.setenv("DGR_GATE_CONTRACT_DIR", "evidence/other/DGR-001")
    with pytest.raises(DgrError, match="no performance-contract.json"):
        _contract_paths(repo)
    for name in ("performance-contract.json", "baseline.json"):
        (repo / "evidence" / "other" / "DGR-001" / name).write_text("{}")
    assert _contract_paths(repo) == ("evidence/other/DGR-001/performance-contract.json",
                                     "evidence/other/DGR-001/baseline.json")
    monkeypatch.setenv("DGR_GATE_CONTRACT_DIR", str(tmp_path))
    with pytest.raises(DgrError, match="outside the repository"):
        _contract_paths(repo)
    monkeypatch.setenv("DGR_GATE_CONTRACT_DIR", "../")
    with pytest.raises(DgrError, match="outside the repository"):
        _contract_paths(repo)


def test_contract_lock_follows_the_folder_it_is_given(tmp_path):
    repo = tmp_path / "r"
    d = repo / "evidence" / "m1b" / "DGR-001"
    d.mkdir(parents=True)
    for name in ("performance-contract.json", "baseline.json"):
        shutil.copy(REPO / "evidence" / "DGR-001" / name, d / name)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "a contract for another model")
    kw = {"contract_path": "evidence/m1b/DGR-001/performance-contract.json",
          "baseline_path": "evidence/m1b/DGR-001/baseline.json"}
    assert gj.contract_lock(repo, CONTRACT, BASELINE, **kw)["ok"]
    assert not gj.contract_lock(repo, CONTRACT, BASELINE)["ok"]          # DGR-001's own folder is not there
    moved = json.loads(json.dumps(CONTRACT))
    moved["thresholds"][0]["value"] = 0.5
    (d / "performance-contract.json").write_text(json.dumps(moved))
    git(repo, "commit", "-qam", "loosen")
    assert not gj.contract_lock(repo, moved, BASELINE, **kw)["ok"]
