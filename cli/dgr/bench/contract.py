"""The DGR-001 performance contract: written once from a baseline run, consumed by later gates.

A contract holds the lanes, the hardware class, the baseline metrics it was measured from, the
**thresholds** later results must meet and an explicit **stop condition** for the native GGUF
track. Thresholds are ratios against baselines measured *in the same later run* (this hardware
is shared and noisy), except where a bound is absolute by nature (failures, seam
bytes per token, drift bounds taken from this run's measured cross-runtime parity).

Later results (``dgr.bench.results/1``) name three blocks measured side by side::

    {"schema": "dgr.bench.results/1", "recipe": "llama.cpp-q4_1",
     "whole_model": {...},         # whole-model llama.cpp, same artifact, same run
     "route": {...},               # the distributed route under test
     "transformers_fp32": {...}}   # optional: the safetensors reference, for the stop condition

:func:`check` evaluates every threshold and the stop condition and returns one verdict per item.
No torch, no model: this module is what the tests and `dgr bench check` call.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import DgrError

CONTRACT_SCHEMA = "dgr.bench.contract"
CONTRACT_SCHEMA_VERSION = 1
RESULTS_SCHEMA = "dgr.bench.results/1"

# Stop condition parameters (fixed before any distributed result exists).
MIN_DECODE_SPEEDUP = 1.5          # GGUF decode / transformers fp32 decode, same run
MAX_FIT_ARTIFACT_RATIO = 0.5      # GGUF artifact bytes / safetensors fp32 bytes
MAX_FIT_RSS_RATIO = 0.75          # GGUF peak RSS / transformers fp32 peak RSS
MAX_DRIFT_PERPLEXITY_RATIO = 1.05  # perplexity on the shipped text / transformers fp32
MIN_DRIFT_TOP1_AGREEMENT = 0.90   # teacher-forced top-1 agreement on the shipped text


@dataclass(frozen=True)
class Threshold:
    id: str
    lane: str                     # "performance" or "quality"
    description: str
    metric: str                   # dotted path in a results JSON
    op: str                       # ">=" or "<="
    value: float
    baseline: str | None = None   # dotted path of the same-run baseline; the checked value is metric/baseline
    required: bool = True         # a missing optional metric is skipped, a missing required one fails


@dataclass(frozen=True)
class Verdict:
    id: str
    status: str                   # "pass", "fail" or "skip"
    detail: str


def _get(doc: dict, path: str) -> Any:
    cur: Any = doc
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, list):  # a list of failures counts as its length
        return float(len(v))
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def meets(x: float, op: str, bound: float) -> bool:
    """Whether ``x`` meets a threshold's bound under its operator (``>=`` or ``<=``)."""
    if op == ">=":
        return x >= bound
    if op == "<=":
        return x <= bound
    raise DgrError(f"contract threshold has unknown operator {op!r}")


def thresholds_for(n_embd: int, quality_logits_max_abs_diff: float | None) -> list[Threshold]:
    """The thresholds later gates must meet; the only measured inputs are the model width (for
    the seam bound) and this run's same-precision cross-runtime logits difference."""
    seam_bound = math.ceil(1.25 * n_embd * 4)  # f32 residual per token per seam + 25% framing
    logits_bound = max(float(quality_logits_max_abs_diff or 0.0), 1e-3)
    return [
        Threshold("route_decode_vs_whole_model", "performance",
                  "route decode tok/s >= 90% of whole-model llama.cpp (llama-bench tg), same artifact, same run",
                  "route.decode_tokens_per_second", ">=", 0.90, "whole_model.decode_tokens_per_second"),
        Threshold("route_prefill_vs_whole_model", "performance",
                  "route prefill tok/s >= 95% of whole-model llama.cpp (llama-bench pp)",
                  "route.prefill_tokens_per_second", ">=", 0.95, "whole_model.prefill_tokens_per_second"),
        Threshold("route_c4_aggregate_vs_batched_bench", "performance",
                  "route aggregate decode tok/s at 4 sessions >= 90% of llama-batched-bench at 4",
                  "route.throughput_c4_tokens_per_second", ">=", 0.90, "whole_model.throughput_c4_tokens_per_second"),
        Threshold("route_ttft_vs_whole_model", "performance",
                  "route time to first token <= 1.25x whole-model",
                  "route.ttft_seconds", "<=", 1.25, "whole_model.ttft_seconds"),
        Threshold("route_p95_token_latency_vs_whole_model", "performance",
                  "route p95 per-token decode latency <= 1.20x whole-model",
                  "route.token_latency_p95_seconds", "<=", 1.20, "whole_model.token_latency_p95_seconds"),
        Threshold("route_max_shard_rss_vs_whole_model", "performance",
                  "the largest shard's peak RSS <= the whole model's peak RSS (a shard must fit where the whole does not)",
                  "route.max_shard_peak_rss_bytes", "<=", 1.0, "whole_model.peak_rss_bytes"),
        Threshold("route_seam_bytes_per_token", "performance",
                  f"bytes crossing one seam per decoded token <= 1.25 x n_embd x 4 = {seam_bound}",
                  "route.seam_bytes_per_token_per_seam", "<=", float(seam_bound)),
        Threshold("route_failures", "performance", "no failed requests",
                  "route.failures", "<=", 0.0),
        Threshold("route_perplexity_vs_whole_model", "quality",
                  "route perplexity on the shipped text <= 1.01x whole-model (the split adds no drift)",
                  "route.perplexity", "<=", 1.01, "whole_model.perplexity"),
        Threshold("route_greedy_agreement_vs_whole_model", "quality",
                  "greedy tokens of the route agree with whole-model on >= 95% of the fixed-prompt prefix",
                  "route.greedy_agreement_vs_whole_model", ">=", 0.95),
        Threshold("route_logits_max_abs_diff_vs_whole_model", "quality",
                  "route logits stay within the measured same-precision transformers-vs-llama.cpp difference "
                  f"({logits_bound:.4g})",
                  "route.logits_max_abs_diff_vs_whole_model", "<=", logits_bound, None, False),
    ]


def stop_condition() -> dict[str, Any]:
    return {
        "rule": (f"Stop the native GGUF track when no GGUF recipe at acceptable drift (perplexity <= "
                 f"{MAX_DRIFT_PERPLEXITY_RATIO}x and top-1 agreement >= {MIN_DRIFT_TOP1_AGREEMENT} against "
                 f"transformers fp32 on the shipped text) gives either decode >= {MIN_DECODE_SPEEDUP}x "
                 f"transformers fp32 or a fit advantage (artifact <= {MAX_FIT_ARTIFACT_RATIO}x and peak RSS <= "
                 f"{MAX_FIT_RSS_RATIO}x transformers fp32), measured side by side in one run."),
        "min_decode_speedup": MIN_DECODE_SPEEDUP,
        "fit": {"max_artifact_ratio": MAX_FIT_ARTIFACT_RATIO, "max_peak_rss_ratio": MAX_FIT_RSS_RATIO},
        "acceptable_drift": {"max_perplexity_ratio": MAX_DRIFT_PERPLEXITY_RATIO,
                             "min_top1_agreement": MIN_DRIFT_TOP1_AGREEMENT},
        "later_results": {"candidate": "route", "reference": "transformers_fp32",
                          "drift_metrics": ["top1_agreement_vs_transformers_fp32", "perplexity"]},
    }


def evaluate_stop(candidate: dict, reference: dict, cond: dict) -> dict[str, Any]:
    """Does ``candidate`` (a GGUF recipe or a route) justify the native track against ``reference``
    (transformers fp32)? Returns the ratios and ``qualifies``."""
    def ratio(key: str) -> float | None:
        a, b = _num(candidate.get(key)), _num(reference.get(key))
        return a / b if a is not None and b not in (None, 0.0) else None

    speedup = ratio("decode_tokens_per_second")
    artifact = ratio("artifact_bytes")
    rss = ratio("peak_rss_bytes")
    ppl = ratio("perplexity")
    top1 = _num(candidate.get("top1_agreement_vs_transformers_fp32"))
    drift = cond["acceptable_drift"]
    drift_ok = (ppl is not None and ppl <= drift["max_perplexity_ratio"]
                and top1 is not None and top1 >= drift["min_top1_agreement"])
    faster = speedup is not None and speedup >= cond["min_decode_speedup"]
    fits = (artifact is not None and artifact <= cond["fit"]["max_artifact_ratio"]
            and rss is not None and rss <= cond["fit"]["max_peak_rss_ratio"])
    return {"decode_speedup": speedup, "artifact_ratio": artifact, "peak_rss_ratio": rss,
            "perplexity_ratio": ppl, "top1_agreement": top1, "drift_ok": drift_ok,
            "speed_advantage": faster, "fit_advantage": fits,
            "qualifies": bool(drift_ok and (faster or fits))}


def build_contract(baseline: dict[str, Any]) -> dict[str, Any]:
    """The contract from a ``dgr bench baseline`` results document."""
    recipes = baseline.get("recipes") or {}
    ref = recipes.get("transformers-fp32")
    if not ref or ref.get("failures"):
        raise DgrError("the baseline has no successful transformers-fp32 recipe; a contract needs it")
    parity = (baseline.get("lanes", {}).get("quality", {}).get("parity", {}) or {}).get("llama.cpp-f32", {})
    n_embd = int(baseline.get("model", {}).get("n_embd") or 0)
    if n_embd <= 0:
        raise DgrError("the baseline does not record the model width (model.n_embd)")
    cond = stop_condition()
    evaluated = {}
    for name, rec in recipes.items():
        if name.startswith("llama.cpp-") and not rec.get("failures"):
            evaluated[name] = evaluate_stop(rec, ref, cond)
    cond["evaluated_now"] = evaluated
    cond["verdict_now"] = "continue" if any(v["qualifies"] for v in evaluated.values()) else "stop"
    keys = ("prefill_tokens_per_second", "decode_tokens_per_second", "ttft_seconds",
            "token_latency_p50_seconds", "token_latency_p95_seconds", "throughput_c1_tokens_per_second",
            "throughput_c4_tokens_per_second", "peak_rss_bytes", "artifact_bytes", "perplexity",
            "top1_agreement_vs_transformers_fp32", "greedy_agreement_vs_transformers_fp32")
    return {
        "schema": CONTRACT_SCHEMA,
        "schema_version": CONTRACT_SCHEMA_VERSION,
        "story": "DGR-001",
        "created_utc": baseline.get("created_utc"),
        "results_schema": RESULTS_SCHEMA,
        "measured_from": {"schema": baseline.get("schema"), "quick": baseline.get("quick"),
                          "config": baseline.get("config"), "artifacts": baseline.get("artifacts"),
                          "runtime": baseline.get("runtime")},
        "hardware_class": baseline.get("hardware"),
        "model": baseline.get("model"),
        "lanes": {
            "quality": {"claim": "same-precision parity: transformers fp32 vs llama.cpp F32 GGUF converted "
                                 "from the same safetensors; logits max abs diff, top-1 and greedy agreement",
                        "recipes": ["transformers-fp32", "llama.cpp-f32"], "parity": parity},
            "performance": {"claim": "speed and fit of quantized and reduced-precision recipes, with drift "
                                     "against transformers fp32 reported beside each number, never as parity",
                            "recipes": sorted(recipes), "reference": "transformers-fp32",
                            "ratios": baseline.get("lanes", {}).get("performance", {}).get("ratios", {})},
        },
        "baseline_metrics": {name: {k: rec.get(k) for k in keys if k in rec} for name, rec in recipes.items()},
        "thresholds": [asdict(t) for t in thresholds_for(n_embd, parity.get("logits_max_abs_diff"))],
        "threshold_policy": ("ratios are computed against the whole-model baseline measured in the same later "
                             "run; thresholds are fixed here, before the distributed route exists, and are "
                             "never moved after seeing its results"),
        "stop_condition": cond,
    }


def load_contract(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DgrError(f"contract not found: {path}", hint="run `dgr accept DGR-001` to write it") from None
    except json.JSONDecodeError as exc:
        raise DgrError(f"contract {path} is not JSON: {exc}") from None
    if doc.get("schema") != CONTRACT_SCHEMA:
        raise DgrError(f"{path} is not a dgr performance contract (schema {doc.get('schema')!r})")
    if doc.get("schema_version") != CONTRACT_SCHEMA_VERSION:
        raise DgrError(f"contract {path} has schema_version {doc.get('schema_version')!r}; "
                       f"this dgr reads version {CONTRACT_SCHEMA_VERSION}")
    return doc


def load_results(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DgrError(f"results file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise DgrError(f"results {path} is not JSON: {exc}") from None
    if doc.get("schema") != RESULTS_SCHEMA:
        raise DgrError(f"{path} is not a {RESULTS_SCHEMA} document (schema {doc.get('schema')!r})")
    return doc


def check(contract: dict[str, Any], results: dict[str, Any]) -> list[Verdict]:
    """One verdict per threshold, then one for the stop condition."""
    out: list[Verdict] = []
    for raw in contract.get("thresholds", []):
        t = Threshold(**raw)
        value = _num(_get(results, t.metric))
        base = _num(_get(results, t.baseline)) if t.baseline else None
        if value is None or (t.baseline and base is None):
            missing = t.metric if value is None else t.baseline
            out.append(Verdict(t.id, "fail" if t.required else "skip", f"metric {missing} missing"))
            continue
        if t.baseline:
            if base == 0.0:
                out.append(Verdict(t.id, "fail", f"baseline {t.baseline} is zero"))
                continue
            x = value / base
            shown = f"{t.metric}/{t.baseline} = {value:.6g}/{base:.6g} = {x:.4f} {t.op} {t.value:g}"
        else:
            x = value
            shown = f"{t.metric} = {value:.6g} {t.op} {t.value:g}"
        out.append(Verdict(t.id, "pass" if meets(x, t.op, t.value) else "fail", shown))
    cond = contract.get("stop_condition") or {}
    ref = results.get("transformers_fp32")
    cand = results.get((cond.get("later_results") or {}).get("candidate", "route"))
    if not isinstance(ref, dict) or not isinstance(cand, dict):
        out.append(Verdict("stop_condition", "skip", "no transformers_fp32 block in the results; not evaluated"))
    else:
        ev = evaluate_stop(cand, ref, cond)
        detail = (f"decode x{_fmt(ev['decode_speedup'])}, artifact x{_fmt(ev['artifact_ratio'])}, "
                  f"RSS x{_fmt(ev['peak_rss_ratio'])}, perplexity x{_fmt(ev['perplexity_ratio'])}, "
                  f"top-1 {_fmt(ev['top1_agreement'])}: "
                  + ("continue the native track" if ev["qualifies"] else "STOP the native track"))
        out.append(Verdict("stop_condition", "pass" if ev["qualifies"] else "fail", detail))
    return out


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def hardware_note(contract: dict[str, Any], results: dict[str, Any]) -> str | None:
    """A warning when the results come from another hardware class (ratios still apply)."""
    a, b = contract.get("hardware_class") or {}, results.get("hardware") or {}
    if not b:
        return None
    if a.get("class") and b.get("class") and a["class"] != b["class"]:
        return (f"results hardware class {b['class']} differs from the contract's {a['class']}; "
                "ratio thresholds still apply, absolute numbers are not comparable")
    return None
