"""Whole-model llama.cpp measurements at the pin for the DGR-001 baseline.

Pinned tools do the speed numbers (``llama-bench`` for prefill/decode, ``llama-batched-bench``
for aggregate throughput at 1 and 4 sessions); a small probe program (``worker/tools/dgr_llama_probe.cpp``,
linked against the same static libraries) does what they do not: greedy decoding of given token
ids with per-token timings, prompt logits for parity, and log-likelihood of the shipped text.
Every subprocess is timed and its peak RSS taken with ``wait4``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..upstream import build
from ..errors import DgrError

PROBE_NAME = "dgr-llama-probe"


@dataclass
class Measured:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    wall_seconds: float
    peak_rss_bytes: int

    @property
    def shown(self) -> str:
        return " ".join(shlex.quote(a) for a in self.argv)


@dataclass
class CommandLog:
    """Every command a baseline run executed (written into the results JSON)."""
    entries: list[dict[str, Any]] = field(default_factory=list)

    def add(self, m: Measured) -> None:
        self.entries.append({"command": m.shown, "exit": m.returncode,
                             "wall_seconds": round(m.wall_seconds, 3), "peak_rss_bytes": m.peak_rss_bytes})


def run_measured(argv: list[str | Path], *, env: dict | None = None, timeout: float = 1800,
                 log: CommandLog | None = None, cwd: Path | None = None) -> Measured:
    """Run a command to completion, returning its output, wall time and peak RSS (wait4)."""
    args = [str(a) for a in argv]
    out_f = tempfile.TemporaryFile()
    err_f = tempfile.TemporaryFile()
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(args, stdout=out_f, stderr=err_f, env=dict(os.environ, **(env or {})), cwd=cwd)
    except FileNotFoundError as exc:
        raise DgrError(f"cannot run {args[0]}: {exc}") from None
    deadline = t0 + timeout
    rusage = None
    status = 0
    while True:
        pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            _, status, rusage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.02)
    wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    out_f.seek(0)
    err_f.seek(0)
    m = Measured(args, proc.returncode, out_f.read().decode(errors="replace"),
                 err_f.read().decode(errors="replace"), wall, int(rusage.ru_maxrss) * 1024 if rusage else 0)
    out_f.close()
    err_f.close()
    if log is not None:
        log.add(m)
    return m


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
    m = run_measured([exe, "-m", model, "-t", str(threads), "-ngl", gpu_layers(device), "-p", str(n_prompt),
                      "-n", str(n_gen), "-r", str(reps), "-o", "json"], log=log)
    if m.returncode != 0:
        raise DgrError(f"llama-bench failed (exit {m.returncode}): {m.stderr.strip()[-300:]}")
    rows = json.loads(m.stdout[m.stdout.index("["):])
    out: dict[str, Any] = {"peak_rss_bytes": m.peak_rss_bytes}
    for r in rows:
        if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0:
            out["pp_tokens_per_second"] = r["avg_ts"]
            out["pp_stddev"] = r.get("stddev_ts")
        elif r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
            out["tg_tokens_per_second"] = r["avg_ts"]
            out["tg_stddev"] = r.get("stddev_ts")
    if "pp_tokens_per_second" not in out or "tg_tokens_per_second" not in out:
        raise DgrError("llama-bench printed no pp/tg rows")
    return out


def batched_bench(model: Path, *, threads: int, device: str, n_prompt: int, n_gen: int,
                  concurrency: list[int], log: CommandLog) -> dict[str, Any]:
    exe = build.tool_binary("llama-batched-bench", backend_for(device))
    n_ctx = max(concurrency) * (n_prompt + n_gen) + 64
    m = run_measured([exe, "-m", model, "-t", str(threads), "-ngl", gpu_layers(device), "-c", str(n_ctx),
                      "-b", "2048", "-ub", "512", "-npp", str(n_prompt), "-ntg", str(n_gen),
                      "-npl", ",".join(map(str, concurrency)), "--output-format", "jsonl"], log=log)
    if m.returncode != 0:
        raise DgrError(f"llama-batched-bench failed (exit {m.returncode}): {m.stderr.strip()[-300:]}")
    rows = {}
    for line in (m.stdout + "\n" + m.stderr).splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            r = json.loads(line)
            rows[int(r["pl"])] = r
    missing = [c for c in concurrency if c not in rows]
    if missing:
        raise DgrError(f"llama-batched-bench printed no rows for concurrency {missing}")
    return {"peak_rss_bytes": m.peak_rss_bytes,
            "by_concurrency": {str(c): {"decode_tokens_per_second": rows[c]["speed_tg"],
                                        "prefill_tokens_per_second": rows[c]["speed_pp"],
                                        "total_tokens_per_second": rows[c]["speed"]} for c in concurrency}}


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
