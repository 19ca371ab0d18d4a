"""`dgr bench route`: a 2-shard route against whole-model llama.cpp, in one run, same model and
threads (ratios measured side by side, never absolute times).

Measured, interleaved per repeat so machine noise hits both sides alike; the chained route at
each concurrency is bracketed by its yardstick (llama-bench at 1 session, llama-batched-bench at
B = sessions, measured just before and just after it; the targets use the mean of the two):
- the route (local dgr-workers for the split) through the route driver in its default chained
  mode (the head forwards boundaries along the chain, the worker generates server-side):
  single-session prefill (n_prompt tokens -> first token) and decode (n_gen tokens) tok/s,
  aggregate decode at each concurrency, seam bytes per decode token per seam (the workers'
  dgr_chain_frame_bytes_sent_total / dgr_chain_frames_sent_total, phase="decode");
- the same route driven stepwise from Python (``route_stepwise``: one stream per shard, one
  frame per token per hop), with its per-hop decode round trip and frame bytes;
- the whole model on one dgr-worker through the same driver (server-side generation; isolates
  the cost of the seam);
- whole-model llama.cpp at the pin: ``llama-bench`` (pp at depth 0; tg at depth n_prompt, where
  the route decodes) and ``llama-batched-bench`` (aggregate tg at B = each concurrency, after
  its n_prompt prefill);
- the seam floor (2-shard splits; ``dgr-seam-floor``): the same lock-step generation as the
  whole model in one process, as head+tail in one process, and as head and tail in two
  processes over a socketpair, with the route workers' environment: what two processes taking
  turns on the same cores cost before any transport, against which the route's cost is read;
- llama.cpp RPC over two local ``rpc-server`` processes when the build has them (GGML_RPC);
  otherwise recorded as skipped with the reason;
- the driver's own cost on fake-model workers (CPU and round trip per hop, no model compute).

Targets (issue 6), judged on the chained route: single-session decode >= 90% and prefill >= 95%
of llama-bench; aggregate decode at 4 sessions >= 90% of llama-batched-bench B=4; seam bytes per
decode token per seam <= 2 * n_embd * 4 + 256.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..errors import DgrError
# the results and the summary (re-exported: callers read them from here)
from .route_report import (TARGET_RATIOS, _floor_summary, _median_profile, _rpc_summary, derive,  # noqa: F401
                           floor_lines, profile_lines, repeat_lines, steal_lines, summary)

_log = logging.getLogger(__name__)
SCHEMA = "dgr.bench.route/1"

@dataclass(frozen=True)
class RouteBenchConfig:
    split: tuple[tuple[int, int], ...] = ((0, 15), (15, 30))
    threads: int = 0               # 0: CPU count
    n_prompt: int = 128
    n_gen: int = 64
    concurrency: tuple[int, ...] = (1, 4)
    repeats: int = 3
    rpc: bool = True               # also llama.cpp's RPC split (builds build/<backend>-rpc once)
    backend: str = "cpu"
    driver_overhead: bool = True
    llama_server: bool = True      # also stock llama-server (whole model) streaming the same prompts


def synthetic_prompt(n: int, seed: int, n_vocab: int = 49152) -> list[int]:
    """``n`` deterministic token ids (an LCG from ``seed``) away from the special-token range."""
    x, out = seed * 2654435761 % (1 << 32), []
    for _ in range(n):
        x = (1103515245 * x + 12345) % (1 << 31)
        out.append(200 + x % (min(n_vocab, 30000) - 200))
    return out


def _cpu_times() -> tuple[int, int] | None:
    """(all, steal) CPU ticks of the host so far (Linux /proc/stat), None where unknown."""
    try:
        f = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        ticks = [int(x) for x in f[1:]]
        return sum(ticks[:8]), ticks[7] if len(ticks) > 7 else 0
    except (OSError, ValueError, IndexError):
        return None


def _steal_since(t0: tuple[int, int] | None) -> float | None:
    """Share of CPU time the hypervisor took from this VM since ``t0`` (None where unknown).
    A shared host's bursts of steal slow a measurement without any fault of its own; the share
    is recorded with every sample so a reader can see which ones a burst hit."""
    if t0 is None:
        return None
    t1 = _cpu_times()
    if t1 is None or t1[0] <= t0[0]:
        return None
    return (t1[1] - t0[1]) / (t1[0] - t0[0])


async def _measure(endpoints: list[str], n_prompt: int, n_gen: int, sessions: int, seed: int,
                   chain: bool | None = None) -> dict[str, Any]:
    from ..route.driver import Sampling

    from ..route.sessions import run_sessions

    prompts = [synthetic_prompt(n_prompt, seed + i) for i in range(sessions)]
    m0 = _compute_counters(endpoints)
    c0 = _cpu_times()
    rep = await run_sessions(endpoints, [""] * sessions, token_prompts=prompts, max_tokens=n_gen,
                             sampling=Sampling(ignore_eog=True), stop_on_eog=False, label="bench", chain=chain)
    if not rep.ok:
        raise DgrError("a benchmark session failed: " + "; ".join(s.error or "" for s in rep.sessions if s.error))
    s0 = rep.sessions[0]
    steal = _steal_since(c0)
    m1 = _compute_counters(endpoints)
    return {
        "host_steal_fraction": steal,
        "profile": _profile(m0, m1, rep.concurrent_decode_tok_s if sessions > 1 else s0.decode_tok_s),
        "sessions": sessions,
        "mode": rep.mode,
        "prefill_tok_s": s0.prefill_tok_s if sessions == 1 else rep.aggregate_prefill_tok_s,
        # B > 1: the rate while all B sessions decode together, as llama-batched-bench's S_TG (the
        # first-to-last window also holds the other sessions' prefills); that window's rate is
        # kept as aggregate_decode_window_tok_s
        "decode_tok_s": s0.decode_tok_s if sessions == 1 else (rep.concurrent_decode_tok_s
                                                               or rep.aggregate_decode_tok_s),
        "aggregate_decode_window_tok_s": rep.aggregate_decode_tok_s,
        "concurrent_decode_tok_s": rep.concurrent_decode_tok_s,
        "ttft_s": rep.mean_ttft_s,
        "seam_bytes_per_decode_token": rep.seam_bytes_per_decode_token,
        "hop_decode_rtt_s": [statistics.mean(s.hop_decode_rtt_s[i] for s in rep.sessions)
                             for i in range(len(s0.hop_decode_rtt_s))],
        "driver_cpu_s": rep.driver_cpu_s,
        "wall_s": rep.wall_s,
        # when each token reached the driver (the route's streaming cadence, route_report.cadence_of)
        "chunk_times_s": [s.token_times_s for s in rep.sessions],
        "tokens": [len(s.tokens) for s in rep.sessions],
    }


def _llama_server_level(url: str, n_prompt: int, n_gen: int, sessions: int, seed: int) -> dict[str, Any]:
    """Stock llama-server streaming the prompts :func:`_measure` sends at ``seed`` (token ids to
    ``/v1/completions``, greedy, through end-of-generation): aggregate decode, TTFT and when
    each event that carried text arrived."""
    from .loadgen import run_level

    prompts = [synthetic_prompt(n_prompt, seed + i) for i in range(sessions)]
    lv = asyncio.run(run_level(url + "/v1", "llama", prompts, max_tokens=n_gen, lane="llama_server"))
    if not lv.ok:
        raise DgrError("a llama-server request failed: " + "; ".join(r.error or "" for r in lv.requests if r.error))
    return {"sessions": sessions, "decode_tok_s": lv.aggregate_decode_tok_s,
            "ttft_s": statistics.mean(r.ttft_s for r in lv.requests),
            "chunk_times_s": [r.chunk_times_s for r in lv.requests],
            "tokens": [r.completion_tokens for r in lv.requests]}


_COUNTERS = ("dgr_decode_only_busy_seconds_total", "dgr_decode_only_batches_total", "dgr_decode_only_rows_total")


def _compute_counters(endpoints: list[str]) -> list[dict[str, float]]:
    from ..protocol.client import WorkerClient

    out = []
    for ep in endpoints:
        with WorkerClient(ep, timeout=10) as c:
            s = {m.name: m.value for m in c.metrics().samples if not m.labels}
        out.append({k: s.get(k, 0.0) for k in _COUNTERS})
    return out


def _profile(before: list[dict[str, float]], after: list[dict[str, float]], decode_tok_s: float) -> dict[str, Any]:
    """Where a decode step's time goes: per worker, compute per decode-only batch (inside
    llama_decode) and rows per batch; the wall time per step (1 / steps per second) minus the
    shards' compute is what the hand-offs cost (gRPC hops, wake-ups, sampling, the driver)."""
    per = []
    for b, a in zip(before, after):
        n = a["dgr_decode_only_batches_total"] - b["dgr_decode_only_batches_total"]
        busy = a["dgr_decode_only_busy_seconds_total"] - b["dgr_decode_only_busy_seconds_total"]
        rows = a["dgr_decode_only_rows_total"] - b["dgr_decode_only_rows_total"]
        per.append({"decode_batches": n, "compute_ms_per_batch": 1e3 * busy / n if n else 0.0,
                    "rows_per_batch": rows / n if n else 0.0})
    rows = per[0]["rows_per_batch"] if per else 0.0
    step_ms = 1e3 * rows / decode_tok_s if decode_tok_s > 0 and rows else 0.0
    compute = sum(p["compute_ms_per_batch"] for p in per)
    return {"workers": per, "step_ms": step_ms, "compute_ms_per_step": compute,
            "handoff_ms_per_step": step_ms - compute if step_ms else 0.0}


def _llama_bench(model: Path, threads: int, n_prompt: int, n_gen: int, repeats: int, backend: str) -> dict[str, Any]:
    """pp at depth 0 and tg at depth ``n_prompt``: the route decodes its n_gen tokens after an
    n_prompt prompt, and attention over a deeper cache costs more per token (a few % at 128 on
    SmolLM2, about 30 % at 512), so tg from an empty cache would flatter the yardstick."""
    from ..upstream.build import tool_binary

    from .llama_tools import llama_bench

    exe = tool_binary("llama-bench", backend)
    pp_rows, pp_m = llama_bench(exe, model, threads=threads, n_prompt=n_prompt, n_gen=0, reps=repeats)
    tg_rows, tg_m = llama_bench(exe, model, threads=threads, n_prompt=0, n_gen=n_gen, reps=repeats, depth=n_prompt)
    try:
        pp = next(r for r in pp_rows if r.is_prefill)
        tg = next(r for r in tg_rows if r.is_decode)
    except StopIteration:
        raise DgrError("llama-bench printed no pp/tg rows") from None
    return {"command": " ; ".join((pp_m.shown, tg_m.shown)), "pp_tok_s": pp.avg_ts, "tg_tok_s": tg.avg_ts,
            "tg_depth": tg.n_depth or n_prompt, "pp_stddev": pp.stddev_ts, "tg_stddev": tg.stddev_ts}


def _yardstick(model: Path, threads: int, cfg: RouteBenchConfig, sessions: int) -> dict[str, Any]:
    """Whole-model llama.cpp for one concurrency: llama-bench (pp, tg) at 1 session, else
    llama-batched-bench at B = sessions (tg as pp_tok_s/tg_tok_s of that batch size)."""
    c0 = _cpu_times()
    if sessions == 1:
        r = _llama_bench(model, threads, cfg.n_prompt, cfg.n_gen, 1, cfg.backend)
    else:
        b = _batched_bench(model, threads, cfg.n_prompt, cfg.n_gen, (sessions,), cfg.backend)
        r = {"command": b["command"], **b["by_batch"][str(sessions)]}
    return {**r, "host_steal_fraction": _steal_since(c0)}


def _bracket(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """A yardstick measured just before and just after the route: the mean of the two."""
    return {"command": before["command"], "pp_tok_s": (before["pp_tok_s"] + after["pp_tok_s"]) / 2,
            "tg_tok_s": (before["tg_tok_s"] + after["tg_tok_s"]) / 2, "before": before, "after": after}


def _seam_floor(model: Path, *, split: int, threads: int, sessions: int, n_prompt: int, n_gen: int,
                max_sessions: int, ctx: int, env: dict[str, str], backend: str) -> dict[str, Any]:
    """``dgr-seam-floor``: the same lock-step generation as the whole model in one process, as
    head+tail in one process, and as head and tail in two processes over a socketpair (no gRPC)."""
    from ..upstream.build import tool_binary

    exe = tool_binary("dgr-seam-floor", backend)
    cmd = [str(exe), "--model", str(model), "--split", str(split), "--threads", str(threads), "--sessions",
           str(sessions), "--prompt-tokens", str(n_prompt), "--gen-tokens", str(n_gen), "--rounds", "3",
           "--max-sessions", str(max_sessions), "--ctx-per-session", str(ctx)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, **env})
    if p.returncode != 0:
        raise DgrError(f"dgr-seam-floor failed: {p.stderr.strip()[-300:]}")
    doc = json.loads(p.stdout)
    m = doc["median"]
    return {"command": " ".join(cmd), "same_tokens": doc["same_tokens"],
            "whole_ms_per_step": m["whole_ms_per_step"], "in_process_ms_per_step": m["in_process_ms_per_step"],
            "two_process_ms_per_step": m["two_process_ms_per_step"],
            "whole_decode_tok_s": sessions * 1e3 / m["whole_ms_per_step"],
            "in_process_decode_tok_s": sessions * 1e3 / m["in_process_ms_per_step"],
            "two_process_decode_tok_s": sessions * 1e3 / m["two_process_ms_per_step"]}


def batched_bench_by_batch(exe: Path, model: Path, *, threads: int, n_prompt: int, n_gen: int,
                           npl: Sequence[int], extra: Sequence[str] = (), prefix: Sequence[str] = ()) -> dict[str, Any]:
    """llama-batched-bench (aggregate pp and tg per batch size of ``npl``, after an ``n_prompt``
    prefill each) as the results JSON holds it; ``extra``/``prefix`` as :mod:`dgr.bench.llama_tools`."""
    from .llama_tools import batched_bench

    ctx = max(2048, (n_prompt + n_gen) * max(npl) + 64)
    rows, m = batched_bench(exe, model, threads=threads, n_prompt=n_prompt, n_gen=n_gen, npl=npl, ctx=ctx, batch=2048,
                            extra=extra, prefix=prefix)
    return {"command": m.shown,
            "by_batch": {str(b): {"pp_tok_s": r.speed_pp, "tg_tok_s": r.speed_tg} for b, r in rows.items()}}


def _batched_bench(model: Path, threads: int, n_prompt: int, n_gen: int, npl: tuple[int, ...],
                   backend: str) -> dict[str, Any]:
    from ..upstream.build import tool_binary

    return batched_bench_by_batch(tool_binary("llama-batched-bench", backend), model, threads=threads,
                                  n_prompt=n_prompt, n_gen=n_gen, npl=npl)


async def _driver_overhead(n_tokens: int = 300) -> dict[str, Any]:
    """Two fake-model workers: what the driver and gRPC cost per decode step per hop (stepwise,
    the driver relays every token), and per token in the chained mode (the driver only reads)."""
    from ..route.driver import RouteDriver

    from ..route.local import LocalRoute

    async def one(chain: bool | None) -> tuple[Any, float, float, str]:
        d = await RouteDriver(lr.endpoints, chain=chain).connect()
        try:
            await d.generate([1, 2, 3], max_tokens=10, stop_on_eog=False)
            c0, t0 = time.process_time(), time.perf_counter()
            r = await d.generate([1, 2, 3], max_tokens=n_tokens, stop_on_eog=False)
            cpu, wall = time.process_time() - c0, time.perf_counter() - t0
            if r.error is not None:
                raise DgrError(f"driver overhead run ({d.mode}) failed: {r.error}")
            return r, cpu, wall, d.mode
        finally:
            await d.close()

    with LocalRoute(None, [(0, 4), (4, 8)], fake=True) as lr:
        r, cpu, wall, _ = await one(False)
        _, ccpu, cwall, cmode = await one(None)
    steps = (n_tokens - 1) * 2
    return {"hops": 2, "decode_tokens": n_tokens,
            "driver_cpu_per_hop_s": cpu / steps, "wall_per_token_s": wall / n_tokens,
            "decode_rtt_per_hop_s": [n.decode_step_s for n in r.telemetry.nodes],
            "chained": {"mode": cmode, "driver_cpu_per_token_s": ccpu / n_tokens, "wall_per_token_s": cwall / n_tokens}}


def run_route_bench(model: Path, cfg: RouteBenchConfig) -> dict[str, Any]:
    from ..gguf.inspect import open_gguf
    from ..route.local import LocalRoute, ensure_worker

    say = _log.info
    threads = cfg.threads or os.cpu_count() or 1
    ensure_worker(cfg.backend)
    with open_gguf(model) as gf:
        n_layer, n_embd = int(gf.n_layer), int(gf.hparam("embedding_length"))
    if cfg.split[-1][1] != n_layer:
        raise DgrError(f"split ends at layer {cfg.split[-1][1]}; the model has {n_layer} layers")
    max_s = max(4, max(cfg.concurrency))
    route_runs: dict[int, list[dict[str, Any]]] = {c: [] for c in cfg.concurrency}
    step_runs: dict[int, list[dict[str, Any]]] = {c: [] for c in cfg.concurrency}
    whole_runs: dict[int, list[dict[str, Any]]] = {c: [] for c in cfg.concurrency}
    floor_runs: dict[int, list[dict[str, Any]]] = {c: [] for c in cfg.concurrency}
    server_runs: dict[int, list[dict[str, Any]]] = {c: [] for c in cfg.concurrency}
    brackets: dict[int, list[dict[str, Any]]] = {c: [] for c in cfg.concurrency}
    ctx = cfg.n_prompt + cfg.n_gen + 16
    say(f"starting route workers {','.join(f'{a}:{b}' for a, b in cfg.split)} and a whole-model worker "
        f"({threads} threads each)" + (", and llama-server" if cfg.llama_server else ""))
    from .loadgen import LlamaServer

    with LocalRoute(model, cfg.split, threads=threads, max_sessions=max_s, ctx_per_session=ctx,
                    backend=cfg.backend) as lr, \
            LocalRoute(model, [(0, n_layer)], threads=threads, max_sessions=max_s, ctx_per_session=ctx,
                       backend=cfg.backend) as lw, \
            (LlamaServer(model, threads=threads, parallel=max_s, ctx_per_slot=ctx, backend=cfg.backend)
             if cfg.llama_server else contextlib.nullcontext()) as server:
        asyncio.run(_measure(lr.endpoints, 16, 4, 1, 999))   # warm up both, both modes
        asyncio.run(_measure(lr.endpoints, 16, 4, 1, 999, chain=False))
        asyncio.run(_measure(lw.endpoints, 16, 4, 1, 999))
        if server is not None:
            _llama_server_level(server.url, 16, 4, 1, 999)
        lb_runs: list[dict[str, Any]] = []
        bb_runs: list[dict[str, Any]] = []
        rpc_runs: list[dict[str, Any]] = []
        if cfg.rpc:
            from .rpc import measure_rpc

            say("llama.cpp RPC lane: building rpc-server and an RPC llama-bench if missing (build/"
                f"{cfg.backend}-rpc; minutes the first time)")
        for rep in range(cfg.repeats):
            # everything interleaved per repeat (a shared host's load drifts over minutes), and the
            # chained route bracketed by its yardstick: measured just before and just after it
            for c in cfg.concurrency:
                yard = "llama-bench" if c == 1 else f"llama-batched-bench B={c}"
                say(f"repeat {rep + 1}/{cfg.repeats}: {c} session(s): {yard}, route (chained), {yard}")
                before = _yardstick(model, threads, cfg, c)
                route_runs[c].append(asyncio.run(_measure(lr.endpoints, cfg.n_prompt, cfg.n_gen, c, rep * 100)))
                after = _yardstick(model, threads, cfg, c)
                brackets[c].append(_bracket(before, after))
            lb_runs.append(brackets[min(cfg.concurrency)][-1] if min(cfg.concurrency) == 1 else
                           _llama_bench(model, threads, cfg.n_prompt, cfg.n_gen, 1, cfg.backend))
            if cfg.rpc:
                say(f"repeat {rep + 1}/{cfg.repeats}: llama.cpp RPC split over two local rpc-servers")
                rpc_runs.append(measure_rpc(model, threads=threads, n_prompt=cfg.n_prompt, n_gen=cfg.n_gen, repeats=1,
                                            backend=cfg.backend, split=tuple(cfg.split), build_missing=True))
            for c in cfg.concurrency:
                say(f"repeat {rep + 1}/{cfg.repeats}: {c} session(s): route (stepwise), whole-model worker")
                step_runs[c].append(asyncio.run(_measure(lr.endpoints, cfg.n_prompt, cfg.n_gen, c, rep * 100,
                                                         chain=False)))
                whole_runs[c].append(asyncio.run(_measure(lw.endpoints, cfg.n_prompt, cfg.n_gen, c, rep * 100)))
                if server is not None:
                    say(f"repeat {rep + 1}/{cfg.repeats}: {c} session(s): llama-server (streaming, same prompts)")
                    server_runs[c].append(_llama_server_level(server.url, cfg.n_prompt, cfg.n_gen, c, rep * 100))
                if len(cfg.split) == 2:
                    say(f"repeat {rep + 1}/{cfg.repeats}: {c} session(s): seam floor (whole, head+tail in one "
                        "process, head and tail in two processes over a socketpair)")
                    floor_runs[c].append(_seam_floor(model, split=cfg.split[0][1], threads=threads, sessions=c,
                                                     n_prompt=cfg.n_prompt, n_gen=cfg.n_gen, max_sessions=max_s,
                                                     ctx=ctx, env=dict(lr.env), backend=cfg.backend))
            say(f"repeat {rep + 1}/{cfg.repeats}: llama-batched-bench")
            bb_runs.append(_batched_bench(model, threads, cfg.n_prompt, cfg.n_gen, cfg.concurrency, cfg.backend))
        rss = {"route": [w.rss_bytes() for w in lr.workers], "whole": [w.rss_bytes() for w in lw.workers]}
        route_env = dict(lr.env)
    overhead = asyncio.run(_driver_overhead()) if cfg.driver_overhead else None
    derived = derive(cfg.concurrency, route_runs=route_runs, step_runs=step_runs, whole_runs=whole_runs,
                     brackets=brackets, lb_runs=lb_runs, bb_runs=bb_runs, floor_runs=floor_runs, rpc_runs=rpc_runs,
                     n_shards=len(cfg.split), rpc_on=cfg.rpc, n_embd=n_embd,
                     server_runs=server_runs if cfg.llama_server else None)
    return {
        "schema": SCHEMA, "model": str(model), "n_layer": n_layer, "n_embd": n_embd,
        "split": [f"{a}:{b}" for a, b in cfg.split], "threads": threads, "n_prompt": cfg.n_prompt,
        "n_gen": cfg.n_gen, "repeats": cfg.repeats, "concurrency": list(cfg.concurrency),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        **derived, "yardstick_brackets": {str(c): v for c, v in brackets.items()},
        "driver_overhead": overhead, "rss_bytes": rss, "route_worker_env": route_env,
    }
