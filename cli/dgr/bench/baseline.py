"""`dgr bench baseline`: Transformers/safetensors versus whole-model llama.cpp, side by side.

From one source GGUF (default: the embedded SmolLM2-135M Q4_1) the run makes a safetensors
checkpoint (dequantized weights, sha256 recorded), an F32 GGUF converted from it with the pinned
``convert_hf_to_gguf.py`` and Q8_0/Q4_1 GGUFs quantized with the pinned ``llama-quantize``
(:mod:`dgr.bench.hf_export`). Then five recipes see the same token ids, context and output lengths,
greedy sampling and concurrency (1 and 4):

- ``transformers-fp32`` (the reference) and ``transformers-bf16`` (:mod:`dgr.bench.hf_lane`);
- ``llama.cpp-f32``, ``llama.cpp-q8_0``, ``llama.cpp-q4_1`` (:mod:`dgr.bench.llama_lane`).

Two lanes, never mixed in one claim: **quality** = same-precision parity (transformers fp32 vs
llama.cpp F32: logits max abs diff, top-1 and greedy agreement, perplexity ratio);
**performance/fit** = speed, memory and size of every recipe, each with its drift against the
fp32 reference reported beside it. Speed is compared as ratios measured in this one run.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import platform
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import __version__, paths
from ..errors import DgrError
from .hf_export import prepare, require_baseline_extra, sha256_file
from ..procfs import cpu_model
from .stats import percentile, positional_agreement, prefix_agreement  # noqa: F401
from .llama_lane import CommandLog, Measured, backend_for, batched_bench, llama_bench, run_measured, run_probe

_log = logging.getLogger(__name__)

RESULTS_SCHEMA = "dgr.bench.baseline/1"
DATA_DIR = paths.PACKAGE_DIR / "data"
TEXT_FILE = DATA_DIR / "loglik-text.txt"
PROMPTS_FILE = DATA_DIR / "prompts.json"
REFERENCE = "transformers-fp32"
HF_RECIPES = {"transformers-fp32": "fp32", "transformers-bf16": "bf16"}
GGUF_RECIPES = {"llama.cpp-f32": "gguf-f32", "llama.cpp-q8_0": "gguf-q8_0", "llama.cpp-q4_1": "gguf-q4_1"}


@dataclass(frozen=True)
class BaselineConfig:
    device: str = "cpu"
    threads: int = 2
    prompt_tokens: int = 128      # performance prompt (prefill) length
    gen_tokens: int = 64          # tokens decoded in the timed runs
    prompt_gen_tokens: int = 32   # greedy tokens per fixed prompt (agreement)
    score_chunk: int = 256        # perplexity chunk length
    score_max_tokens: int = 0     # 0 = the whole shipped text
    reps: int = 3                 # timing repetitions (prefill, TTFT; llama-bench -r)
    rounds: int = 3               # timed decode / concurrency rounds; llama.cpp recipes interleaved per round
    concurrency: tuple[int, ...] = (1, 4)
    quick: bool = False

    @classmethod
    def make(cls, *, device: str = "cpu", threads: int | None = None, quick: bool = False) -> "BaselineConfig":
        threads = threads or os.cpu_count() or 1
        if quick:
            return cls(device=device, threads=threads, prompt_tokens=64, gen_tokens=16, prompt_gen_tokens=8,
                       score_chunk=128, score_max_tokens=256, reps=1, rounds=1, quick=True)
        return cls(device=device, threads=threads)

    @property
    def n_ctx(self) -> int:
        return max(self.score_chunk, self.prompt_tokens + self.gen_tokens, 128 + self.prompt_gen_tokens) + 16


def load_inputs() -> tuple[str, list[str]]:
    text = TEXT_FILE.read_text(encoding="utf-8")
    prompts = json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))["prompts"]
    return text, prompts


def hardware(cfg: BaselineConfig) -> dict[str, Any]:
    cpu = cpu_model()
    ncpu = os.cpu_count() or 0
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpu = None
    if cfg.device == "cuda":
        try:
            import torch  # the baseline extra is present whenever this runs

            gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "unavailable"
        except Exception:  # hardware description is best-effort
            gpu = "unknown"
    return {"class": f"{cfg.device}-{platform.machine()}-{ncpu}cpu" + (f"-{gpu}" if gpu else ""),
            "device": cfg.device, "machine": platform.machine(), "cpu": cpu, "logical_cpus": ncpu,
            "memory_bytes": mem, "gpu": gpu, "threads": cfg.threads, "os": platform.platform()}


# ---- the run -------------------------------------------------------------------------------

def _tokenize(hf_dir: Path, text: str, prompts: list[str]) -> tuple[list[int], list[list[int]]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    text_ids = tok.encode(text, add_special_tokens=False).ids
    prompt_ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
    return text_ids, prompt_ids


def _hf_process(name: str, dtype: str, mode: str, hf_dir: Path, cfg: BaselineConfig, inputs: dict, work: Path,
                log: CommandLog) -> tuple[dict, Measured]:
    """One ``python -m dgr.bench.hf_lane`` process: ``full`` (greedy prompts, logits, scoring and one
    timing round) or ``speed`` (one more timing round)."""
    conf = {"hf_dir": str(hf_dir), "dtype": dtype, "device": cfg.device, "threads": cfg.threads, "mode": mode,
            "prompts": inputs["prompts"], "gen_tokens": cfg.prompt_gen_tokens,
            "perf": {"ids": inputs["perf"], "n_gen": cfg.gen_tokens, "reps": cfg.reps, "rounds": 1},
            "concurrency": list(cfg.concurrency), "c_prompts": inputs["c_prompts"],
            "score": {"ids": inputs["score"], "chunk": cfg.score_chunk},
            "logits_out": str(work / f"{name}.logits.npy")}
    cpath, rpath = work / f"{name}.json", work / f"{name}.result.json"
    cpath.write_text(json.dumps(conf))
    m = run_measured([sys.executable, "-m", "dgr.bench.hf_lane", cpath, rpath],
                     env={"HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}, log=log)
    if m.returncode != 0:
        raise DgrError(f"{name} failed (exit {m.returncode}): {m.stderr.strip()[-400:]}")
    return json.loads(rpath.read_text()), m


def _hf_recipe(name: str, dtype: str, hf_dir: Path, cfg: BaselineConfig, inputs: dict, work: Path,
               log: CommandLog) -> tuple[dict, Any]:
    import numpy as np

    r, m = _hf_process(name, dtype, "full", hf_dir, cfg, inputs, work, log)
    rec = {
        "runtime": "transformers", "precision": dtype, "device": cfg.device,
        "peak_rss_bytes": m.peak_rss_bytes,
        "vram_peak_bytes": r.get("vram_peak_bytes"),
        "greedy_tokens": [g["tokens"] for g in r["gen"]],
        "perf_tokens": r["perf_runs"][0]["tokens"],
        "score": r["score"],
        "versions": {"torch": r.get("torch")},
        "timing_runs": [r],
    }
    _hf_speed_metrics(rec, cfg)
    return rec, np.load(work / f"{name}.logits.npy")


def _hf_speed_metrics(rec: dict, cfg: BaselineConfig) -> None:
    """Speeds from every timing run of a transformers recipe: best run; latency percentiles pooled."""
    runs = [x for r in rec["timing_runs"] for x in r["perf_runs"]]
    prefill = [x for r in rec["timing_runs"] for x in r["prefill_seconds"]]
    conc_samples = {c: [x for r in rec["timing_runs"] for x in r["concurrency"][str(c)]] for c in cfg.concurrency}
    lat = [x for run in runs for x in run["token_latency_s"]]
    conc = {str(c): _best(v) for c, v in conc_samples.items()}
    rec.update({
        "ttft_seconds": min(run["ttft_s"] for run in runs),
        "prefill_tokens_per_second": cfg.prompt_tokens / min(prefill),
        "decode_tokens_per_second": max(len(run["token_latency_s"]) / sum(run["token_latency_s"]) for run in runs),
        "token_latency_p50_seconds": percentile(lat, 0.50),
        "token_latency_p95_seconds": percentile(lat, 0.95),
        "throughput_c1_tokens_per_second": conc.get("1", {}).get("decode_tokens_per_second"),
        "throughput_c4_tokens_per_second": conc.get("4", {}).get("decode_tokens_per_second"),
        "concurrency": conc,
        "samples": {"prefill_seconds": prefill,
                    "decode_tokens_per_second": [len(run["token_latency_s"]) / sum(run["token_latency_s"])
                                                 for run in runs],
                    "concurrency": {str(c): v for c, v in conc_samples.items()}},
    })


def _gguf_recipe(name: str, model: Path, cfg: BaselineConfig, inputs: dict, work: Path,
                 log: CommandLog) -> tuple[dict, Any]:
    import numpy as np

    jobs: list[tuple[str, int, list[int]]] = [("run", 2, inputs["perf"][:8])]  # warm-up
    jobs += [("gen", cfg.prompt_gen_tokens, ids) for ids in inputs["prompts"]]
    jobs += [("run", cfg.gen_tokens, inputs["perf"])] * cfg.reps
    jobs += [("score", cfg.score_chunk, inputs["score"])]
    rows, logits_file, pm = run_probe(model, jobs, threads=cfg.threads, device=cfg.device, n_ctx=cfg.n_ctx,
                                      work=work, tag=name, log=log)
    gen_rows = rows[1:1 + len(inputs["prompts"])]
    perf_rows = rows[1 + len(inputs["prompts"]):-1]
    score = rows[-1]
    lat = [x for r in perf_rows for x in r["token_latency_s"]]
    n_vocab = inputs["n_vocab"]
    logits = np.fromfile(logits_file, dtype=np.float32).reshape(-1, n_vocab)
    rec = {
        "runtime": "llama.cpp", "precision": name.split("-", 1)[1], "device": cfg.device,
        "ttft_seconds": min(r["ttft_s"] for r in perf_rows),
        "probe_prefill_tokens_per_second": cfg.prompt_tokens / min(r["ttft_s"] for r in perf_rows),
        "probe_decode_tokens_per_second": max(len(r["token_latency_s"]) / sum(r["token_latency_s"])
                                              for r in perf_rows),
        "token_latency_p50_seconds": percentile(lat, 0.50),
        "token_latency_p95_seconds": percentile(lat, 0.95),
        "vram_peak_bytes": None,  # not measured for llama.cpp (CPU here; see the limitations)
        "peak_rss_bytes_by_process": {"probe": pm.peak_rss_bytes},
        "greedy_tokens": [r["tokens"] for r in gen_rows],
        "perf_tokens": perf_rows[0]["tokens"] if perf_rows else [],
        "score": {"nll_sum": score["nll_sum"], "n_scored": score["n_scored"], "top1": score["top1"]},
    }
    logits_file.unlink(missing_ok=True)
    return rec, logits


def _best(samples: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the best (highest) rate over samples: the run least disturbed by other work."""
    keys = {k for s in samples for k in s}
    return {k: max(s[k] for s in samples if s.get(k) is not None) for k in sorted(keys)}


def _speed_rounds(hf: dict[str, str], gguf: dict[str, Path], recipes: dict[str, dict], cfg: BaselineConfig,
                  hf_dir: Path, inputs: dict, work: Path, log: CommandLog) -> None:
    """Timing rounds over every recipe, interleaved (transformers processes, llama-bench and
    llama-batched-bench in turn), so a burst of other work on the host does not land on one
    recipe only; each recipe keeps its best run."""
    samples: dict[str, dict[str, list]] = {n: {"llama_bench": [], "batched_bench": []} for n in gguf}
    for _ in range(cfg.rounds):
        for name, dtype in hf.items():
            r, m = _hf_process(name, dtype, "speed", hf_dir, cfg, inputs, work, log)
            recipes[name]["timing_runs"].append(r)
            recipes[name]["peak_rss_bytes"] = max(recipes[name]["peak_rss_bytes"], m.peak_rss_bytes)
        for name, model in gguf.items():
            samples[name]["llama_bench"].append(
                llama_bench(model, threads=cfg.threads, device=cfg.device, n_prompt=cfg.prompt_tokens,
                            n_gen=cfg.gen_tokens, reps=max(cfg.reps, 2), log=log))
            samples[name]["batched_bench"].append(
                batched_bench(model, threads=cfg.threads, device=cfg.device, n_prompt=cfg.prompt_tokens,
                              n_gen=cfg.gen_tokens, concurrency=list(cfg.concurrency), log=log))
    for name in hf:
        _hf_speed_metrics(recipes[name], cfg)
    for name, smp in samples.items():
        rec = recipes[name]
        lbs, bbs = smp["llama_bench"], smp["batched_bench"]
        conc = {str(c): _best([b["by_concurrency"][str(c)] for b in bbs]) for c in cfg.concurrency}
        rec["prefill_tokens_per_second"] = max(b["pp_tokens_per_second"] for b in lbs)
        rec["decode_tokens_per_second"] = max(b["tg_tokens_per_second"] for b in lbs)
        rec["throughput_c1_tokens_per_second"] = conc.get("1", {}).get("decode_tokens_per_second")
        rec["throughput_c4_tokens_per_second"] = conc.get("4", {}).get("decode_tokens_per_second")
        rec["concurrency"] = conc
        rec["samples"] = {"llama_bench": lbs, "batched_bench": bbs}
        rss = rec["peak_rss_bytes_by_process"]
        rss["llama-bench"] = max(b["peak_rss_bytes"] for b in lbs)
        rss["llama-batched-bench"] = max(b["peak_rss_bytes"] for b in bbs)
        rec["peak_rss_bytes"] = max(rss["probe"], rss["llama-batched-bench"])


def _drift(rec: dict, ref: dict, logits, ref_logits) -> dict[str, Any]:
    import numpy as np

    sc, rs = rec["score"], ref["score"]
    out = {
        "greedy_agreement_vs_transformers_fp32": statistics.mean(
            prefix_agreement(a, b) for a, b in zip(rec["greedy_tokens"], ref["greedy_tokens"])),
        "greedy_positional_agreement_vs_transformers_fp32": statistics.mean(
            positional_agreement(a, b) for a, b in zip(rec["greedy_tokens"], ref["greedy_tokens"])),
        "top1_agreement_vs_transformers_fp32": positional_agreement(sc["top1"], rs["top1"]),
    }
    if logits is not None and ref_logits is not None and logits.shape == ref_logits.shape:
        d = np.abs(logits.astype(np.float64) - ref_logits.astype(np.float64))
        out["prompt_logits_max_abs_diff_vs_transformers_fp32"] = float(d.max())
        out["prompt_logits_mean_abs_diff_vs_transformers_fp32"] = float(d.mean())
        out["prompt_top1_agreement_vs_transformers_fp32"] = float(
            (logits.argmax(-1) == ref_logits.argmax(-1)).mean())
    return out


def run_baseline(source: Path, cfg: BaselineConfig, *, work: Path | None = None) -> dict[str, Any]:
    """Measure every recipe; returns the ``dgr.bench.baseline/1`` document."""
    import math
    import tempfile

    require_baseline_extra()
    backend_for(cfg.device)
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise DgrError("--device cuda but torch sees no CUDA device",
                           hint="install a CUDA build of torch on a GPU host, or use --device cpu")
    log = CommandLog()
    from ..gguf.models import model_dir

    src_sha = sha256_file(source)
    art_root = model_dir() / "baseline" / src_sha[:16]
    manifest = prepare(source, art_root, threads=cfg.threads, log=log)
    hf_dir = art_root / manifest["artifacts"]["safetensors"]["path"]
    text, prompts = load_inputs()
    text_ids, prompt_ids = _tokenize(hf_dir, text, prompts)
    p = cfg.prompt_tokens
    if len(text_ids) < 4 * p:
        raise DgrError(f"the shipped text has {len(text_ids)} tokens; {4 * p} needed for 4 sessions of {p}")
    inputs = {"prompts": prompt_ids, "perf": text_ids[:p],
              "c_prompts": [text_ids[k * p:(k + 1) * p] for k in range(max(cfg.concurrency))],
              "score": text_ids[:cfg.score_max_tokens] if cfg.score_max_tokens else text_ids,
              "n_vocab": int(manifest["model"]["n_vocab"])}
    recipes: dict[str, dict] = {}
    logits: dict[str, Any] = {}
    failures: list[dict[str, str]] = []
    owned_tmp = None
    if work is None:
        owned_tmp = tempfile.TemporaryDirectory(prefix="dgr-baseline-")
        work = Path(owned_tmp.name)
    try:
        for name, dtype in HF_RECIPES.items():
            _log.info(f"measuring {name}")
            try:
                recipes[name], logits[name] = _hf_recipe(name, dtype, hf_dir, cfg, inputs, work, log)
            except DgrError as exc:
                failures.append({"recipe": name, "error": exc.one_line()})
                recipes[name] = {"failures": [exc.one_line()]}
        measured: dict[str, Path] = {}
        for name, key in GGUF_RECIPES.items():
            _log.info(f"measuring {name} (probe)")
            try:
                model = art_root / manifest["artifacts"][key]["path"]
                recipes[name], logits[name] = _gguf_recipe(name, model, cfg, inputs, work, log)
                measured[name] = model
            except DgrError as exc:
                failures.append({"recipe": name, "error": exc.one_line()})
                recipes[name] = {"failures": [exc.one_line()]}
        hf_ok = {n: d for n, d in HF_RECIPES.items() if not recipes[n].get("failures")}
        if measured or hf_ok:
            _log.info(f"{cfg.rounds} interleaved timing round(s) over {', '.join([*hf_ok, *measured])}")
            try:
                _speed_rounds(hf_ok, measured, recipes, cfg, hf_dir, inputs, work, log)
            except DgrError as exc:
                for name in [*hf_ok, *measured]:
                    failures.append({"recipe": name, "error": exc.one_line()})
                    recipes[name] = {"failures": [exc.one_line()]}
    finally:
        if owned_tmp is not None:
            owned_tmp.cleanup()

    arts = manifest["artifacts"]
    for name, rec in recipes.items():
        if rec.get("failures"):
            continue
        rec.setdefault("failures", [])
        key = "safetensors" if name in HF_RECIPES else GGUF_RECIPES[name]
        rec["artifact"] = key
        rec["artifact_bytes"] = arts[key]["bytes"]
        sc = rec["score"]
        rec["nll_per_token"] = sc["nll_sum"] / sc["n_scored"]
        rec["perplexity"] = math.exp(rec["nll_per_token"])
    ref = recipes.get(REFERENCE, {})
    ratios: dict[str, dict] = {}
    parity: dict[str, dict] = {}
    if ref and not ref.get("failures"):
        for name, rec in recipes.items():
            if rec.get("failures"):
                continue
            rec.update(_drift(rec, ref, logits.get(name), logits.get(REFERENCE)))
            rec["perplexity_ratio_vs_transformers_fp32"] = rec["perplexity"] / ref["perplexity"]

            def r(k: str) -> float | None:
                a, b = rec.get(k), ref.get(k)
                return a / b if a is not None and b else None

            ratios[name] = {"prefill_vs_transformers_fp32": r("prefill_tokens_per_second"),
                            "decode_vs_transformers_fp32": r("decode_tokens_per_second"),
                            "ttft_vs_transformers_fp32": r("ttft_seconds"),
                            "throughput_c4_vs_transformers_fp32": r("throughput_c4_tokens_per_second"),
                            "peak_rss_vs_transformers_fp32": r("peak_rss_bytes"),
                            "artifact_vs_transformers_fp32": r("artifact_bytes"),
                            "perplexity_vs_transformers_fp32": r("perplexity"),
                            "top1_agreement_vs_transformers_fp32": rec["top1_agreement_vs_transformers_fp32"],
                            "greedy_agreement_vs_transformers_fp32": rec["greedy_agreement_vs_transformers_fp32"]}
        f32 = recipes.get("llama.cpp-f32", {})
        if f32 and not f32.get("failures"):
            parity["llama.cpp-f32"] = {
                "reference": REFERENCE,
                "logits_max_abs_diff": f32.get("prompt_logits_max_abs_diff_vs_transformers_fp32"),
                "logits_mean_abs_diff": f32.get("prompt_logits_mean_abs_diff_vs_transformers_fp32"),
                "top1_agreement_prompt_positions": f32.get("prompt_top1_agreement_vs_transformers_fp32"),
                "top1_agreement_text": f32["top1_agreement_vs_transformers_fp32"],
                "greedy_agreement": f32["greedy_agreement_vs_transformers_fp32"],
                "perplexity_ratio": f32["perplexity_ratio_vs_transformers_fp32"],
                "n_logit_rows": int(logits["llama.cpp-f32"].shape[0]),
            }
    for rec in recipes.values():  # bulky lists stay out of the summary blocks
        rec.pop("timing_runs", None)
        if "score" in rec:
            rec["score"] = {"nll_sum": rec["score"]["nll_sum"], "n_scored": rec["score"]["n_scored"]}

    versions = {}
    from importlib import metadata

    for pkg in ("torch", "transformers", "safetensors", "tokenizers", "accelerate"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    from ..upstream import pin as pin_mod

    return {
        "schema": RESULTS_SCHEMA,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": cfg.quick,
        "config": {**asdict(cfg), "concurrency": list(cfg.concurrency), "n_ctx": cfg.n_ctx,
                   "sampling": "greedy (argmax), no penalties",
                   "statistic": "speeds: best run over the timing rounds (all recipes interleaved per round); "
                                "latency percentiles pooled over all timed runs",
                   "text_sha256": sha256_file(TEXT_FILE), "prompts_sha256": sha256_file(PROMPTS_FILE),
                   "text_tokens": len(text_ids), "scored_tokens": len(inputs["score"]),
                   "prompt_token_counts": [len(x) for x in prompt_ids]},
        "hardware": hardware(cfg),
        "runtime": {"dgr_version": __version__, "pin_commit": pin_mod.load_pin().commit, "packages": versions},
        "model": {**manifest["model"], "source": manifest["source"]},
        "artifacts": {k: {kk: vv for kk, vv in v.items() if kk != "path"} for k, v in arts.items()},
        "recipes": recipes,
        "lanes": {
            "quality": {"claim": "same-precision parity (fp32 vs F32); no quantized recipe appears here",
                        "reference": REFERENCE, "recipes": [REFERENCE, "llama.cpp-f32"], "parity": parity},
            "performance": {"claim": "speed/fit per recipe with drift vs transformers fp32 beside it; "
                                     "bf16/Q8_0/Q4_1 are never claimed numerically equivalent to fp32",
                            "reference": REFERENCE, "recipes": list(recipes), "ratios": ratios},
        },
        "failures": failures,
        "commands": log.entries,
    }


def summary(doc: dict[str, Any]) -> str:
    """A plain-text table of a baseline document (ratios against transformers fp32)."""
    lines = [f"hardware {doc['hardware']['class']}, threads {doc['config']['threads']}, "
             f"prompt {doc['config']['prompt_tokens']} tok, decode {doc['config']['gen_tokens']} tok"
             + (" (quick)" if doc.get("quick") else ""),
             f"{'recipe':20} {'prefill/s':>9} {'decode/s':>8} {'c4 dec/s':>8} {'TTFT ms':>8} {'p95 ms':>7} "
             f"{'RSS MiB':>8} {'size MiB':>8} {'ppl':>7} {'top1':>5} {'greedy':>6} {'dec x':>6}"]
    ratios = doc["lanes"]["performance"]["ratios"]

    def f(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    for name, r in doc["recipes"].items():
        if r.get("failures"):
            lines.append(f"{name:20} FAILED: {r['failures'][0][:80]}")
            continue
        lines.append(
            f"{name:20} {f(r.get('prefill_tokens_per_second'), '9.1f')} {f(r.get('decode_tokens_per_second'), '8.1f')} "
            f"{f(r.get('throughput_c4_tokens_per_second'), '8.1f')} {f((r.get('ttft_seconds') or 0) * 1e3, '8.1f')} "
            f"{f((r.get('token_latency_p95_seconds') or 0) * 1e3, '7.1f')} {f(r['peak_rss_bytes'] / 2**20, '8.0f')} "
            f"{f(r['artifact_bytes'] / 2**20, '8.1f')} {f(r.get('perplexity'), '7.3f')} "
            f"{f(r.get('top1_agreement_vs_transformers_fp32'), '5.3f')} "
            f"{f(r.get('greedy_agreement_vs_transformers_fp32'), '6.3f')} "
            f"{f(ratios.get(name, {}).get('decode_vs_transformers_fp32'), '6.2f')}")
    par = doc["lanes"]["quality"]["parity"].get("llama.cpp-f32")
    if par:
        lines.append(f"quality lane (fp32 vs F32 GGUF): logits max |diff| {par['logits_max_abs_diff']:.4g}, "
                     f"mean {par['logits_mean_abs_diff']:.3g}, top-1 {par['top1_agreement_prompt_positions']:.3f} "
                     f"(prompts) / {par['top1_agreement_text']:.3f} (text), greedy {par['greedy_agreement']:.3f}, "
                     f"perplexity x{par['perplexity_ratio']:.4f}")
    return "\n".join(lines)
