"""``dgr bench serve``: the gateway against the route driver and against llama-server, one run.

Lanes (same prompts, threads, answer length; greedy, ``ignore_eos``, no prompt cache):

- ``driver_split``: the route driver called directly on a local 2-shard split (the model's chat
  template and tokenizer calls inside the timed region, as the gateway does them);
- ``gateway_split``: ``dgr serve --shard …`` (its own process) over the same two workers;
- ``gateway_whole``: ``dgr serve`` over one whole-model worker;
- ``llama_server``: stock llama-server at the pin, whole model, ``-np`` = the highest level.

Each concurrency level (1, 4, 8 by default) runs every lane back to back, in rotation, so that
every lane serves ``repeats`` × the top level requests per level (``repeats`` rotations at the
top level, 8 × ``repeats`` at 1 concurrent): a level's sample does not shrink with its
concurrency, and at 1 concurrent one request's noise (on a shared 2-core host a 16-token prefill
alone varies by ±20 %) would otherwise decide the ratio. Aggregate decode is the median over
rotations; TTFT p50 is over every request of the level. Every process's CPU seconds per rotation
are recorded (``cpu_s``): on a small shared host they say where the time went.

Threads: every worker and llama-server get the same count, by default one fewer than the CPUs
(at least 1). The load generator and the gateway are processes of their own and need a core;
compute threads on every core would measure their contention with them, not the servers.

TTFT overhead is measured per request: the client's time to first token minus the route's share
that the gateway reports on the answer (``server_timing.route_ms`` in a stream's last choice
event, ``Server-Timing: route`` on a plain answer), which runs from the start of the request's
handling, before the prompt is formatted, to the route's first token: what the driver lane
times. The rest is what HTTP, the framework, the event stream and the client added to that
request. The difference of the two
lanes' p50 is reported too (``gateway_vs_driver_ttft_p50_diff_s``); it carries both lanes'
compute noise. Targets (ratios of medians, measured side by side):

- gateway_split / driver_split aggregate decode >= 0.95; gateway TTFT overhead p50 <= 5 ms
- gateway_whole / llama_server aggregate decode >= 0.95; |TTFT p50 ratio - 1| <= 10 %
- gateway_split / llama_server aggregate decode >= 0.90

Streaming cadence, per level and lane (``cadence``, :func:`dgr.bench.stats.cadence`): chunks per
token (events that carried text / tokens generated), ITL p50/p90/p99 (the gaps between one
request's consecutive text events, pooled over the level's requests) and the longest gap. Targets:

- every gateway lane: chunks per token >= 0.95 (one event per token; only text that waits for the
  rest of a UTF-8 character or may start a stop string is sent with a later token);
- gateway_whole / llama_server: ITL p50 <= 1.1x, ITL p99 <= 1.5x;
- gateway_split / gateway_whole: ITL p50 <= 1.1x (the split's workers pinned to the same cores,
  as ``LocalRoute`` places a co-located route).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from dgr import childproc
from dgr.errors import DgrError

from .loadgen import LevelResult, LlamaServer, RequestResult, proc_cpu_s, run_level, wait_healthy
from .stats import cadence, cadence_cells

_log = logging.getLogger(__name__)

TARGETS = {
    "gateway_vs_driver_decode": 0.97,
    "gateway_ttft_overhead_s": 0.005,
    "whole_vs_llama_server_decode": 0.95,
    "whole_vs_llama_server_ttft_ratio_dev": 0.10,
    "split_vs_llama_server_decode": 0.90,
    # streaming cadence (docs/serve.md): text events per token, inter-token latency (ITL)
    "gateway_chunks_per_token": 0.95,
    "whole_vs_llama_server_itl_p50": 1.10,
    "whole_vs_llama_server_itl_p99": 1.50,
    "split_vs_whole_itl_p50": 1.10,
}


@dataclass
class ServeBenchConfig:
    split: tuple[tuple[int, int], ...] = ()
    levels: tuple[int, ...] = (1, 4, 8)
    threads: int = 0
    max_tokens: int = 64
    repeats: int = 2
    prompts: tuple[str, ...] = ()
    llama_server: bool = True      # False: no llama_server lane (its comparisons are reported as not measured)


class _ServeProcess:
    """``dgr serve --shard …`` in its own process (as a user runs it)."""

    def __init__(self, endpoints: Sequence[str], model_id: str) -> None:
        from dgr.serve.server import free_port

        self.port = free_port()
        self.model_id = model_id
        cmd = [sys.executable, "-c", "from dgr.main import main; main()", "serve", "--port", str(self.port),
               "--model-name", model_id]
        for ep in endpoints:
            cmd += ["--shard", ep]
        self.proc = childproc.popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60.0) -> "_ServeProcess":
        wait_healthy(self.proc, self.url, timeout, "dgr serve",
                     lambda: (self.proc.stderr.read() or "") if self.proc.poll() is not None else "")
        return self

    def stop(self) -> None:
        from dgr.route.supervisor import stop_child

        stop_child(self.proc, 15)


async def _driver_level(endpoints: Sequence[str], prompts: Sequence[str], max_tokens: int) -> LevelResult:
    """The same requests through the route driver itself (no HTTP)."""
    from dgr.route.driver import RouteDriver, Sampling
    from dgr.route.text import chat_prompt_text

    d = await RouteDriver(list(endpoints)).connect()
    try:
        t0 = time.perf_counter()

        async def one(p: str) -> RequestResult:
            sent = time.perf_counter()
            text = await chat_prompt_text(d.head.client, [("user", p)], timeout=d.timeout)
            ids = await d.tokenize(text, add_special=True, parse_special=True)
            times: list[float] = []
            res = await d.generate(ids, max_tokens=max_tokens, sampling=Sampling(ignore_eog=True),
                                   on_token=lambda _t: times.append(time.perf_counter()))
            if res.error is not None or not times:
                return RequestResult(len(ids), 0, 0.0, 0.0, 0.0, error=str(res.error or "no token"))
            return RequestResult(len(ids), len(res.tokens), times[0] - sent, times[0] - t0, times[-1] - t0,
                                 chunk_times_s=[t - t0 for t in times])

        res = await asyncio.gather(*(one(p) for p in prompts))
        return LevelResult("driver_split", len(prompts), list(res), time.perf_counter() - t0)
    finally:
        await d.close()


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def _ratio_or_none(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def default_threads() -> int:
    """One fewer than the CPUs (the load generator and the gateway need one), at least 1."""
    return max(1, (os.cpu_count() or 1) - 1)


def rotations(level: int, top: int, repeats: int) -> int:
    """Rotations of every lane at ``level``: each lane serves ``repeats`` × ``top`` requests."""
    return repeats * -(-top // level)


def run_serve_bench(model: Path, cfg: ServeBenchConfig) -> dict[str, Any]:
    from dgr.route import local as rt
    from dgr.route.local import LocalRoute
    from dgr.route.sessions import DEFAULT_PROMPTS

    say = _log.info
    threads = cfg.threads or default_threads()
    n_layer = rt.model_n_layer(model)
    split = list(cfg.split) or [(0, n_layer // 2), (n_layer // 2, n_layer)]
    if split[-1][1] != n_layer:
        raise DgrError(f"split ends at layer {split[-1][1]}; the model has {n_layer} layers")
    base = list(cfg.prompts or DEFAULT_PROMPTS)
    top = max(cfg.levels)
    rt.ensure_worker()
    if cfg.llama_server:
        say("llama-server: stock llama.cpp at the pin (built on first use)")
    model_id = model.stem
    procs: dict[str, int] = {}
    runs: dict[tuple[str, int], list[LevelResult]] = {}
    t_start = time.time()
    load0 = os.getloadavg()
    with LocalRoute(model, split, threads=threads, max_sessions=top, ctx_per_session=1024) as lsplit, \
            LocalRoute(model, [(0, n_layer)], threads=threads, max_sessions=top, ctx_per_session=1024) as lwhole, \
            (LlamaServer(model, threads=threads, parallel=top, ctx_per_slot=1024) if cfg.llama_server
             else contextlib.nullcontext()) as llama:
        gsplit = _ServeProcess(lsplit.endpoints, model_id)
        gwhole = _ServeProcess(lwhole.endpoints, model_id)
        try:
            gsplit.wait_ready()
            gwhole.wait_ready()
            for w, name in zip(lsplit.workers, ("split_worker_0", "split_worker_1")):
                procs[name] = w.pid
            procs["whole_worker"] = lwhole.workers[0].pid
            procs.update(gateway_split=gsplit.proc.pid, gateway_whole=gwhole.proc.pid, bench_client=os.getpid())
            if llama is not None:
                procs["llama_server"] = llama.pid
            lanes: dict[str, Callable[[list[str]], Any]] = {
                "driver_split": lambda ps: _driver_level(lsplit.endpoints, ps, cfg.max_tokens),
                "gateway_split": lambda ps: run_level(gsplit.url + "/v1", model_id, ps, max_tokens=cfg.max_tokens,
                                                      lane="gateway_split"),
                "gateway_whole": lambda ps: run_level(gwhole.url + "/v1", model_id, ps, max_tokens=cfg.max_tokens,
                                                      lane="gateway_whole"),
            }
            if llama is not None:
                lanes["llama_server"] = lambda ps: run_level(llama.url + "/v1", model_id, ps,
                                                             max_tokens=cfg.max_tokens, lane="llama_server")
            say(f"warm-up: {top} concurrent requests per lane")
            for fn in lanes.values():
                asyncio.run(fn([base[i % len(base)] for i in range(top)]))
            for level in cfg.levels:
                prompts = [base[i % len(base)] for i in range(level)]
                for rep in range(rotations(level, top, cfg.repeats)):
                    order = list(lanes) if rep % 2 == 0 else list(reversed(lanes))
                    for lane in order:
                        c0 = {k: proc_cpu_s(p) for k, p in procs.items()}
                        c0["bench_client"] = time.process_time()
                        res = asyncio.run(lanes[lane](prompts))
                        c1 = {k: proc_cpu_s(p) for k, p in procs.items()}
                        c1["bench_client"] = time.process_time()
                        res.lane = lane
                        res.cpu_s = {k: round(c1[k] - c0[k], 3) for k in procs if c1[k] - c0[k] > 0.005}
                        runs.setdefault((lane, level), []).append(res)
                        say(f"  {level:>2} concurrent, {lane:<14} repeat {rep + 1}: "
                            f"{res.aggregate_decode_tok_s:7.1f} tok/s aggregate decode, "
                            f"TTFT p50 {res.ttft_p50_s * 1e3:6.1f} ms" + ("" if res.ok else "  FAILED"))
            llama_rss = llama.peak_rss_bytes() if llama is not None else 0
        finally:
            gsplit.stop()
            gwhole.stop()
    return _document(model, cfg, split, threads, runs, load0, os.getloadavg(), time.time() - t_start, llama,
                     llama_rss)


def _document(model: Path, cfg: ServeBenchConfig, split: list[tuple[int, int]], threads: int,
              runs: dict[tuple[str, int], list[LevelResult]], load0: tuple[float, ...], load1: tuple[float, ...],
              wall: float, llama: LlamaServer | None, llama_rss: int) -> dict[str, Any]:
    def p50(vals: list[float]) -> float:
        return statistics.median(vals) if vals else 0.0

    def med(lane: str, level: int, attr: str) -> float:
        return p50([getattr(r, attr) for r in runs.get((lane, level), []) if r.ok])

    def reqs(lane: str, level: int) -> list[RequestResult]:
        return [q for r in runs.get((lane, level), []) if r.ok for q in r.requests]

    def cad(lane: str, level: int) -> dict[str, Any]:
        q = reqs(lane, level)
        return cadence([r.chunk_times_s for r in q], [r.completion_tokens for r in q])

    levels_doc = []
    checks = []
    for level in cfg.levels:
        dec = {ln: med(ln, level, "aggregate_decode_tok_s") for ln in
               ("driver_split", "gateway_split", "gateway_whole", "llama_server")}
        cads = {ln: cad(ln, level) for ln in dec}
        ttft = {ln: p50([q.ttft_s for q in reqs(ln, level)]) for ln in dec}
        overhead = [q.ttft_s - q.route_ttft_s for q in reqs("gateway_split", level) if q.route_ttft_s is not None]
        deciles = statistics.quantiles(overhead, n=10) if len(overhead) >= 2 else None
        cmp_ = {
            "gateway_vs_driver_decode": _ratio(dec["gateway_split"], dec["driver_split"]),
            "gateway_ttft_overhead_s": p50(overhead) if overhead else None,
            "whole_vs_llama_server_decode": _ratio(dec["gateway_whole"], dec["llama_server"]),
            "whole_vs_llama_server_ttft_ratio": _ratio(ttft["gateway_whole"], ttft["llama_server"]),
            "split_vs_llama_server_decode": _ratio(dec["gateway_split"], dec["llama_server"]),
            "gateway_chunks_per_token": min(cads[ln]["chunks_per_token"] or 0.0
                                            for ln in ("gateway_split", "gateway_whole")),
            "whole_vs_llama_server_itl_p50": _ratio_or_none(cads["gateway_whole"]["itl_p50_s"],
                                                            cads["llama_server"]["itl_p50_s"]),
            "whole_vs_llama_server_itl_p99": _ratio_or_none(cads["gateway_whole"]["itl_p99_s"],
                                                            cads["llama_server"]["itl_p99_s"]),
            "split_vs_whole_itl_p50": _ratio_or_none(cads["gateway_split"]["itl_p50_s"],
                                                     cads["gateway_whole"]["itl_p50_s"]),
        }
        itl_checks = ("whole_vs_llama_server_itl_p50", "whole_vs_llama_server_itl_p99", "split_vs_whole_itl_p50")
        met = {
            "gateway_vs_driver_decode": cmp_["gateway_vs_driver_decode"] >= TARGETS["gateway_vs_driver_decode"],
            "gateway_ttft_overhead_s":
                bool(overhead) and cmp_["gateway_ttft_overhead_s"] <= TARGETS["gateway_ttft_overhead_s"],
            "whole_vs_llama_server_decode":
                cmp_["whole_vs_llama_server_decode"] >= TARGETS["whole_vs_llama_server_decode"],
            "whole_vs_llama_server_ttft_ratio":
                abs(cmp_["whole_vs_llama_server_ttft_ratio"] - 1) <= TARGETS["whole_vs_llama_server_ttft_ratio_dev"],
            "split_vs_llama_server_decode":
                cmp_["split_vs_llama_server_decode"] >= TARGETS["split_vs_llama_server_decode"],
            "gateway_chunks_per_token": cmp_["gateway_chunks_per_token"] >= TARGETS["gateway_chunks_per_token"],
            **{k: cmp_[k] is not None and cmp_[k] <= TARGETS[k] for k in itl_checks},
        }
        info = {   # reported, not judged: both lanes' compute noise is in it
            "gateway_vs_driver_ttft_p50_diff_s": ttft["gateway_split"] - ttft["driver_split"],
            "gateway_ttft_overhead_requests": len(overhead),
            "gateway_ttft_overhead_p10_p90_s": [deciles[0], deciles[-1]] if deciles else None,
        }
        for k, ok in met.items():
            if "llama_server" in k and not dec["llama_server"]:
                checks.append({"concurrency": level, "check": k, "value": None, "met": False,
                               "note": "llama_server lane not measured"})
                continue
            if k in itl_checks and cmp_[k] is None:
                checks.append({"concurrency": level, "check": k, "value": None, "met": False,
                               "note": "no inter-token gaps measured on a lane it compares"})
                continue
            if k == "gateway_ttft_overhead_s" and not overhead:
                checks.append({"concurrency": level, "check": k, "value": None, "met": False,
                               "note": "no gateway answer reported its route timing (server_timing)"})
                continue
            checks.append({"concurrency": level, "check": k, "value": cmp_[k], "met": ok})
        cpu = {ln: _median_cpu(runs.get((ln, level), [])) for ln in dec}
        levels_doc.append({
            "concurrency": level, "rotations": max((len(runs.get((ln, level), [])) for ln in dec), default=0),
            "aggregate_decode_tok_s": dec, "ttft_p50_s": ttft, "cadence": cads, "comparisons": {**cmp_, **info},
            "met": met, "cpu_s_median": cpu,
            "where_time_goes": _where(cpu, {ln: runs.get((ln, level), []) for ln in dec}),
            "runs": {ln: [r.to_json() for r in runs.get((ln, level), [])] for ln in dec},
        })
    return {
        "bench": "serve", "model": str(model), "split": [f"{a}:{b}" for a, b in split], "threads": threads,
        "levels": list(cfg.levels), "max_tokens": cfg.max_tokens, "repeats": cfg.repeats,
        "prompts": list(cfg.prompts or []) or "dgr.route.sessions.DEFAULT_PROMPTS (cycled to the level)",
        "llama_server_command": llama.cmd if llama is not None else None,
        "llama_server_peak_rss_bytes": llama_rss,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "loadavg_before": list(load0),
                 "loadavg_after": list(load1),
                 "note": "a shared host: other work may run during the measurement; compare ratios of lanes "
                         "measured side by side in this run, not absolute figures"},
        "wall_s": wall, "targets": TARGETS, "results": levels_doc, "checks": checks,
        "all_met": all(c["met"] for c in checks),
    }


def _median_cpu(runs: Sequence[LevelResult]) -> dict[str, float]:
    keys = {k for r in runs for k in r.cpu_s}
    return {k: statistics.median([r.cpu_s.get(k, 0.0) for r in runs]) for k in sorted(keys)}


def _where(cpu: dict[str, dict[str, float]], runs_by_lane: dict[str, list[LevelResult]]) -> dict[str, Any]:
    """CPU seconds per process for the gateway lanes next to the driver lane: what the gateway
    and the HTTP client add on top of the workers' compute."""
    out: dict[str, Any] = {}
    for lane, extra in (("gateway_split", "gateway_split"), ("gateway_whole", "gateway_whole")):
        c = cpu.get(lane, {})
        out[lane] = {"gateway_process_cpu_s": c.get(extra, 0.0), "http_client_cpu_s": c.get("bench_client", 0.0),
                     "worker_cpu_s": sum(v for k, v in c.items() if "worker" in k)}
        inner = [r.gateway_ttft_mean_s for r in runs_by_lane.get(lane, []) if r.gateway_ttft_mean_s is not None]
        client = [statistics.mean(x.ttft_s for x in r.requests if x.error is None)
                  for r in runs_by_lane.get(lane, []) if r.ok]
        if inner and client:
            # the route's share of the TTFT (the gateway's own report) vs what the client saw: the
            # difference is HTTP, the framework, the event stream and the client
            out[lane]["ttft_mean_inside_gateway_s"] = statistics.median(inner)
            out[lane]["ttft_mean_at_client_s"] = statistics.median(client)
    d = cpu.get("driver_split", {})
    out["driver_split"] = {"driver_cpu_s": d.get("bench_client", 0.0),
                           "worker_cpu_s": sum(v for k, v in d.items() if "worker" in k)}
    ls = cpu.get("llama_server", {})
    out["llama_server"] = {"server_cpu_s": ls.get("llama_server", 0.0), "http_client_cpu_s": ls.get("bench_client", 0.0)}
    return out


def summary(doc: dict[str, Any]) -> str:
    lines = [f"dgr bench serve: {Path(doc['model']).name}, split {','.join(doc['split'])}, {doc['threads']} threads, "
             f"{doc['max_tokens']} tokens per answer, {doc['repeats']} x the top level requests per lane and level"]
    lines.append(f"{'conc':>4}  {'lane':<14} {'decode tok/s':>12} {'TTFT p50 ms':>12} {'chunks/tok':>10} "
                 f"{'ITL p50':>8} {'p90':>7} {'p99':>7} {'max gap':>8}")
    for lv in doc["results"]:
        for lane, v in lv["aggregate_decode_tok_s"].items():
            lines.append(f"{lv['concurrency']:>4}  {lane:<14} {v:12.1f} {lv['ttft_p50_s'][lane] * 1e3:12.1f} "
                         + cadence_cells(lv.get("cadence", {}).get(lane, {})))
    lines.append("")
    for c in doc["checks"]:
        value = "      n/a" if c["value"] is None else f"{c['value']:9.3f}"
        lines.append(f"{c['concurrency']:>4}  {c['check']:<36} {value}  {'met' if c['met'] else 'MISSED'}"
                     + (f" ({c['note']})" if c.get("note") else ""))
    return "\n".join(lines)
