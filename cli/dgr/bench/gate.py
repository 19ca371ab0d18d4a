"""The release gate's measurements (DGR-014): the distributed safetensors route and the
distributed GGUF routes (F32, Q8_0, Q4_1) on one scenario, through one route driver.

Every route splits the model the same way (default: two halves, 0:15 | 15:30 on SmolLM2, one
process per Shard on this host), gets the same token ids (the shipped text and the DGR-001 fixed prompts, tokenized once),
the same lengths, greedy sampling and concurrency 1, 4 and 8, with the routes interleaved per
concurrency so a shared host's drift hits them alike. The speed section runs ``repeats`` times
(default 3), each repeat measuring every route and its whole-model yardsticks side by side, in
the opposite order to the repeat before; the figures judged are each metric's median over the
repeats, and every repeat is kept (``doc["repeats"]``) so that the paired ratios' spread can be
shown. One gate run on a 2-core host swings a ratio by 10-30 % between runs, which is wider than
most thresholds' margins; a median of paired repeats is what a threshold can be held to.

The artifacts are DGR-001's: safetensors fp32 dequantized from the embedded GGUF, an F32 GGUF
converted from it, Q8_0/Q4_1 quantized from that (:func:`dgr.hf_export.prepare`, reused when present).

- safetensors route: :mod:`dgr.bench.hf_worker` processes (Transformers), driven stepwise;
- GGUF routes: dgr-worker processes, in the driver's default (chained) mode, one token per
  answer so every token is timed when it is made;
- per GGUF recipe, the whole model as the contract's baseline: llama-bench (pp; tg at depth
  n_prompt), llama-batched-bench (aggregate tg at each concurrency) and one whole-model
  dgr-worker through the same driver (TTFT, p95 token latency, peak RSS, greedy tokens,
  perplexity, measured exactly as on the route);
- the whole Transformers model as the safetensors route's parity reference;
- the batched Transformers lanes (:mod:`dgr.bench.hf_batched`, whole model, one process): static
  batching at every concurrency, and Transformers' continuous batching where the installed
  version has it. The safetensors route stays the contract's "current route" lane (unbatched,
  labelled so); the gains are reported against both.

Quality through the protocol: greedy tokens of the fixed prompts, and teacher-forced scoring of
the shipped text (each text token fed as the next decode input, the tail's top-k logprobs read
back). The protocol returns the top-k logprobs (k <= 64), not the whole distribution: a text
token outside the top k is scored at the k-th logprob (its true logprob is lower), so this
perplexity is a lower bound, computed the same way for every route and whole model; the clipped
share is recorded. :mod:`dgr.bench.gate_judge` turns the document into contract results.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..errors import DgrError
from ..procfs import status_bytes
from .stats import percentile

_log = logging.getLogger(__name__)

SCHEMA = "dgr.bench.gate/1"
SAFETENSORS = "safetensors-fp32"
GGUF_ROUTES = {"gguf-f32": "gguf-f32", "gguf-q8_0": "gguf-q8_0", "gguf-q4_1": "gguf-q4_1"}
MAX_REPEATS = 9
# when repeats are combined: what is a worst case (the largest), what is a list of events (all)
_WORST = frozenset({"sessions_left", "kv_cells_left", "kv_cells_peak", "rss_peak_bytes", "active_sessions_peak"})
_ALL = frozenset({"failures"})


@dataclass(frozen=True)
class GateConfig:
    split: tuple[tuple[int, int], ...] = ()   # () = two halves of the model's layers
    threads: int = 1
    n_prompt: int = 128
    n_gen: int = 64
    concurrency: tuple[int, ...] = (1, 4, 8)
    quality_tokens: int = 32
    score_tokens: int = 256        # teacher-forced text tokens scored per route (0: the whole text)
    score_chunk: int = 128
    top_logprobs: int = 64
    backend: str = "cpu"
    quick: bool = False
    repeats: int = 3               # speed-section repeats; the judged figures are their medians

    @classmethod
    def make(cls, *, threads: int | None = None, quick: bool = False, repeats: int | None = None) -> "GateConfig":
        t = threads or max(1, (os.cpu_count() or 2) - 1)
        if repeats is not None and not 1 <= repeats <= MAX_REPEATS:
            raise DgrError(f"repeats must be between 1 and {MAX_REPEATS}, got {repeats}")
        if quick:
            return cls(threads=t, n_prompt=32, n_gen=8, quality_tokens=8, score_tokens=96, score_chunk=48,
                       quick=True, repeats=repeats or 1)
        return cls(threads=t, repeats=repeats or cls.repeats)

    @property
    def ctx_per_session(self) -> int:
        return max(self.n_prompt + self.n_gen, self.score_chunk, 128 + self.quality_tokens) + 16


# ---- inputs ----------------------------------------------------------------------------------

def inputs(hf_dir: Path, cfg: GateConfig) -> dict[str, Any]:
    from .baseline import _tokenize, load_inputs

    text, prompts = load_inputs()
    text_ids, prompt_ids = _tokenize(hf_dir, text, prompts)
    p, c = cfg.n_prompt, max(cfg.concurrency)
    if len(text_ids) < p + c:
        raise DgrError(f"the shipped text has {len(text_ids)} tokens; the gate needs {p + c}")
    step = max(1, (len(text_ids) - p) // max(1, c - 1))
    perf = [text_ids[k * step:k * step + p] for k in range(c)]   # distinct windows of the same text
    score = text_ids[:cfg.score_tokens] if cfg.score_tokens else text_ids
    return {"prompts": prompt_ids, "perf": perf, "score": score, "text_tokens": len(text_ids)}


# ---- through the protocol ---------------------------------------------------------------------

async def score_text(endpoints: Sequence[str], ids: Sequence[int], *, chunk: int, top: int) -> dict[str, Any]:
    """Teacher-forced scoring through the route, chunk by chunk (one session per chunk): each
    position's top-1 id and the logprob of the text's next token (clipped at the k-th logprob
    when it is not among the top k)."""
    from ..route.driver import RouteDriver, Sampling

    d = await RouteDriver(list(endpoints), chain=False).connect()
    argmax: list[int] = []
    nll = 0.0
    n = clipped = 0
    try:
        for c0 in range(0, len(ids) - 1, chunk):
            part = list(ids[c0:c0 + chunk + 1])
            if len(part) < 2:
                break
            # teacher forcing: output k is the route's prediction after part[:k + 1]
            r = await d.generate([part[0]], max_tokens=len(part) - 1, session_id=f"score-{c0}",
                                 sampling=Sampling(top_logprobs=top, ignore_eog=True), stop_on_eog=False,
                                 forced_tokens=part[1:])
            if r.error is not None:
                raise r.error
            for pos, (tok, top_k) in enumerate(zip(r.tokens, r.top_logprobs)):
                tops = dict(top_k)
                nxt = part[pos + 1]
                argmax.append(tok)
                if nxt in tops:
                    nll -= tops[nxt]
                else:
                    nll -= min(tops.values())
                    clipped += 1
                n += 1
    finally:
        await d.close()
    return {"argmax": argmax, "n_scored": n, "nll_sum": nll, "clipped": clipped,
            "perplexity": math.exp(nll / n) if n else None, "clipped_share": clipped / n if n else None}


async def greedy(endpoints: Sequence[str], prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """Greedy tokens per fixed prompt, one session at a time (exact parity is per session)."""
    from ..route.driver import RouteDriver, Sampling

    d = await RouteDriver(list(endpoints)).connect()
    try:
        out = []
        for p in prompts:
            r = await d.generate(list(p), max_tokens=n, sampling=Sampling(ignore_eog=True), stop_on_eog=False)
            if r.error is not None:
                raise DgrError(f"greedy run failed: {r.error}")
            out.append(list(r.tokens))
        return out
    finally:
        await d.close()


def timing(endpoints: Sequence[str], pids: Sequence[int], ranges: Sequence[str], prompts: Sequence[Sequence[int]],
           n_gen: int) -> dict[str, Any]:
    """One concurrent run (one session per prompt): speeds, token latencies, memory, KV, cleanup."""
    from ..route.driver import Sampling

    from ..route.sessions import WorkerStats, run_sessions

    stats = [WorkerStats(r, e, p) for r, e, p in zip(ranges, endpoints, pids)]
    rep = asyncio.run(run_sessions(list(endpoints), [""] * len(prompts), token_prompts=[list(p) for p in prompts],
                                   max_tokens=n_gen, sampling=Sampling(ignore_eog=True), stop_on_eog=False,
                                   stats=stats, pids=list(pids), label="gate", timeout=300.0,
                                   tokens_per_answer=1))
    ok = [s for s in rep.sessions if s.error is None]
    gaps = [b - a for s in ok for a, b in zip(s.token_times_s, s.token_times_s[1:])]
    s0 = rep.sessions[0]
    c = len(prompts)
    return {
        "sessions": c, "mode": rep.mode, "wall_s": rep.wall_s,
        "end_to_end_tok_s": c * n_gen / rep.wall_s if rep.wall_s else None,  # as the batched Transformers lanes
        "failures": [s.error for s in rep.sessions if s.error],
        "ttft_s": rep.mean_ttft_s,
        "prefill_tok_s": s0.prefill_tok_s if c == 1 else rep.aggregate_prefill_tok_s,
        "decode_tok_s": s0.decode_tok_s if c == 1 else (rep.concurrent_decode_tok_s or rep.aggregate_decode_tok_s),
        "aggregate_decode_window_tok_s": rep.aggregate_decode_tok_s,
        "token_latency_p50_s": percentile(gaps, 0.50), "token_latency_p95_s": percentile(gaps, 0.95),
        "seam_bytes_per_decode_token": rep.seam_bytes_per_decode_token,
        "hop_decode_rtt_s": rep.hop_decode_rtt_s,
        "workers": [{"range": w.range, "rss_peak_bytes": w.rss_peak_bytes, "kv_cells_peak": w.kv_cells_peak,
                     "kv_cells_total": w.kv_cells_total, "active_sessions_peak": w.active_sessions_peak,
                     "mean_batch_rows": w.mean_batch_rows, "mean_queue_wait_s": w.mean_queue_wait_s,
                     "sessions_left": w.sessions_left, "kv_cells_left": w.kv_cells_left} for w in stats],
        "driver_cpu_s": rep.driver_cpu_s,
    }


def transformers_batched(hf_dir: Path, prompts: Sequence[Sequence[int]], cfg: GateConfig, work: Path,
                         log: Any) -> dict[str, Any]:
    """One ``python -m dgr.bench.hf_batched`` process: static and continuous batching of ``prompts``."""
    import sys

    from .llama_tools import run_measured

    c = len(prompts)
    conf = {"hf_dir": str(hf_dir), "threads": cfg.threads, "prompts": [list(p) for p in prompts],
            "n_gen": cfg.n_gen, "modes": ["static", "continuous"]}
    cpath, rpath = work / f"batched-c{c}.json", work / f"batched-c{c}.result.json"
    cpath.write_text(json.dumps(conf))
    m = run_measured([sys.executable, "-m", "dgr.bench.hf_batched", cpath, rpath],
                     env={"HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}, log=log)
    if m.returncode != 0:
        raise DgrError(f"the batched Transformers lane failed (exit {m.returncode}): {m.stderr.strip()[-400:]}")
    out = json.loads(rpath.read_text())
    out["peak_rss_bytes"] = m.peak_rss_bytes
    return out


# ---- repeats --------------------------------------------------------------------------------------

def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def combine(records: Sequence[Any], key: str = "") -> Any:
    """One record from the same record measured in several repeats: a number is the median of the
    repeats' numbers (``None`` ones left out), except a worst case (sessions or KV cells left
    after a run, peaks) which is the largest; a list of failures is every repeat's; dicts and
    equal-length lists combine item by item; anything else (labels, commands) is the first
    repeat's."""
    vals = list(records)
    if not vals:
        return None
    first = vals[0]
    if key in _ALL and all(isinstance(v, list) for v in vals):
        return [x for v in vals for x in v]
    if isinstance(first, dict) and all(isinstance(v, dict) for v in vals):
        return {k: combine([v[k] for v in vals if k in v], k) for k in first}
    if isinstance(first, list) and all(isinstance(v, list) and len(v) == len(first) for v in vals):
        return [combine([v[i] for v in vals], key) for i in range(len(first))]
    nums = [v for v in vals if _is_num(v)]
    if nums and all(v is None or _is_num(v) for v in vals):
        return max(nums) if key in _WORST else statistics.median(nums)
    return first


# ---- the run ------------------------------------------------------------------------------------

def run_gate(source: Path, cfg: GateConfig) -> dict[str, Any]:
    """Measure every route and yardstick; returns the ``dgr.bench.gate/1`` document."""
    from contextlib import ExitStack

    from .hf_export import prepare, require_baseline_extra, sha256_file
    from .llama_lane import CommandLog
    from ..gguf.models import model_dir
    from ..route.local import LocalRoute, ensure_worker
    from .route import _batched_bench, _llama_bench
    from .hf_route import HfRoute, whole_model_greedy

    require_baseline_extra()
    ensure_worker(cfg.backend)
    log = CommandLog()
    art_root = model_dir() / "baseline" / sha256_file(source)[:16]
    manifest = prepare(source, art_root, threads=cfg.threads, log=log)
    arts = manifest["artifacts"]
    hf_dir = art_root / arts["safetensors"]["path"]
    n_layer = int(manifest["model"]["n_layer"])
    split = cfg.split or ((0, n_layer // 2), (n_layer // 2, n_layer))
    if n_layer < 2 or split[-1][1] != n_layer:
        raise DgrError(f"split ends at layer {split[-1][1]}; the model has {n_layer} layers")
    inp = inputs(hf_dir, cfg)
    ranges = [f"{a}:{b}" for a, b in split]
    max_s = max(cfg.concurrency)
    ctx = cfg.ctx_per_session
    doc: dict[str, Any] = {"schema": SCHEMA, "config": {**{k: getattr(cfg, k) for k in (
        "threads", "n_prompt", "n_gen", "quality_tokens", "score_chunk", "top_logprobs", "backend", "quick",
        "repeats")}, "judged_on": "each metric's median over the repeats (worst case for leftovers and peaks)",
        "split": ranges, "concurrency": list(cfg.concurrency), "ctx_per_session": ctx,
        "score_tokens": len(inp["score"]), "prompts": len(inp["prompts"]), "sampling": "greedy",
        "hosts": "one host, loopback (one process per Shard)"},
        "model": manifest["model"], "source": manifest["source"],
        "artifacts": {k: {m: v.get(m) for m in ("bytes", "sha256", "made_by", "format")} for k, v in arts.items()},
        "routes": {}, "whole": {}, "transformers_batched": {}, "commands": log.entries}
    import tempfile

    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dgr-gate-")))
        _log.info(f"starting the safetensors route ({', '.join(ranges)}, transformers shard workers)")
        hf = stack.enter_context(HfRoute(hf_dir, split, threads=cfg.threads, max_sessions=max_s,
                                         ctx_per_session=ctx, artifact_id=arts["safetensors"]["sha256"]))
        routes: dict[str, tuple[list[str], list[int], int]] = {
            SAFETENSORS: (hf.endpoints, hf.pids, arts["safetensors"]["bytes"])}
        wholes: dict[str, Any] = {}
        for name, key in GGUF_ROUTES.items():
            model = art_root / arts[key]["path"]
            _log.info(f"starting the {name} route ({', '.join(ranges)}) and its whole-model dgr-worker")
            lr = stack.enter_context(LocalRoute(model, split, threads=cfg.threads, max_sessions=max_s,
                                                ctx_per_session=ctx, backend=cfg.backend))
            lw = stack.enter_context(LocalRoute(model, [(0, n_layer)], threads=cfg.threads, max_sessions=max_s,
                                                ctx_per_session=ctx, backend=cfg.backend))
            routes[name] = (lr.endpoints, [w.pid for w in lr.workers], arts[key]["bytes"])
            wholes[name] = (lw.endpoints, [w.pid for w in lw.workers], model)
        for name, (eps, _pids, _b) in routes.items():   # warm up every route once
            asyncio.run(greedy(eps, [inp["prompts"][0]], 2))
        # quality: greedy tokens and teacher-forced scoring, per route and per whole model
        for name, (eps, pids, nbytes) in routes.items():
            _log.info(f"{name} route: greedy tokens of {len(inp['prompts'])} fixed prompts, scoring "
                     f"{len(inp['score'])} text tokens")
            doc["routes"][name] = {"endpoints": eps, "ranges": ranges, "artifact_bytes": nbytes,
                                   "greedy": asyncio.run(greedy(eps, inp["prompts"], cfg.quality_tokens)),
                                   "score": asyncio.run(score_text(eps, inp["score"], chunk=cfg.score_chunk,
                                                                   top=cfg.top_logprobs)),
                                   "timing": {}}
        for name, (eps, pids, model) in wholes.items():
            _log.info(f"{name} whole model (1 dgr-worker): greedy tokens and scoring")
            doc["whole"][name] = {"greedy": asyncio.run(greedy(eps, inp["prompts"], cfg.quality_tokens)),
                                  "score": asyncio.run(score_text(eps, inp["score"], chunk=cfg.score_chunk,
                                                                  top=cfg.top_logprobs)),
                                  "worker_timing": {}, "llama_bench": {}, "llama_batched_bench": {}}
        _log.info("transformers whole model (parity reference of the safetensors route)")
        doc["transformers_whole"] = {"greedy": [r["tokens"] for r in whole_model_greedy(
            hf_dir, inp["prompts"], cfg.quality_tokens, threads=cfg.threads)]}
        # speed: per repeat and concurrency, every route and whole model back to back (the order flips
        # every repeat); the batched Transformers lanes (reported, not judged) run in the first repeat
        reps: list[dict[str, Any]] = []
        for k in range(cfg.repeats):
            rep: dict[str, Any] = {"routes": {n: {"timing": {}} for n in routes},
                                   "whole": {n: {"worker_timing": {}, "llama_bench": {}, "llama_batched_bench": {}}
                                             for n in wholes}}
            lanes = [("route", n) for n in routes] + [("whole", n) for n in wholes]
            if k % 2:
                lanes.reverse()
            rep["order"] = [f"{kind}:{n}" for kind, n in lanes]
            for c in cfg.concurrency:
                prompts = inp["perf"][:c]
                for kind, name in lanes:
                    if kind == "route":
                        eps, pids, _b = routes[name]
                        _log.info(f"repeat {k + 1}/{cfg.repeats}, {c} session(s): {name} route")
                        rep["routes"][name]["timing"][str(c)] = timing(eps, pids, ranges, prompts, cfg.n_gen)
                        continue
                    eps, pids, model = wholes[name]
                    _log.info(f"repeat {k + 1}/{cfg.repeats}, {c} session(s): {name} whole model ("
                              + ("dgr-worker, llama-bench)" if c == 1 else f"llama-batched-bench B={c})"))
                    w = rep["whole"][name]
                    if c == 1:   # the contract's TTFT and p95 baselines: the whole model through the same driver
                        w["worker_timing"][str(c)] = timing(eps, pids, [f"0:{n_layer}"], prompts, cfg.n_gen)
                        w["llama_bench"] = _llama_bench(model, cfg.threads, cfg.n_prompt, cfg.n_gen, 1, cfg.backend)
                    else:
                        b = _batched_bench(model, cfg.threads, cfg.n_prompt, cfg.n_gen, (c,), cfg.backend)
                        w["llama_batched_bench"][str(c)] = {"command": b["command"], **b["by_batch"][str(c)]}
                if k == 0:
                    _log.info(f"{c} session(s): batched Transformers, whole model (static and continuous batching)")
                    doc["transformers_batched"][str(c)] = transformers_batched(hf_dir, prompts, cfg, work, log)
            reps.append(rep)
        doc["repeats"] = reps
        for name in routes:
            doc["routes"][name]["timing"] = combine([r["routes"][name]["timing"] for r in reps])
        for name in wholes:
            for part in ("worker_timing", "llama_bench", "llama_batched_bench"):
                doc["whole"][name][part] = combine([r["whole"][name][part] for r in reps])
        for name, (eps, pids, _b) in routes.items():
            doc["routes"][name]["peak_rss_bytes"] = [status_bytes(p, "VmHWM") for p in pids]
        for name, (eps, pids, _m) in wholes.items():
            doc["whole"][name]["peak_rss_bytes"] = status_bytes(pids[0], "VmHWM")
    return doc


def write(doc: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n")
