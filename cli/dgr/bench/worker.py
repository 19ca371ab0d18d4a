"""`dgr bench worker`: aggregate decode throughput of one dgr-worker (whole model) at several
session counts, next to llama-batched-bench measured in the same run (ratios
measured side by side, never absolute times).

Per level B: B sessions prefill a prompt of `prompt_tokens` tokens, wait for each other, then
decode `gen_tokens` greedy tokens concurrently, in two modes measured back to back:

- ``stepwise``: the client feeds every token back through the gRPC stream (one
  FastDecodeFrame per token, a Python round trip between two tokens);
- ``server_generation``: each session sends one DECODE frame with ``StepFrame.generate`` and
  reads the `gen_tokens` responses; the worker feeds the tokens back itself.

Aggregate decode tok/s = B * gen_tokens / wall time of the decode phase. The worker's
dgr_batch_occupancy_sessions histogram (steps per decode call) shows batching in use. The
target (>= 0.9x llama-batched-bench) is judged on server generation (``target_mode``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import DgrError
from .hf_export import sha256_file

_log = logging.getLogger(__name__)

MODES = ("stepwise", "server_generation")
TARGET_MODE = "server_generation"
TARGET_RATIO = 0.9


@dataclass(frozen=True)
class WorkerBenchConfig:
    levels: tuple[int, ...] = (1, 2, 4, 8)
    prompt_tokens: int = 32
    gen_tokens: int = 64
    threads: int = 2
    repeats: int = 3
    # llama-batched-bench's -ngl (None: its default); "99" puts every layer on the GPU, as the
    # worker does by default (--n-gpu-layers -1)
    gpu_layers: str | None = None
    # runs of llama-batched-bench per measurement when one prints no rows (llama_tools.batched_bench)
    batched_bench_attempts: int = 3


def _batched_bench(exe: Path, model: Path, cfg: WorkerBenchConfig) -> dict[int, float]:
    from .llama_tools import batched_bench

    if not exe.is_file():
        raise DgrError(f"{exe} missing", hint="run `dgr build --target llama-batched-bench`")
    ctx = max(cfg.levels) * (cfg.prompt_tokens + cfg.gen_tokens) + 256
    rows, _ = batched_bench(exe, model, threads=cfg.threads, n_prompt=cfg.prompt_tokens, n_gen=cfg.gen_tokens,
                            npl=cfg.levels, ctx=ctx, timeout=3600, gpu_layers=cfg.gpu_layers,
                            attempts=cfg.batched_bench_attempts)
    return {b: r.speed_tg for b, r in rows.items()}


def _worker_level(target: str, b: int, cfg: WorkerBenchConfig, mode: str = "stepwise") -> dict[str, float]:
    """``b`` sessions on the worker at ``target``: each prefills, then (all together) decodes
    ``gen_tokens``: stepwise one frame per token, or in one server-side generation frame. Driven
    by the asyncio protocol client on one event loop (what the route driver uses): the sessions
    are coroutines, so the client adds no thread hand-offs to the worker's figures."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} not in {MODES}")
    return asyncio.run(_worker_level_async(target, b, cfg, mode))


async def _worker_level_async(target: str, b: int, cfg: WorkerBenchConfig, mode: str) -> dict[str, float]:
    from ..protocol.client import AsyncWorkerClient

    client = AsyncWorkerClient(target, timeout=600)
    streams: list = []
    try:
        # token ids below 1010, or below the vocabulary of a smaller (synthetic) model
        span = max(1, min(1000, (await client.capability()).identity.n_vocab - 10))
        prompt = [(17 * i) % span + 10 for i in range(cfg.prompt_tokens)]
        streams = [await client.open_session(step_timeout=600) for _ in range(b)]   # fresh ids per run
        firsts = await asyncio.gather(*(s.prefill([(t + i) % span + 10 for t in prompt])
                                        for i, s in enumerate(streams)))

        async def run(s, tok: int) -> int:
            if mode == "stepwise":
                for _ in range(cfg.gen_tokens):
                    tok = await s.decode(tok)
                return cfg.gen_tokens
            # one frame; the worker feeds the tokens back itself (greedy, EOG ignored)
            return len(await s.decode_generate(tok, cfg.gen_tokens, continue_after_finish=True))

        m0 = _occupancy(await client.metrics())
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(run(s, tok) for s, tok in zip(streams, firsts)))
        wall = time.perf_counter() - t0
        m1 = _occupancy(await client.metrics())
    except Exception as exc:  # noqa: BLE001 - one structured failure for the level
        raise DgrError(f"worker bench ({mode}) at {b} sessions failed: {type(exc).__name__}: {exc}") from None
    finally:
        for s in streams:
            await s.close()
        with contextlib.suppress(Exception):   # a failure here must not hide the level's own
            await _sessions_ended(client)
        await client.close()
    if sum(counts) != b * cfg.gen_tokens:
        raise DgrError(f"worker bench ({mode}) at {b} sessions: {sum(counts)} tokens, expected {b * cfg.gen_tokens}")
    batches = m1[1] - m0[1]
    return {
        "decode_tokens_per_s": b * cfg.gen_tokens / wall,
        "decode_wall_s": wall,
        "batches": batches,
        "dgr_batch_occupancy_avg": (m1[0] - m0[0]) / batches if batches else 0.0,
        # share of the decode phase spent inside llama_decode (the rest: client, gRPC, gathering)
        "decode_busy_fraction": (m1[2] - m0[2]) / wall,
    }


async def _sessions_ended(client, timeout_s: float = 10.0) -> None:
    """Waits (bounded) until the worker holds no session: it ends a closed stream's session on
    its own thread, and the next level opens as many sessions as the worker allows
    (max_sessions is the largest level), so one still ending would be refused OVER_BUDGET."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if (await client.metrics()).load.active_sessions == 0:
            return
        await asyncio.sleep(0.005)


def _occupancy(metrics) -> tuple[float, float, float]:
    s = {m.name: m.value for m in metrics.samples if not m.labels}
    return (s.get("dgr_batch_occupancy_sessions_sum", 0.0), s.get("dgr_batch_occupancy_sessions_count", 0.0),
            s.get("dgr_decode_busy_seconds_total", 0.0))


def _mode_row(r: dict[str, float], ref: float | None) -> dict:
    return {
        "worker_decode_tokens_per_s": r["decode_tokens_per_s"],
        "ratio": (r["decode_tokens_per_s"] / ref) if ref else None,
        "dgr_batch_occupancy_avg": r["dgr_batch_occupancy_avg"],
        "batches": r["batches"],
        "decode_busy_fraction": r["decode_busy_fraction"],
    }


def paired_ratio(worker_runs: Sequence[float], ref_runs: Sequence[float]) -> float | None:
    """Median over the repeats of worker / llama-batched-bench measured back to back: a shared
    host's load drifts over minutes, so the two halves of a pair see the same load (the best-of
    figures may come from different minutes)."""
    pairs = [w / r for w, r in zip(worker_runs, ref_runs) if r > 0]
    return statistics.median(pairs) if pairs else None


def level_row(b: int, per_mode: dict[str, dict[str, float]], ref: float | None,
              runs: dict[str, list[float]] | None = None, ref_runs: list[float] | None = None) -> dict:
    """One level of the JSON: the legacy keys from the target mode, plus one sub-dict per mode.
    With the per-repeat figures (``runs`` per mode, ``ref_runs``) each mode also gets its paired
    ratio (reported; the target is judged on the best-of ratio)."""
    modes = {m: _mode_row(per_mode[m], ref) for m in MODES if m in per_mode}
    for m, row in modes.items():
        if runs and ref_runs and m in runs:
            row["paired_ratio"] = paired_ratio(runs[m], ref_runs)
            row["runs_tokens_per_s"] = list(runs[m])
    t = modes[TARGET_MODE]
    return {
        "paired_ratio": t.get("paired_ratio"),
        "llama_batched_bench_runs_tokens_per_s": list(ref_runs or []),
        "sessions": b,
        "worker_decode_tokens_per_s": t["worker_decode_tokens_per_s"],
        "llama_batched_bench_tg_tokens_per_s": ref,
        "ratio": t["ratio"],
        "dgr_batch_occupancy_avg": t["dgr_batch_occupancy_avg"],
        "batches": t["batches"],
        "decode_busy_fraction": t["decode_busy_fraction"],
        **modes,
    }


def meets(rows: Sequence[dict], mode: str | None = None) -> bool:
    """Every level >= the target, on the best-of-the-repeats ratio (the paired ratio is
    reported next to it)."""
    def ratio(r: dict) -> float | None:
        return r["ratio"] if mode is None else r[mode]["ratio"]
    return bool(rows) and all(ratio(r) is not None and ratio(r) >= TARGET_RATIO for r in rows)


def run_worker_bench(model: Path, cfg: WorkerBenchConfig, *, worker_bin: Path, batched_bench: Path,
                     ) -> dict:
    """Per level and repeat: the worker stepwise, the worker generating server-side, then
    llama-batched-bench at the same B, back to back (so that the load of a shared machine hits
    all alike); each keeps its best over the repeats."""
    from ..route.supervisor import WorkerArgs, WorkerProcess

    levels = sorted(set(cfg.levels))
    load_before = list(os.getloadavg())   # what else ran on the host: stated, not assumed
    per = cfg.prompt_tokens + cfg.gen_tokens + 16
    results: dict[int, dict[str, dict[str, float]]] = {b: {} for b in levels}
    ref: dict[int, float] = {}
    runs: dict[int, dict[str, list[float]]] = {b: {m: [] for m in MODES} for b in levels}
    ref_runs: dict[int, list[float]] = {b: [] for b in levels}
    _log.info(f"{levels} sessions, pp {cfg.prompt_tokens}, tg {cfg.gen_tokens}, {cfg.threads} threads, "
             f"{cfg.repeats} repeats, modes {', '.join(MODES)}")
    with WorkerProcess.start(WorkerArgs(model=model, max_sessions=max(levels), ctx_per_session=per,
                                        threads=cfg.threads),
                             binary=worker_bin, ready_timeout=300) as w:
        warm = WorkerBenchConfig(prompt_tokens=8, gen_tokens=8)
        for mode in MODES:
            _worker_level(w.target, 1, warm, mode)
        for b in levels:
            for _ in range(cfg.repeats):
                for mode in MODES:
                    r = _worker_level(w.target, b, cfg, mode)
                    runs[b][mode].append(r["decode_tokens_per_s"])
                    best = results[b].get(mode)
                    if best is None or r["decode_tokens_per_s"] > best["decode_tokens_per_s"]:
                        results[b][mode] = r
                one = _batched_bench(batched_bench, model, WorkerBenchConfig(
                    levels=(b,), prompt_tokens=cfg.prompt_tokens, gen_tokens=cfg.gen_tokens, threads=cfg.threads,
                    gpu_layers=cfg.gpu_layers, batched_bench_attempts=cfg.batched_bench_attempts))
                ref[b] = max(ref.get(b, 0.0), one.get(b, 0.0))
                ref_runs[b].append(one.get(b, 0.0))
            sg, sw = results[b]["server_generation"], results[b]["stepwise"]
            _log.info(f"  B={b}: worker server generation {sg['decode_tokens_per_s']:.1f} tok/s "
                     f"(occupancy {sg['dgr_batch_occupancy_avg']:.2f}), stepwise {sw['decode_tokens_per_s']:.1f} tok/s "
                     f"(occupancy {sw['dgr_batch_occupancy_avg']:.2f}), llama-batched-bench {ref[b]:.1f} tok/s")
    rows = [level_row(b, results[b], ref.get(b) or None, runs[b], ref_runs[b]) for b in levels]
    return {
        "kind": "dgr.bench.worker/v1",
        "label": "local-real",
        "model": str(model),
        "config": {"levels": levels, "prompt_tokens": cfg.prompt_tokens, "gen_tokens": cfg.gen_tokens,
                   "threads": cfg.threads, "repeats": cfg.repeats},
        # the binary measured (a paired run compares two builds: they differ here, not in "git")
        "worker_binary": {"path": str(worker_bin), "sha256": sha256_file(worker_bin)},
        "host": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": list(os.getloadavg())},
        "levels": rows,
        "saturation_sessions": saturation(rows),
        "stepwise_saturation_sessions": saturation(rows, "stepwise"),
        "target_ratio": TARGET_RATIO,
        "target_mode": TARGET_MODE,
        "meets_target": meets(rows),
        "stepwise_meets_target": meets(rows, "stepwise"),
    }


def saturation(rows: Sequence[dict], mode: str | None = None) -> int | None:
    """The smallest session count after which aggregate worker throughput grows < 5% (``mode``:
    of that mode's sub-dict; default the top-level figures, i.e. the target mode)."""
    def tps(r: dict) -> float:
        return (r if mode is None else r[mode])["worker_decode_tokens_per_s"]
    for a, b in zip(rows, rows[1:]):
        if tps(b) < tps(a) * 1.05:
            return a["sessions"]
    return None


def summary(doc: dict) -> str:
    def f(v: float | None, spec: str) -> str:
        return format(v, spec) if v is not None else "-"

    lines = ["best of the repeats; paired = median over repeats of worker / batched-bench run back to back",
             "sessions  server-gen tok/s  stepwise tok/s  batched-bench tok/s  ratio  paired  stepwise ratio  "
             "stepwise paired  occupancy"]
    for r in doc["levels"]:
        sw = r.get("stepwise", {})
        lines.append(f"{r['sessions']:>8}  {r['worker_decode_tokens_per_s']:>16.1f}  "
                     f"{f(sw.get('worker_decode_tokens_per_s'), '.1f'):>14}  "
                     f"{f(r['llama_batched_bench_tg_tokens_per_s'] or None, '.1f'):>19}  "
                     f"{f(r['ratio'], '.2f'):>5}  {f(r.get('paired_ratio'), '.2f'):>6}  {f(sw.get('ratio'), '.2f'):>14}  "
                     f"{f(sw.get('paired_ratio'), '.2f'):>15}  {r['dgr_batch_occupancy_avg']:>9.2f}")
    mode = doc.get("target_mode", "stepwise")
    sat = doc["saturation_sessions"]
    top = max((r["sessions"] for r in doc["levels"]), default=0)
    line = ((f"saturation at {sat} sessions" if sat is not None
             else f"no saturation up to {top} sessions (each level adds >= 5%)")
            + f"; target >= {doc.get('target_ratio', TARGET_RATIO)}x "
            f"({mode}, best of the repeats): "
            f"{'met' if doc['meets_target'] else 'not met'}")
    if "stepwise_meets_target" in doc:
        line += f"; stepwise: {'met' if doc['stepwise_meets_target'] else 'not met'}"
    lines.append(line)
    return "\n".join(lines)
