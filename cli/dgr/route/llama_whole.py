"""Whole-model llama.cpp figures for `dgr demo`, on the same model, threads and answer length as
the route, at one session and at the demo's concurrency (side by side, same run):

- :func:`measure_whole_llama_server` (what the demo uses): stock ``llama-server`` at the pin
  answering the demo's own chat prompts through its OpenAI API, greedy, streamed, stopping at
  end-of-generation like the route's sessions (one at a time, then all at once);
- :func:`measure_whole_llama`: stock ``llama-batched-bench`` (synthetic equal-length prompts,
  lockstep decode), kept for callers that want its shape.

Per batch size B it reports what the demo table shows for the route: time to first token
(llama-batched-bench's prompt phase: B prompts of ``n_prompt`` tokens, then one token each),
prefill and decode tok/s (aggregate; per session = aggregate / B), the process's peak RSS
(``wait4`` rusage of the child) and the KV bytes its sequences hold (cells used x bytes per
cell of the model's f16 K/V).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any



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
    tool: str = "llama-batched-bench"

    def to_json(self) -> dict[str, Any]:
        return {"tool": self.tool, "command": self.command, "peak_rss_bytes": self.peak_rss_bytes,
                "wall_s": self.wall_s, "rows": [asdict(r) for r in self.rows]}


def batched_bench_command(exe: Path, model: Path, *, threads: int, n_prompt: int, n_gen: int,
                          sessions: tuple[int, ...]) -> list[str]:
    from ..bench import llama_tools

    ctx = max(sessions) * (n_prompt + n_gen) + 256
    return llama_tools.batched_bench_command(exe, model, threads=threads, n_prompt=n_prompt, n_gen=n_gen,
                                             npl=sessions, ctx=ctx)


def parse_rows(stdout: str, kv_bytes_per_cell: int) -> list[WholeRow]:
    from ..bench.llama_tools import parse_batched_bench

    rows = []
    for b, r in sorted(parse_batched_bench(stdout).items()):
        # prompt phase = B prompts in one go; the first token of each follows its prompt
        ttft = r.t_pp + r.t_tg / max(1, r.tg)
        rows.append(WholeRow(sessions=b, ttft_s=ttft, prefill_tok_s=r.speed_pp, decode_tok_s=r.speed_tg,
                             per_session_decode_tok_s=r.speed_tg / b, kv_bytes=r.n_kv * kv_bytes_per_cell))
    return rows


def measure_whole_llama(model: Path, *, threads: int, n_prompt: int, n_gen: int, sessions: tuple[int, ...] = (1, 4),
                        backend: str = "cpu") -> WholeLlama:
    from ..bench import llama_tools
    from ..upstream.build import tool_binary
    from .local import kv_bytes_per_cell, model_n_layer

    exe = tool_binary("llama-batched-bench", backend)
    npl = tuple(sorted(set(sessions)))
    n_prompt, n_gen = max(1, n_prompt), max(1, n_gen)
    t0 = time.perf_counter()
    _, m = llama_tools.batched_bench(exe, model, threads=threads, n_prompt=n_prompt, n_gen=n_gen, npl=npl,
                                     ctx=max(npl) * (n_prompt + n_gen) + 256)
    rows = parse_rows(m.stdout, kv_bytes_per_cell(model, 0, model_n_layer(model)))
    return WholeLlama(m.argv, rows, m.peak_rss_bytes, time.perf_counter() - t0)


def measure_whole_llama_server(model: Path, *, threads: int, prompts: list[str], max_tokens: int,
                               sessions: tuple[int, ...] = (1, 4), backend: str = "cpu") -> WholeLlama:
    """Stock llama-server (whole model, ``-np`` = the most sessions) serving ``prompts`` as chat
    requests: B=1 each prompt alone in turn (means), B>1 B prompts at once (aggregate figures).
    TTFT is request -> first streamed token; the peak RSS is the server's VmHWM; KV bytes are
    the positions its sequences held at the end x bytes per cell of the model's f16 K/V."""
    from dgr.bench.loadgen import measure_llama_server

    from .local import kv_bytes_per_cell, model_n_layer

    cmd, rows, rss, wall = measure_llama_server(
        model, prompts, threads=threads, max_tokens=max(1, max_tokens), sessions=tuple(sorted(set(sessions))),
        backend=backend, kv_bytes_per_cell=kv_bytes_per_cell(model, 0, model_n_layer(model)))
    return WholeLlama(cmd, [WholeRow(**r) for r in rows], rss, wall, tool="llama-server")
