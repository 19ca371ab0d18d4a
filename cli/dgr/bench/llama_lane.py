"""Whole-model llama.cpp measurements at the pin for the DGR-001 baseline.

Pinned tools do the speed numbers (``llama-bench`` for prefill/decode, ``llama-batched-bench``
for aggregate throughput at 1 and 4 sessions); a small probe program (``worker/tools/dgr_llama_probe.cpp``,
linked against the same static libraries) does what they do not: greedy decoding of given token
ids with per-token timings, prompt logits for parity, and log-likelihood of the shipped text.
Every subprocess is timed and its peak RSS taken with ``wait4``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..upstream import build
from ..errors import DgrError
from . import llama_tools
from .llama_tools import CommandLog, Measured, run_measured  # noqa: F401 - re-exported for the lanes

PROBE_NAME = "dgr-llama-probe"


def backend_for(device: str) -> str:
    if device == "cpu":
        return "cpu"
    if device == "cuda":
        return "cuda"
    raise DgrError(f"unknown device {device!r}; choose cpu or cuda")


def gpu_layers(device: str) -> str:
    return "0" if device == "cpu" else "99"


def probe_binary(backend: str = "cpu") -> Path:
    """dgr-llama-probe (worker/tools/dgr_llama_probe.cpp), built by CMake against the pinned
    static libraries of ``backend`` (up to date on every call)."""
    return build.tool_binary(PROBE_NAME, backend)


# ---- pinned tools ------------------------------------------------------------------------

def llama_bench(model: Path, *, threads: int, device: str, n_prompt: int, n_gen: int, reps: int,
                log: CommandLog) -> dict[str, Any]:
    exe = build.tool_binary("llama-bench", backend_for(device))
    rows, m = llama_tools.llama_bench(exe, model, threads=threads, n_prompt=n_prompt, n_gen=n_gen, reps=reps,
                                      gpu_layers=gpu_layers(device), log=log)
    out: dict[str, Any] = {"peak_rss_bytes": m.peak_rss_bytes}
    for r in rows:
        if r.is_prefill:
            out["pp_tokens_per_second"] = r.avg_ts
            out["pp_stddev"] = r.stddev_ts
        elif r.is_decode:
            out["tg_tokens_per_second"] = r.avg_ts
            out["tg_stddev"] = r.stddev_ts
    if "pp_tokens_per_second" not in out or "tg_tokens_per_second" not in out:
        raise DgrError("llama-bench printed no pp/tg rows")
    return out


def batched_bench(model: Path, *, threads: int, device: str, n_prompt: int, n_gen: int,
                  concurrency: list[int], log: CommandLog) -> dict[str, Any]:
    exe = build.tool_binary("llama-batched-bench", backend_for(device))
    n_ctx = max(concurrency) * (n_prompt + n_gen) + 64
    rows, m = llama_tools.batched_bench(exe, model, threads=threads, n_prompt=n_prompt, n_gen=n_gen,
                                        npl=concurrency, ctx=n_ctx, batch=2048, ubatch=512,
                                        gpu_layers=gpu_layers(device), log=log)
    return {"peak_rss_bytes": m.peak_rss_bytes,
            "by_concurrency": {str(c): {"decode_tokens_per_second": rows[c].speed_tg,
                                        "prefill_tokens_per_second": rows[c].speed_pp,
                                        "total_tokens_per_second": rows[c].speed} for c in concurrency}}


# ---- the probe -----------------------------------------------------------------------------

def run_probe(model: Path, jobs: list[tuple[str, int, list[int]]], *, threads: int, device: str,
              n_ctx: int, work: Path, tag: str, log: CommandLog) -> tuple[list[dict], Path, Measured]:
    """Run probe jobs ``(kind, arg, ids)``; returns the per-job JSON, the logits file, the process."""
    exe = probe_binary(backend_for(device))
    jobs_file = work / f"{tag}.jobs"
    jobs_file.write_text("".join(f"{k} {a} {' '.join(map(str, ids))}\n" for k, a, ids in jobs))
    logits = work / f"{tag}.logits.f32"
    m = run_measured([exe, "-m", model, "-t", str(threads), "-c", str(n_ctx), "-ngl", gpu_layers(device),
                      "--jobs", jobs_file, "--logits-out", logits], log=log)
    if m.returncode != 0:
        raise DgrError(f"{PROBE_NAME} failed on {model.name} (exit {m.returncode}): {m.stderr.strip()[-300:]}")
    rows = [json.loads(line) for line in m.stdout.splitlines() if line.startswith("{")]
    if len(rows) != len(jobs):
        raise DgrError(f"{PROBE_NAME} answered {len(rows)} of {len(jobs)} jobs")
    return rows, logits, m
