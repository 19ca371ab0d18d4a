"""Whole-model llama.cpp figures for `dgr demo`: stock ``llama-batched-bench`` at the pin, on the
same model, threads, prompt length and answer length as the route, at one session and at the
demo's concurrency (DESIGN.md §8: side by side, same run).

Per batch size B it reports what the demo table shows for the route: time to first token
(llama-batched-bench's prompt phase: B prompts of ``n_prompt`` tokens, then one token each),
prefill and decode tok/s (aggregate; per session = aggregate / B), the process's peak RSS
(``wait4`` rusage of the child) and the KV bytes its sequences hold (cells used x bytes per
cell of the model's f16 K/V).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import DgrError


@dataclass(frozen=True)
class WholeRow:
    sessions: int
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float          # aggregate over the B sessions
    per_session_decode_tok_s: float
    kv_bytes: int


@dataclass(frozen=True)
class WholeLlama:
    command: list[str]
    rows: list[WholeRow]
    peak_rss_bytes: int
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        return {"tool": "llama-batched-bench", "command": self.command, "peak_rss_bytes": self.peak_rss_bytes,
                "wall_s": self.wall_s, "rows": [asdict(r) for r in self.rows]}


def batched_bench_command(exe: Path, model: Path, *, threads: int, n_prompt: int, n_gen: int,
                          sessions: tuple[int, ...]) -> list[str]:
    ctx = max(sessions) * (n_prompt + n_gen) + 256
    return [str(exe), "-m", str(model), "-c", str(ctx), "-b", "512", "-ub", "512", "-npp", str(n_prompt),
            "-ntg", str(n_gen), "-npl", ",".join(str(b) for b in sessions), "-t", str(threads),
            "--output-format", "jsonl"]


def parse_rows(stdout: str, kv_bytes_per_cell: int) -> list[WholeRow]:
    rows = []
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        b = int(r["pl"])
        # prompt phase = B prompts in one go; the first token of each follows its prompt
        ttft = float(r["t_pp"]) + float(r["t_tg"]) / max(1, int(r["tg"]))
        rows.append(WholeRow(sessions=b, ttft_s=ttft, prefill_tok_s=float(r["speed_pp"]),
                             decode_tok_s=float(r["speed_tg"]), per_session_decode_tok_s=float(r["speed_tg"]) / b,
                             kv_bytes=int(r["n_kv"]) * kv_bytes_per_cell))
    return rows


def measure_whole_llama(model: Path, *, threads: int, n_prompt: int, n_gen: int, sessions: tuple[int, ...] = (1, 4),
                        backend: str = "cpu") -> WholeLlama:
    from ..upstream.build import tool_binary
    from .local import kv_bytes_per_cell, model_n_layer

    exe = tool_binary("llama-batched-bench", backend)
    cmd = batched_bench_command(exe, model, threads=threads, n_prompt=max(1, n_prompt), n_gen=max(1, n_gen),
                                sessions=tuple(sorted(set(sessions))))
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as fout, tempfile.TemporaryFile("w+") as ferr:
        proc = subprocess.Popen(cmd, stdout=fout, stderr=ferr, text=True)
        deadline = time.monotonic() + 1800
        while True:  # wait4: this child's own peak RSS
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                raise DgrError("llama-batched-bench took over 30 min")
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        fout.seek(0)
        ferr.seek(0)
        out, err = fout.read(), ferr.read()
    peak = usage.ru_maxrss * 1024
    if proc.returncode != 0:
        raise DgrError(f"llama-batched-bench failed (exit {proc.returncode}): {err.strip()[-300:]}")
    rows = parse_rows(out, kv_bytes_per_cell(model, 0, model_n_layer(model)))
    return WholeLlama(cmd, rows, peak, time.perf_counter() - t0)
