"""Judging the release gate (DGR-014) — pure functions over a ``dgr.bench.gate/1`` document:

- :func:`contract_lock`: the DGR-001 contract as committed, unchanged since the baseline it was
  written from (git: the last commit touching the contract is the one that wrote baseline.json,
  no uncommitted change, and the thresholds equal those the baseline yields);
- :func:`results_for`: one ``dgr.bench.results/1`` document per GGUF route (what `dgr bench
  check` reads): ``route``, ``whole_model`` (the same artifact, same run) and
  ``transformers_fp32`` (the distributed safetensors route, the stop condition's reference);
- :func:`gains`: runtime/transport (GGUF F32 route vs safetensors fp32 route: same precision)
  apart from quantization (GGUF Q8_0/Q4_1 route vs GGUF F32 route), and the cost of the split
  (each route vs its whole model);
- :func:`paired_repeats`: each timed ratio threshold's value in every repeat of the speed section
  (route and whole model from the same repeat) beside the value judged (from the medians);
- :func:`recommend`: exactly one of promote GGUF / optimize a named measured bottleneck / stop.
"""

from __future__ import annotations

import statistics
import subprocess
from pathlib import Path
from typing import Any

from .contract import RESULTS_SCHEMA, Threshold, _get, _num, build_contract, check, meets
from .gate import GGUF_ROUTES, SAFETENSORS
from .stats import positional_agreement, prefix_agreement

CONTRACT = "evidence/DGR-001/performance-contract.json"
BASELINE = "evidence/DGR-001/baseline.json"


# ---- the contract lock ----------------------------------------------------------------------

def _git(repo: Path, *args: str) -> str:
    p = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)
    return p.stdout.strip() if p.returncode == 0 else ""


def contract_lock(repo: Path, contract: dict[str, Any], baseline: dict[str, Any], *, contract_path: str = CONTRACT,
                  baseline_path: str = BASELINE) -> dict[str, Any]:
    """Is the committed contract the one DGR-001 wrote? ``ok`` with the commits and the reasons.
    The paths are relative to ``repo``: DGR-001's own folder, or the folder of a contract DGR-001
    wrote for another model (``dgr accept DGR-001 --model M --out DIR``)."""
    base_commit = _git(repo, "log", "-1", "--format=%H", "--", baseline_path)
    contract_commits = _git(repo, "log", "--format=%H", "--", contract_path).splitlines()
    dirty = bool(_git(repo, "status", "--porcelain", "--", contract_path))
    expected = build_contract(baseline)["thresholds"]
    same = contract.get("thresholds") == expected
    reasons = []
    if not base_commit or not contract_commits:
        reasons.append("the contract or its baseline is not committed")
    elif contract_commits[0] != base_commit:
        reasons.append(f"the contract was changed at {contract_commits[0][:12]}, after the baseline commit "
                       f"{base_commit[:12]}")
    if dirty:
        reasons.append("the contract has uncommitted changes")
    if not same:
        reasons.append("its thresholds differ from the ones its committed baseline yields")
    return {"ok": not reasons, "baseline_commit": base_commit, "contract_commit": contract_commits[0] if contract_commits
            else None, "contract_commits": len(contract_commits), "uncommitted_change": dirty,
            "thresholds_match_baseline": same, "reasons": reasons}


# ---- results in the contract's format ---------------------------------------------------------------

def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean share of each reference answer reproduced before the first differing token."""
    return statistics.mean(prefix_agreement(x, y) for x, y in zip(a, b)) if b else 1.0


def route_block(doc: dict[str, Any], name: str) -> dict[str, Any]:
    r = doc["routes"][name]
    t = r["timing"]
    ref = doc["routes"][SAFETENSORS]["score"]["argmax"]
    one = t.get("1", {})
    return {
        "decode_tokens_per_second": one.get("decode_tok_s"),
        "prefill_tokens_per_second": one.get("prefill_tok_s"),
        "ttft_seconds": one.get("ttft_s"),
        "token_latency_p50_seconds": one.get("token_latency_p50_s"),
        "token_latency_p95_seconds": one.get("token_latency_p95_s"),
        **{f"throughput_c{c}_tokens_per_second": v.get("decode_tok_s") for c, v in t.items()},
        "max_shard_peak_rss_bytes": max(r.get("peak_rss_bytes") or [0]) or None,
        "peak_rss_bytes": sum(r.get("peak_rss_bytes") or []) or None,
        "artifact_bytes": r.get("artifact_bytes"),
        "seam_bytes_per_token_per_seam": one.get("seam_bytes_per_decode_token"),
        "hop_decode_rtt_seconds": one.get("hop_decode_rtt_s"),
        "failures": sum(len(v.get("failures") or []) for v in t.values()),
        "perplexity": r["score"]["perplexity"],
        "top1_agreement_vs_transformers_fp32": positional_agreement(r["score"]["argmax"], ref),
        "kv_cells_peak": max((w["kv_cells_peak"] for v in t.values() for w in v["workers"]), default=0),
        "kv_cells_total": max((w["kv_cells_total"] for v in t.values() for w in v["workers"]), default=0),
        "sessions_left_after": sum(w["sessions_left"] for v in t.values() for w in v["workers"]),
        "kv_cells_left_after": sum(w["kv_cells_left"] for v in t.values() for w in v["workers"]),
        "mode": one.get("mode"),
    }


def results_for(doc: dict[str, Any], name: str, hardware: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``dgr.bench.results/1`` document of one GGUF route."""
    w = doc["whole"][name]
    wt = w["worker_timing"].get("1", {})
    route = route_block(doc, name)
    route["greedy_agreement_vs_whole_model"] = greedy_agreement(doc["routes"][name]["greedy"], w["greedy"])
    whole = {
        "decode_tokens_per_second": w["llama_bench"].get("tg_tok_s"),
        "prefill_tokens_per_second": w["llama_bench"].get("pp_tok_s"),
        **{f"throughput_c{c}_tokens_per_second": v.get("tg_tok_s") for c, v in w["llama_batched_bench"].items()},
        "ttft_seconds": wt.get("ttft_s"),
        "token_latency_p95_seconds": wt.get("token_latency_p95_s"),
        "peak_rss_bytes": w.get("peak_rss_bytes") or None,
        "perplexity": w["score"]["perplexity"],
    }
    ref = route_block(doc, SAFETENSORS)
    ref["top1_agreement_vs_transformers_fp32"] = 1.0
    out = {"schema": RESULTS_SCHEMA, "recipe": name, "route": route, "whole_model": whole,
           "transformers_fp32": ref, "about": {
               "route": f"{name} route through the route driver ({route['mode']}), " + ", ".join(doc["config"]["split"]),
               "whole_model": "llama-bench (pp; tg at depth n_prompt), llama-batched-bench (tg at B sessions), "
                              "and one whole-model dgr-worker through the same driver (TTFT, p95 token latency, "
                              "peak RSS, perplexity)",
               "transformers_fp32": "the distributed safetensors route (transformers shard workers, fp32), same run",
               "perplexity": "teacher-forced through the protocol, top-k clipped (a lower bound), the same way "
                             "for every route and whole model"}}
    if hardware:
        out["hardware"] = hardware
    return out


# ---- gains and the recommendation -----------------------------------------------------------------

def _ratio(a: Any, b: Any) -> float | None:
    x, y = _num(a), _num(b)
    return x / y if x is not None and y not in (None, 0.0) else None


_COMPARED = ("decode_tokens_per_second", "prefill_tokens_per_second", "throughput_c4_tokens_per_second",
             "throughput_c8_tokens_per_second", "ttft_seconds", "token_latency_p95_seconds",
             "max_shard_peak_rss_bytes", "peak_rss_bytes", "artifact_bytes", "perplexity")


def gains(doc: dict[str, Any]) -> dict[str, Any]:
    """Ratios that keep the two sources of gain apart (>1 is faster for speeds, smaller for
    latency/memory ratios < 1)."""
    blocks = {n: route_block(doc, n) for n in [SAFETENSORS, *GGUF_ROUTES]}
    st, f32 = blocks[SAFETENSORS], blocks["gguf-f32"]
    out: dict[str, Any] = {
        "runtime_transport": {"compares": "gguf-f32 route / safetensors-fp32 route (same fp32 weights and "
                                          "precision: only the runtime and its transport differ)",
                              **{k: _ratio(f32[k], st[k]) for k in _COMPARED}},
        "quantization": {q: {"compares": f"{q} route / gguf-f32 route (same runtime and transport: only the "
                                         "weight quantization differs)",
                             **{k: _ratio(blocks[q][k], f32[k]) for k in _COMPARED},
                             "top1_agreement_vs_transformers_fp32": blocks[q]["top1_agreement_vs_transformers_fp32"]}
                         for q in ("gguf-q8_0", "gguf-q4_1")},
        "total_vs_safetensors_route": {q: {k: _ratio(blocks[q][k], st[k]) for k in _COMPARED} for q in GGUF_ROUTES},
    }
    if doc.get("transformers_batched"):
        out["runtime_vs_batched_transformers"] = vs_batched(doc, "gguf-f32")
    return out


def vs_batched(doc: dict[str, Any], name: str) -> dict[str, Any]:
    """A GGUF route against the batched Transformers lanes (whole model, one process), per
    concurrency: decode against static batching, end-to-end (prefill included) against static and
    continuous batching. The fair counterpart of the gain against the unbatched route."""
    timing = doc["routes"][name]["timing"]
    out: dict[str, Any] = {"compares": f"{name} route / batched Transformers fp32, whole model (static batching; "
                                       "continuous batching where available), same prompts and lengths",
                          "by_sessions": {}}
    for c, b in sorted(doc["transformers_batched"].items(), key=lambda kv: int(kv[0])):
        t = timing.get(c, {})
        st, cb = b.get("static") or {}, b.get("continuous") or {}
        out["by_sessions"][c] = {
            "decode_vs_static": _ratio(t.get("decode_tok_s"), st.get("decode_tok_s")),
            "end_to_end_vs_static": _ratio(t.get("end_to_end_tok_s"), st.get("end_to_end_tok_s")),
            "end_to_end_vs_continuous": (_ratio(t.get("end_to_end_tok_s"), cb.get("end_to_end_tok_s"))
                                         if cb.get("available") else None),
            "continuous": "measured" if cb.get("available") else (cb.get("reason") or "not run"),
            "route_decode_tok_s": t.get("decode_tok_s"), "static_decode_tok_s": st.get("decode_tok_s"),
            "route_end_to_end_tok_s": t.get("end_to_end_tok_s"), "static_end_to_end_tok_s": st.get("end_to_end_tok_s"),
            "continuous_end_to_end_tok_s": cb.get("end_to_end_tok_s"),
        }
    return out


# ---- repeats ----------------------------------------------------------------------------------------

# the last part of a timed metric's name starts with one of these
_TIMED = ("decode_tokens_per_second", "prefill_tokens_per_second", "ttft_seconds", "token_latency_", "throughput_c")


def repeat_doc(doc: dict[str, Any], k: int) -> dict[str, Any]:
    """The gate document with the speed figures of repeat ``k`` alone (quality and memory figures,
    measured once, are shared)."""
    rep = doc["repeats"][k]
    out = dict(doc)
    out["routes"] = {n: {**r, "timing": rep["routes"][n]["timing"]} for n, r in doc["routes"].items()}
    out["whole"] = {n: {**w, **rep["whole"][n]} for n, w in doc["whole"].items()}
    return out


def paired_repeats(contract: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    """Per GGUF route, per timed threshold measured against the whole model: the ratio in every
    repeat (both sides from that repeat), its median, and the ratio judged (of the medians)."""
    timed = [Threshold(**t) for t in contract.get("thresholds", [])
             if t.get("baseline") and t["metric"].split(".")[-1].startswith(_TIMED)]
    reps = [repeat_doc(doc, k) for k in range(len(doc.get("repeats") or []))]
    out: dict[str, Any] = {}
    for name in GGUF_ROUTES:
        judged = results_for(doc, name)
        per = [results_for(r, name) for r in reps]
        out[name] = {}
        for t in timed:
            vals = [_margin(t, r)[0] for r in per]
            known = [v for v in vals if v is not None]
            out[name][t.id] = {"op": t.op, "bound": t.value, "judged": _margin(t, judged)[0], "repeats": vals,
                               "median_of_repeats": statistics.median(known) if known else None,
                               "repeats_met": sum(1 for v in known if meets(v, t.op, t.value))}
    return out


def _margin(t: Threshold, results: dict[str, Any]) -> tuple[float | None, float | None]:
    """(checked value, value / bound as a 'how far from passing' factor: < 1 misses)."""
    v = _num(_get(results, t.metric))
    if v is None:
        return None, None
    if t.baseline:
        b = _num(_get(results, t.baseline))
        if not b:
            return None, None
        v = v / b
    if t.op == ">=":
        return v, (v / t.value if t.value else None)
    return v, (t.value / v if v else float("inf"))


def judge(contract: dict[str, Any], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per GGUF route: every threshold's verdict, the stop condition, and the misses by margin."""
    out = {}
    for name, res in results.items():
        verdicts = check(contract, res)
        misses = []
        for raw in contract.get("thresholds", []):
            t = Threshold(**raw)
            v = next(x for x in verdicts if x.id == t.id)
            if v.status == "fail":
                val, m = _margin(t, res)
                misses.append({"id": t.id, "description": t.description, "value": val, "bound": t.value,
                               "margin": m, "detail": v.detail})
        misses.sort(key=lambda x: (x["margin"] is not None, x["margin"] or 0.0))
        stop = next(x for x in verdicts if x.id == "stop_condition")
        required = {t["id"] for t in contract.get("thresholds", []) if t.get("required", True)}
        out[name] = {"verdicts": [v.__dict__ for v in verdicts], "stop_condition": stop.__dict__,
                     "qualifies": stop.status == "pass",
                     "required_passed": all(v.status == "pass" for v in verdicts if v.id in required),
                     "misses": misses}
    return out


def recommend(judged: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    """Exactly one of: promote GGUF, optimize a measured bottleneck (a bounded task), stop."""
    qualifying = [n for n, j in judged.items() if j["qualifies"]]
    if not qualifying:
        return {"decision": "stop", "text": "Stop the native GGUF track: no GGUF route at acceptable drift beats the "
                                            "distributed safetensors route on decode speed or fit (the DGR-001 stop "
                                            "condition)."}
    passing = [n for n in qualifying if judged[n]["required_passed"]]
    if passing:
        best = max(passing, key=lambda n: route_block(doc, n)["decode_tokens_per_second"] or 0.0)
        return {"decision": "promote", "recipe": best,
                "text": f"Promote GGUF: the {best} route meets every required DGR-001 threshold and the stop "
                        "condition against the distributed safetensors route."}
    # the qualifying route closest to passing; its worst miss is the bottleneck to work on
    best = min(qualifying, key=lambda n: (len(judged[n]["misses"]), -(route_block(doc, n)["decode_tokens_per_second"] or 0)))
    miss = judged[best]["misses"][0]
    rb = route_block(doc, best)
    hops = ", ".join(f"{h * 1e3:.2f}" for h in (rb.get("hop_decode_rtt_seconds") or []))
    others = ", ".join(m["id"] for m in judged[best]["misses"][1:])
    val = "missing" if miss["value"] is None else f"{miss['value']:.3g}"
    return {"decision": "optimize", "recipe": best, "bottleneck": miss["id"], "measured": miss["value"],
            "bound": miss["bound"],
            "text": f"Optimize a measured bottleneck before promoting GGUF: on the {best} route (it passes the stop "
                    f"condition against the distributed safetensors route), {miss['id']} is {val} against "
                    f"{miss['bound']:g} ({miss['description']}). Bounded task: bring {miss['id']} to the bound on this "
                    f"scenario without moving any threshold, re-judged by `dgr accept DGR-014`; decode round trip "
                    f"per hop now {hops} ms." + (f" Also missed: {others}." if others else "")}
