"""DGR-001 performance contract: building it from baseline results, checking later results
against it (`dgr bench check`), and the pure helpers of the baseline. No torch, no model."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dgr.bench import contract as bc
from dgr.bench.baseline import _best, percentile, positional_agreement, prefix_agreement
from dgr.errors import DgrError

FIX = Path(__file__).parent / "fixtures" / "bench"


def _baseline() -> dict:
    return json.loads((FIX / "baseline-min.json").read_text())


def _contract(tmp_path: Path, baseline: dict | None = None) -> Path:
    c = bc.build_contract(baseline or _baseline())
    p = tmp_path / "performance-contract.json"
    p.write_text(json.dumps(c))
    return p


def _verdicts(contract: dict, results: dict) -> dict[str, str]:
    return {v.id: v.status for v in bc.check(contract, results)}


def test_contract_is_versioned_and_carries_lanes_thresholds_and_stop_condition():
    c = bc.build_contract(_baseline())
    assert c["schema"] == bc.CONTRACT_SCHEMA and c["schema_version"] == 1
    assert c["hardware_class"]["class"] == "cpu-x86_64-2cpu"
    assert set(c["lanes"]) == {"quality", "performance"}
    assert c["lanes"]["quality"]["recipes"] == ["transformers-fp32", "llama.cpp-f32"]
    ids = {t["id"]: t for t in c["thresholds"]}
    assert ids["route_decode_vs_whole_model"]["value"] == 0.90
    assert ids["route_decode_vs_whole_model"]["baseline"] == "whole_model.decode_tokens_per_second"
    assert ids["route_prefill_vs_whole_model"]["value"] == 0.95
    assert ids["route_c4_aggregate_vs_batched_bench"]["value"] == 0.90
    assert ids["route_seam_bytes_per_token"]["value"] == 2880  # ceil(1.25 * 576 * 4)
    # the logits bound comes from the measured same-precision parity of this baseline
    assert ids["route_logits_max_abs_diff_vs_whole_model"]["value"] == pytest.approx(0.004)
    stop = c["stop_condition"]
    assert "rule" in stop and stop["min_decode_speedup"] == bc.MIN_DECODE_SPEEDUP
    assert stop["evaluated_now"]["llama.cpp-q4_1"]["qualifies"] is True
    assert stop["verdict_now"] == "continue"
    assert c["baseline_metrics"]["llama.cpp-q4_1"]["decode_tokens_per_second"] == 110.0


def test_stop_condition_says_stop_when_gguf_gives_neither_speed_nor_fit():
    b = _baseline()
    for name in ("llama.cpp-f32", "llama.cpp-q4_1"):
        b["recipes"][name]["decode_tokens_per_second"] = 16.0  # ~1.07x fp32: no speed advantage
        b["recipes"][name]["peak_rss_bytes"] = 1000000000      # 0.9x RSS: no fit advantage
    assert bc.build_contract(b)["stop_condition"]["verdict_now"] == "stop"
    b = _baseline()
    b["recipes"]["llama.cpp-q4_1"]["perplexity"] = 30.0  # fast and small but drifts too far
    b["recipes"]["llama.cpp-f32"]["decode_tokens_per_second"] = 16.0
    ev = bc.build_contract(b)["stop_condition"]
    assert ev["evaluated_now"]["llama.cpp-q4_1"]["drift_ok"] is False
    assert ev["verdict_now"] == "stop"


def test_contract_needs_a_successful_reference_and_the_model_width():
    b = _baseline()
    b["recipes"]["transformers-fp32"]["failures"] = ["oom"]
    with pytest.raises(DgrError, match="transformers-fp32"):
        bc.build_contract(b)
    b = _baseline()
    del b["model"]["n_embd"]
    with pytest.raises(DgrError, match="n_embd"):
        bc.build_contract(b)


def test_passing_results_pass_every_threshold_and_the_stop_condition():
    c = bc.build_contract(_baseline())
    r = bc.load_results(FIX / "results-pass.json")
    v = _verdicts(c, r)
    assert set(v.values()) == {"pass"}, v
    assert len(v) == len(c["thresholds"]) + 1


def test_failing_results_fail_the_thresholds_they_miss():
    c = bc.build_contract(_baseline())
    r = bc.load_results(FIX / "results-fail.json")
    v = _verdicts(c, r)
    for tid in ("route_decode_vs_whole_model", "route_prefill_vs_whole_model",
                "route_c4_aggregate_vs_batched_bench", "route_seam_bytes_per_token", "route_failures",
                "route_perplexity_vs_whole_model", "route_greedy_agreement_vs_whole_model",
                "route_max_shard_rss_vs_whole_model", "stop_condition"):
        assert v[tid] == "fail", (tid, v[tid])
    # an optional metric the results do not carry is skipped, not failed
    assert v["route_logits_max_abs_diff_vs_whole_model"] == "skip"


def test_ratio_thresholds_use_the_same_run_baseline():
    c = bc.build_contract(_baseline())
    r = bc.load_results(FIX / "results-pass.json")
    # a faster machine: every absolute number doubles, the ratios do not move
    fast = copy.deepcopy(r)
    for block in ("whole_model", "route"):
        for k in ("decode_tokens_per_second", "prefill_tokens_per_second", "throughput_c4_tokens_per_second"):
            fast[block][k] *= 2
    assert _verdicts(c, fast)["route_decode_vs_whole_model"] == "pass"
    # the route just under 90% of whole-model decode fails, just over passes
    r["route"]["decode_tokens_per_second"] = 0.899 * r["whole_model"]["decode_tokens_per_second"]
    assert _verdicts(c, r)["route_decode_vs_whole_model"] == "fail"
    r["route"]["decode_tokens_per_second"] = 0.901 * r["whole_model"]["decode_tokens_per_second"]
    assert _verdicts(c, r)["route_decode_vs_whole_model"] == "pass"


def test_missing_required_metric_fails():
    c = bc.build_contract(_baseline())
    r = bc.load_results(FIX / "results-pass.json")
    del r["whole_model"]["decode_tokens_per_second"]
    verdicts = {v.id: v for v in bc.check(c, r)}
    assert verdicts["route_decode_vs_whole_model"].status == "fail"
    assert "missing" in verdicts["route_decode_vs_whole_model"].detail
    del r["transformers_fp32"]
    assert {v.id: v.status for v in bc.check(c, r)}["stop_condition"] == "skip"


def test_loaders_refuse_wrong_documents(tmp_path):
    p = _contract(tmp_path)
    doc = json.loads(p.read_text())
    doc["schema_version"] = 99
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(DgrError, match="schema_version"):
        bc.load_contract(bad)
    with pytest.raises(DgrError, match="not a dgr performance contract"):
        bc.load_contract(FIX / "results-pass.json")
    with pytest.raises(DgrError, match="dgr.bench.results/1"):
        bc.load_results(FIX / "baseline-min.json")
    with pytest.raises(DgrError, match="not found"):
        bc.load_contract(tmp_path / "nope.json")


def test_hardware_note_only_for_another_class():
    c = bc.build_contract(_baseline())
    r = bc.load_results(FIX / "results-pass.json")
    assert bc.hardware_note(c, r) is None
    r["hardware"]["class"] = "cuda-x86_64-16cpu-H200"
    assert "differs" in bc.hardware_note(c, r)


def _dgr(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "dgr.main", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_cli_check_prints_per_threshold_and_exits_by_verdict(tmp_path):
    contract = _contract(tmp_path)
    ok = _dgr("bench", "check", str(FIX / "results-pass.json"), "--contract", str(contract))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASS  route_decode_vs_whole_model" in ok.stdout
    assert "0 failed" in ok.stdout
    bad = _dgr("bench", "check", str(FIX / "results-fail.json"), "--contract", str(contract))
    assert bad.returncode == 1
    assert "FAIL  route_decode_vs_whole_model" in bad.stdout
    assert "FAIL  stop_condition" in bad.stdout and "STOP the native track" in bad.stdout
    wrong = _dgr("bench", "check", str(FIX / "baseline-min.json"), "--contract", str(contract))
    assert wrong.returncode == 1 and "dgr: error:" in wrong.stderr and "Traceback" not in wrong.stderr


def test_cli_contract_writes_a_contract(tmp_path):
    out = tmp_path / "c.json"
    p = _dgr("bench", "contract", str(FIX / "baseline-min.json"), "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert bc.load_contract(out)["stop_condition"]["verdict_now"] == "continue"


def test_agreement_and_percentile_helpers():
    assert prefix_agreement([1, 2, 3, 9], [1, 2, 3, 4]) == 0.75
    assert prefix_agreement([9, 2, 3, 4], [1, 2, 3, 4]) == 0.0
    assert positional_agreement([9, 2, 3, 4], [1, 2, 3, 4]) == 0.75
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert percentile([1.0, 2.0], 0.95) == pytest.approx(1.95)
    assert percentile([], 0.5) is None
    # speeds keep the best sample per key (the run least disturbed by other work on the host)
    assert _best([{"a": 1.0, "b": 5.0}, {"a": 3.0, "b": 2.0}]) == {"a": 3.0, "b": 5.0}


def test_shipped_inputs_are_package_data():
    from dgr.bench import baseline

    text, prompts = baseline.load_inputs()
    assert len(text.split()) > 300 and len(prompts) >= 4
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert 'dgr = ["data/*"' in pyproject


def test_hf_lane_runs_a_tiny_random_llama(tmp_path):
    """The transformers recipe end to end on a tiny random checkpoint (needs the baseline extra)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from dgr.bench import hf_lane

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "hf"))
    ids = [int(x) for x in torch.randint(0, 64, (40,))]
    res = hf_lane.run({"hf_dir": str(tmp_path / "hf"), "dtype": "fp32", "device": "cpu", "threads": 1,
                       "prompts": [ids[:5], ids[5:12]], "gen_tokens": 4,
                       "perf": {"ids": ids[:16], "n_gen": 4, "reps": 1, "rounds": 2}, "concurrency": [1, 4],
                       "c_prompts": [ids[0:8], ids[8:16], ids[16:24], ids[24:32]],
                       "score": {"ids": ids, "chunk": 16}, "logits_out": str(tmp_path / "l.npy")})
    import numpy as np

    assert np.load(tmp_path / "l.npy").shape == (12, 64)  # every prompt position of both prompts
    assert [len(g["tokens"]) for g in res["gen"]] == [4, 4]
    assert [len(r["token_latency_s"]) for r in res["perf_runs"]] == [3, 3]
    assert set(res["concurrency"]) == {"1", "4"} and len(res["concurrency"]["4"]) == 2
    assert res["score"]["n_scored"] == 37 and len(res["score"]["top1"]) == 37  # 15 + 15 + 7
    # greedy decoding with the KV cache reproduces a full forward's argmax
    with torch.inference_mode():
        m = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
        seq = ids[:5] + res["gen"][0]["tokens"][:-1]
        full = m(input_ids=torch.tensor([seq])).logits[0, 4:].argmax(-1).tolist()
    assert full == res["gen"][0]["tokens"]


def test_baseline_without_the_extra_fails_with_an_install_hint(monkeypatch):
    import importlib.util

    from dgr.bench import hf_export

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(DgrError, match="torch") as err:
        hf_export.require_baseline_extra()
    assert ".[baseline]" in err.value.hint and "torch==2.13.0" in err.value.hint
