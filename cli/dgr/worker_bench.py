"""`dgr bench worker`: aggregate decode throughput of one dgr-worker (whole model) at several
session counts, next to llama-batched-bench measured in the same run (DESIGN.md §8: ratios
measured side by side, never absolute times).

Per level B: B sessions prefill a prompt of `prompt_tokens` tokens, wait for each other, then
each decodes `gen_tokens` greedy tokens concurrently through the gRPC stream (FastDecodeFrame);
aggregate decode tok/s = B * gen_tokens / wall time of the decode phase. The worker's
dgr_batch_occupancy_sessions histogram (steps per decode call) shows batching in use.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import DgrError


@dataclass(frozen=True)
class WorkerBenchConfig:
    levels: tuple[int, ...] = (1, 2, 4, 8)
    prompt_tokens: int = 32
    gen_tokens: int = 64
    threads: int = 2
    repeats: int = 2


def _batched_bench(exe: Path, model: Path, cfg: WorkerBenchConfig) -> dict[int, float]:
    if not exe.is_file():
        raise DgrError(f"{exe} missing", hint="run `dgr build --target llama-batched-bench`")
    ctx = max(cfg.levels) * (cfg.prompt_tokens + cfg.gen_tokens) + 256
    cmd = [str(exe), "-m", str(model), "-c", str(ctx), "-b", "512", "-ub", "512",
           "-npp", str(cfg.prompt_tokens), "-ntg", str(cfg.gen_tokens),
           "-npl", ",".join(str(b) for b in cfg.levels), "-t", str(cfg.threads), "--output-format", "jsonl"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise DgrError(f"llama-batched-bench failed (exit {r.returncode}): {r.stderr[-500:]}")
    out: dict[int, float] = {}
    for line in r.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            row = json.loads(line)
            out[int(row["pl"])] = float(row["speed_tg"])
    return out


def _worker_level(client, b: int, cfg: WorkerBenchConfig) -> dict[str, float]:
    prompt = [(17 * i) % 1000 + 10 for i in range(cfg.prompt_tokens)]
    ready = threading.Barrier(b + 1)
    done = threading.Barrier(b + 1)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        s = None
        try:
            s = client.open_session(step_timeout=600)  # fresh id per run
            tok = s.prefill([(t + i) % 1000 + 10 for t in prompt])
            ready.wait(600)
            for _ in range(cfg.gen_tokens):
                tok = s.decode(tok)
            done.wait(600)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            ready.abort()
            done.abort()
        finally:
            if s is not None:
                s.close()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(b)]
    for t in threads:
        t.start()
    try:
        ready.wait(600)
        m0 = _occupancy(client)
        t0 = time.perf_counter()
        done.wait(600)
        wall = time.perf_counter() - t0
        m1 = _occupancy(client)
    except threading.BrokenBarrierError:
        raise DgrError(f"worker bench at {b} sessions failed: {errors[:1]}") from None
    for t in threads:
        t.join(60)
    batches = m1[1] - m0[1]
    return {
        "decode_tokens_per_s": b * cfg.gen_tokens / wall,
        "decode_wall_s": wall,
        "batches": batches,
        "dgr_batch_occupancy_avg": (m1[0] - m0[0]) / batches if batches else 0.0,
        # share of the decode phase spent inside llama_decode (the rest: client, gRPC, gathering)
        "decode_busy_fraction": (m1[2] - m0[2]) / wall,
    }


def _occupancy(client) -> tuple[float, float, float]:
    s = {m.name: m.value for m in client.metrics().samples if not m.labels}
    return (s.get("dgr_batch_occupancy_sessions_sum", 0.0), s.get("dgr_batch_occupancy_sessions_count", 0.0),
            s.get("dgr_decode_busy_seconds_total", 0.0))


def run_worker_bench(model: Path, cfg: WorkerBenchConfig, *, worker_bin: Path, batched_bench: Path,
                     progress: Callable[[str], None] = lambda s: None) -> dict:
    """Per level: the worker, then llama-batched-bench at the same B, back to back (so that
    the load of a shared machine hits both alike); each repeat keeps the best of each."""
    from meshnet_adapter.worker_process import WorkerProcess

    levels = sorted(set(cfg.levels))
    per = cfg.prompt_tokens + cfg.gen_tokens + 16
    results: dict[int, dict[str, float]] = {}
    ref: dict[int, float] = {}
    progress(f"{levels} sessions, pp {cfg.prompt_tokens}, tg {cfg.gen_tokens}, {cfg.threads} threads")
    with WorkerProcess.start(["--model", str(model), "--max-sessions", str(max(levels)),
                              "--ctx-per-session", str(per), "--threads", str(cfg.threads)],
                             binary=worker_bin, ready_timeout=300) as w:
        client = w.client(timeout=600)
        _worker_level(client, 1, WorkerBenchConfig(prompt_tokens=8, gen_tokens=8))  # warm-up
        for b in levels:
            for _ in range(cfg.repeats):
                r = _worker_level(client, b, cfg)
                if b not in results or r["decode_tokens_per_s"] > results[b]["decode_tokens_per_s"]:
                    results[b] = r
                one = _batched_bench(batched_bench, model, WorkerBenchConfig(
                    levels=(b,), prompt_tokens=cfg.prompt_tokens, gen_tokens=cfg.gen_tokens, threads=cfg.threads))
                ref[b] = max(ref.get(b, 0.0), one.get(b, 0.0))
            progress(f"  B={b}: worker {results[b]['decode_tokens_per_s']:.1f} tok/s "
                     f"(occupancy {results[b]['dgr_batch_occupancy_avg']:.2f}), "
                     f"llama-batched-bench {ref[b]:.1f} tok/s")
    rows = []
    for b in levels:
        w_tps = results[b]["decode_tokens_per_s"]
        l_tps = ref.get(b) or None
        rows.append({
            "sessions": b,
            "worker_decode_tokens_per_s": w_tps,
            "llama_batched_bench_tg_tokens_per_s": l_tps,
            "ratio": (w_tps / l_tps) if l_tps else None,
            "dgr_batch_occupancy_avg": results[b]["dgr_batch_occupancy_avg"],
            "batches": results[b]["batches"],
            "decode_busy_fraction": results[b]["decode_busy_fraction"],
        })
    return {
        "kind": "dgr.bench.worker/v1",
        "label": "local-real",
        "model": str(model),
        "config": {"levels": levels, "prompt_tokens": cfg.prompt_tokens, "gen_tokens": cfg.gen_tokens,
                   "threads": cfg.threads, "repeats": cfg.repeats},
        "levels": rows,
        "saturation_sessions": saturation(rows),
        "target_ratio": 0.9,
        "meets_target": all(r["ratio"] is not None and r["ratio"] >= 0.9 for r in rows),
    }


def saturation(rows: Sequence[dict]) -> int | None:
    """The smallest session count after which aggregate worker throughput grows < 5%."""
    for a, b in zip(rows, rows[1:]):
        if b["worker_decode_tokens_per_s"] < a["worker_decode_tokens_per_s"] * 1.05:
            return a["sessions"]
    return None


def summary(doc: dict) -> str:
    lines = ["sessions  worker tok/s  batched-bench tok/s  ratio  occupancy"]
    for r in doc["levels"]:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        ref = f"{r['llama_batched_bench_tg_tokens_per_s']:.1f}" if r["llama_batched_bench_tg_tokens_per_s"] else "-"
        lines.append(f"{r['sessions']:>8}  {r['worker_decode_tokens_per_s']:>12.1f}  {ref:>19}  {ratio:>5}  "
                     f"{r['dgr_batch_occupancy_avg']:>9.2f}")
    lines.append(f"saturation at {doc['saturation_sessions']} sessions; target >= 0.9x: "
                 f"{'met' if doc['meets_target'] else 'not met'}")
    return "\n".join(lines)
