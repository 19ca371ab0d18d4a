"""`dgr bench route --hosts N`: a route over N simulated hosts (1 core, 1 thread each) against
one such host, in one run (ratios measured side by side, each repeat kept).

Per added round trip (default 0 and 10 ms, through the lab's link shaping), a lab of N hosts is
brought up and torn down; in it, interleaved per repeat:

- the route: one dgr-worker per shard on h1..hN (slice files, mTLS on every hop, chained mode:
  the driver streams to the head only), 1 / 4 / 8 concurrent sessions of ``n_prompt`` synthetic
  tokens then ``n_gen`` generated, and one ``long_prompt``-token prefill;
- the whole model on one dgr-worker on h1 (same driver, same sessions);
- stock llama.cpp on every host at the same thread count (no network): ``llama-bench`` (pp
  n_prompt and long_prompt, tg n_gen at depth n_prompt) and ``llama-batched-bench`` (B = each
  session count); measured in the first lab (without added latency); the mean of the hosts is the
  one-host yardstick for both (bench_report.py);
- llama.cpp RPC (2 hosts): an ``rpc-server`` on h2 holding the second half of the layers and the
  output, ``llama-bench``/``llama-batched-bench --rpc`` on h1 holding the first half (tools from
  build/<backend>-rpc, ``dgr build --rpc``); skipped with the reason when not built.

Where the time goes, per run: each stage's busy share (time inside llama_decode / wall), decode
compute per batch and per token, decode busy share at the measured rate, rows per batch, hand-off
time per step while the stages take turns (step time minus the stages' compute), mean queue wait,
seam bytes per decode token per hop, and the link proxy's counters. Targets and the text summary:
bench_report.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DgrError
from .bench_report import baseline, targets
from .pin import Pinned

_log = logging.getLogger(__name__)

SCHEMA = "dgr.bench.route_hosts/1"
COUNTERS = ("dgr_decode_busy_seconds_total", "dgr_decode_only_busy_seconds_total", "dgr_decode_only_batches_total",
            "dgr_decode_only_rows_total", "dgr_queue_wait_seconds_sum", "dgr_queue_wait_seconds_count",
            "dgr_gather_wait_seconds_total", "dgr_pipeline_held_rows_total")


@dataclass(frozen=True)
class HostsBenchConfig:
    hosts: int = 2
    split: tuple[tuple[int, int], ...] | None = None   # default: balanced by weights (model_split)
    n_prompt: int = 128
    n_gen: int = 64
    long_prompt: int = 512
    sessions: tuple[int, ...] = (1, 4, 8)
    rtts_ms: tuple[float, ...] = (0.0, 10.0)
    repeats: int = 3
    rpc: bool = True
    backend: str = "cpu"
    lab_name: str = "bench"
    pipeline_groups: int | None = None  # the route workers' --pipeline-groups (None: their default)
    # the route workers' --keep-warm-ms: each host's core is the route's alone, and a stage idles
    # while the others compute (docs/worker.md, "Keeping the cores awake"); 0: off
    keep_warm_ms: int = 50
    rate_mbit: float | None = None      # every host's link shaped to this rate (tc tbf), None: unshaped

    def validate(self) -> None:
        """Every knob within what a run can do, refused before a lab comes up (DgrError)."""
        import math

        from .config import MAX_DELAY_MS, MAX_RATE_MBIT

        if self.rate_mbit is not None and not (math.isfinite(self.rate_mbit) and 0 < self.rate_mbit <= MAX_RATE_MBIT):
            raise DgrError(f"--rate-mbit must be > 0 and at most {MAX_RATE_MBIT:g}, got {self.rate_mbit}")

        if not 2 <= self.hosts <= 16:
            raise DgrError(f"--hosts must be 2..16 for a route across hosts, got {self.hosts}")
        if not self.sessions or len(self.sessions) > 16 or not all(1 <= c <= 256 for c in self.sessions):
            raise DgrError(f"--sessions needs 1 to 16 counts, each 1..256 (a worker's most sessions), got "
                           f"{','.join(map(str, self.sessions)) or 'none'}")
        if not self.rtts_ms or len(self.rtts_ms) > 8 or \
                not all(math.isfinite(r) and 0 <= r <= MAX_DELAY_MS for r in self.rtts_ms):
            raise DgrError(f"--rtt-ms needs 1 to 8 values, each 0..{MAX_DELAY_MS:g} ms, got "
                           f"{','.join(f'{r:g}' for r in self.rtts_ms) or 'none'}")
        if not 1 <= self.repeats <= 50:
            raise DgrError(f"--repeats must be 1..50, got {self.repeats}")
        if self.n_prompt < 1 or self.n_gen < 1 or self.long_prompt < 1 or \
                self.n_prompt + self.n_gen > 32768 or self.long_prompt > 32768:
            raise DgrError("--n-prompt, --n-gen and --long-prompt must be >= 1, with n-prompt + n-gen and "
                           "long-prompt at most 32768 tokens")


def even_split(n_layer: int, hosts: int) -> list[tuple[int, int]]:
    cuts = [round(i * n_layer / hosts) for i in range(hosts + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:])]


def balanced_split(layer_cost: list[int], output_cost: int, hosts: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges whose largest stage cost is the least, a stage's cost being the
    weights it multiplies per decode step: its layers', plus the output matrix for the last one
    (``output.weight``, or the tied ``token_embd.weight``; the head's embedding lookup reads only
    the rows it needs and is not counted). A pipeline runs at the pace of its slowest stage."""
    n = len(layer_cost)
    if not 1 <= hosts <= n:
        raise DgrError(f"cannot split {n} layers over {hosts} hosts")
    pre = [0]
    for b in layer_cost:
        pre.append(pre[-1] + b)
    inf = float("inf")
    # best[k][i]: least max cost of layers [0, i) over k stages (no output); cut[k][i]: last cut
    best = [[inf] * (n + 1) for _ in range(hosts + 1)]
    cut = [[0] * (n + 1) for _ in range(hosts + 1)]
    best[0][0] = 0
    for k in range(1, hosts + 1):
        for i in range(k, n + 1):
            extra = output_cost if (k == hosts and i == n) else 0
            for j in range(k - 1, i):
                c = max(best[k - 1][j], pre[i] - pre[j] + extra)
                if c < best[k][i]:
                    best[k][i], cut[k][i] = c, j
    cuts, i = [n], n
    for k in range(hosts, 0, -1):
        i = cut[k][i]
        cuts.append(i)
    cuts.reverse()
    return [(a, b) for a, b in zip(cuts, cuts[1:])]


def model_split(model: Path, hosts: int) -> list[tuple[int, int]]:
    """:func:`balanced_split` of a GGUF's layers by their weights' element counts. Per decode
    step a CPU spends about the same per weight whatever its quantization (measured on SmolLM2-
    135M, one core, 1-row steps: 0.33 ms per 3.5 M-weight Q4_1 layer, 2.8 ms for the 28 M-weight
    Q8_0 output matrix; bytes would weigh that matrix as 14 layers instead of 8). Its output
    matrix costs as much as 8 of the 30 layers, so the even 0:15|15:30 leaves the head idle
    about a third of every step; the balanced split is 0:19|19:30."""
    from ..gguf.gguf_set import open_model
    from ..gguf.inspect import layer_of

    with open_model(model) as gf:   # every part of a split set
        n_layer = int(gf.n_layer)
        per = [0] * n_layer
        for t in gf.tensors:
            i = layer_of(t.name)
            if i is not None and i < n_layer:
                per[i] += t.n_elements
        out = "output.weight" if gf.has_tensor("output.weight") else "token_embd.weight"
        out_cost = gf.tensor(out).n_elements if gf.has_tensor(out) else 0
    return balanced_split(per, out_cost, hosts)


def _counters(targets: list[str], tls: Any) -> list[dict[str, float]]:
    from ..protocol.client import WorkerClient

    out = []
    for ep in targets:
        with WorkerClient(ep, timeout=10, tls=tls) as c:
            s: dict[str, float] = {}
            for m in c.metrics().samples:
                if not m.labels or m.name.endswith(("_sum", "_count")):
                    s[m.name] = s.get(m.name, 0.0) + m.value
        out.append({k: s.get(k, 0.0) for k in COUNTERS})
    return out


def _where(before: list[dict[str, float]], after: list[dict[str, float]], wall: float,
           decode_tok_s: float) -> dict[str, Any]:
    """Per stage: busy share, decode compute per batch and per token, the stage's decode busy share
    at the measured rate, rows per batch, queue wait; per step: the stages' compute and the
    hand-offs (step time minus compute). The hand-offs are defined only while the stages take
    turns (their decode busy shares sum to at most 1); on a pipelined run they overlap, the
    subtraction means nothing and ``handoff_ms_per_step`` is None: there each stage's decode busy
    share says how far it is from being busy all the time."""
    stages = []
    for b, a in zip(before, after):
        d = {k: a[k] - b[k] for k in COUNTERS}
        n = d["dgr_decode_only_batches_total"]
        per_tok = 1e3 * d["dgr_decode_only_busy_seconds_total"] / d["dgr_decode_only_rows_total"] \
            if d["dgr_decode_only_rows_total"] else 0.0
        stages.append({"busy_share": d["dgr_decode_busy_seconds_total"] / wall if wall > 0 else 0.0,
                       "decode_compute_ms_per_token": per_tok,
                       # the share of the time this stage computes decode rows at the measured rate
                       "decode_busy_share": per_tok * decode_tok_s / 1e3,
                       "decode_compute_ms_per_batch": 1e3 * d["dgr_decode_only_busy_seconds_total"] / n if n else 0.0,
                       "rows_per_batch": d["dgr_decode_only_rows_total"] / n if n else 0.0,
                       "mean_queue_wait_ms": 1e3 * d["dgr_queue_wait_seconds_sum"] / d["dgr_queue_wait_seconds_count"]
                       if d["dgr_queue_wait_seconds_count"] else 0.0,
                       # pipelined scheduling (docs/worker.md): time spent gathering rows into a
                       # batch, and chained rows a head left for the next group's batch
                       "gather_wait_share": d["dgr_gather_wait_seconds_total"] / wall if wall > 0 else 0.0,
                       "pipeline_held_rows": d["dgr_pipeline_held_rows_total"]})
    rows = stages[0]["rows_per_batch"] if stages else 0.0
    step_ms = 1e3 * rows / decode_tok_s if decode_tok_s > 0 and rows else 0.0
    compute = sum(s["decode_compute_ms_per_batch"] for s in stages)
    overlap = sum(s["decode_busy_share"] for s in stages) > 1.0
    return {"stages": stages, "step_ms": step_ms, "compute_ms_per_step": compute, "stages_overlap": overlap,
            "handoff_ms_per_step": None if overlap else (step_ms - compute if step_ms else 0.0)}


def measure(endpoints: list[str], direct: list[str], tls: Any, *, n_prompt: int, n_gen: int, sessions: int,
            seed: int) -> dict[str, Any]:
    """One run: ``sessions`` concurrent sessions through ``endpoints`` (the route or one worker)."""
    from ..bench.route import synthetic_prompt
    from ..route.driver import Sampling
    from ..route.sessions import run_sessions

    prompts = [synthetic_prompt(n_prompt, seed + i) for i in range(sessions)]
    m0 = _counters(direct, tls)
    t0 = time.perf_counter()
    rep = asyncio.run(run_sessions(endpoints, [""] * sessions, token_prompts=prompts, max_tokens=n_gen,
                                   sampling=Sampling(ignore_eog=True), stop_on_eog=False, label="bench", tls=tls,
                                   timeout=120.0))
    wall = time.perf_counter() - t0
    if not rep.ok:
        raise DgrError("a benchmark session failed: " + "; ".join(s.error or "" for s in rep.sessions if s.error))
    m1 = _counters(direct, tls)
    s0 = rep.sessions[0]
    decode = s0.decode_tok_s if sessions == 1 else (rep.concurrent_decode_tok_s or rep.aggregate_decode_tok_s)
    return {"sessions": sessions, "mode": rep.mode, "n_prompt": n_prompt, "n_gen": n_gen,
            "prefill_tok_s": s0.prefill_tok_s if sessions == 1 else rep.aggregate_prefill_tok_s,
            "decode_tok_s": decode, "aggregate_decode_window_tok_s": rep.aggregate_decode_tok_s,
            "ttft_s": rep.mean_ttft_s, "seam_bytes_per_decode_token": rep.seam_bytes_per_decode_token,
            "wall_s": wall, "where": _where(m0, m1, wall, decode)}


def measure_replicas(replicas: list[tuple[list[str], list[str]]], tls: Any, *, n_prompt: int, n_gen: int,
                     sessions: int, seed: int) -> dict[str, Any]:
    """The replica ceiling: the whole model on each host at once, the sessions spread evenly
    over them (``replicas``: each one's endpoints and direct targets), all driven together; the
    aggregate decode is the sum of the replicas' concurrent rates."""
    from ..bench.route import synthetic_prompt
    from ..route.driver import Sampling
    from ..route.sessions import run_sessions

    n = len(replicas)
    share = [sessions // n + (1 if i < sessions % n else 0) for i in range(n)]
    used = [(r, k) for r, k in zip(replicas, share) if k > 0]

    async def all_at_once() -> list[Any]:
        return await asyncio.gather(*(
            run_sessions(eps, [""] * k, token_prompts=[synthetic_prompt(n_prompt, seed + 1000 * j + i) for i in range(k)],
                         max_tokens=n_gen, sampling=Sampling(ignore_eog=True), stop_on_eog=False,
                         label="bench-replica", tls=tls, timeout=120.0)
            for j, ((eps, _), k) in enumerate(used)))

    t0 = time.perf_counter()
    reps = asyncio.run(all_at_once())
    wall = time.perf_counter() - t0
    bad = [s.error for rep in reps for s in rep.sessions if s.error]
    if bad:
        raise DgrError("a replica session failed: " + "; ".join(bad))
    per = [(rep.sessions[0].decode_tok_s if k == 1 else (rep.concurrent_decode_tok_s or rep.aggregate_decode_tok_s))
           for rep, (_, k) in zip(reps, used)]
    return {"sessions": sessions, "replicas": n, "sessions_per_replica": [k for _, k in used],
            "per_replica_decode_tok_s": per, "decode_tok_s": sum(per), "wall_s": wall,
            "ttft_s": sum(rep.mean_ttft_s for rep in reps) / len(reps)}


# ---- stock llama.cpp on one host -----------------------------------------------------------

def _tool(name: str, backend: str, rpc: bool = False) -> Path:
    from ..upstream.build import rpc_tool_binary, tool_binary

    return rpc_tool_binary(name, backend, build_missing=False) if rpc else tool_binary(name, backend)


def llama_bench(lab: Any, host: str, exe: Path, model: Path, *, threads: int, n_prompt: int, long_prompt: int,
                n_gen: int, extra: list[str] = ()) -> dict[str, Any]:
    """llama-bench inside ``host``: pp at n_prompt and long_prompt (one run), tg n_gen at depth n_prompt."""
    from ..bench import llama_tools

    prefix = lab.prefix(host)
    pp_rows, pp_m = llama_tools.llama_bench(exe, model, threads=threads, n_prompt=(n_prompt, long_prompt), n_gen=0,
                                            reps=1, extra=extra, prefix=prefix)
    tg_rows, tg_m = llama_tools.llama_bench(exe, model, threads=threads, n_prompt=0, n_gen=n_gen, reps=1,
                                            depth=n_prompt, extra=extra, prefix=prefix)
    pp = {r.n_prompt: r.avg_ts for r in pp_rows if r.is_prefill}
    tg = next((r.avg_ts for r in tg_rows if r.n_gen > 0), None)
    if tg is None:
        raise DgrError(f"llama-bench in {host} printed no tg row")
    return {"command": " ; ".join((pp_m.shown, tg_m.shown)), "pp_tok_s": pp.get(n_prompt),
            "pp_long_tok_s": pp.get(long_prompt), "tg_tok_s": tg}


def batched_bench(lab: Any, host: str, exe: Path, model: Path, *, threads: int, n_prompt: int, n_gen: int,
                  npl: tuple[int, ...], extra: list[str] = ()) -> dict[str, Any]:
    """llama-batched-bench inside ``host``: aggregate pp/tg per batch size of ``npl``."""
    from ..bench.route import batched_bench_by_batch

    return batched_bench_by_batch(exe, model, threads=threads, n_prompt=n_prompt, n_gen=n_gen, npl=npl, extra=extra,
                                  prefix=lab.prefix(host))


class RpcServer:
    """llama.cpp's rpc-server in a lab host (CPU device only), reachable through the lab's link."""

    def __init__(self, lab: Any, host: str, backend: str, threads: int) -> None:
        self.lab, self.host, self.threads = lab, host, threads
        self.exe = _tool("rpc-server", backend, rpc=True)
        self.proc = None
        self.endpoint = ""

    def __enter__(self) -> "RpcServer":
        import socket

        h = self.lab.host(self.host)
        port = 50052
        self.proc = self.lab.spawn(h, [str(self.exe), "-H", h.ip, "-p", str(port), "-t", str(self.threads),
                                       "-d", "CPU"], log_name="rpc-server")
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise DgrError(f"rpc-server in {self.host} exited ({self.proc.returncode})")
            try:
                with socket.create_connection((h.ip, port), timeout=0.5):
                    break
            except OSError:
                time.sleep(0.1)
        else:
            raise DgrError(f"rpc-server in {self.host} did not accept connections within 60 s")
        self.endpoint = self.lab.expose(h, port)
        return self

    def __exit__(self, *exc: object) -> None:
        from . import system as sx

        if self.proc is not None:
            sx.stop_pids([self.proc.pid])
            self.proc.wait(5)


# ---- the run --------------------------------------------------------------------------------

def run_hosts_bench(model: Path, cfg: HostsBenchConfig) -> dict[str, Any]:
    from ..gguf.inspect import open_gguf
    from .hosts import Lab, LabConfig
    from .route import LabRoute

    say = _log.info
    if cfg.hosts < 2:
        raise DgrError("--hosts must be >= 2 for a route across hosts")
    with open_gguf(model) as gf:
        n_layer, n_embd = int(gf.n_layer), int(gf.hparam("embedding_length"))
    split = list(cfg.split) if cfg.split else model_split(model, cfg.hosts)
    if len(split) != cfg.hosts or split[-1][1] != n_layer:
        raise DgrError(f"the split needs {cfg.hosts} shards ending at layer {n_layer}")
    lb_exe, bb_exe = _tool("llama-bench", cfg.backend), _tool("llama-batched-bench", cfg.backend)
    rpc_reason = None
    if cfg.rpc and cfg.hosts != 2:
        rpc_reason = "the llama.cpp RPC yardstick is measured for 2 hosts"
    elif cfg.rpc:
        try:
            rpc_exes = {n: _tool(n, cfg.backend, rpc=True) for n in ("rpc-server", "llama-bench", "llama-batched-bench")}
        except DgrError as exc:
            rpc_reason = f"llama.cpp RPC tools not built ({exc.one_line()}); run `dgr build --rpc`"
    else:
        rpc_reason = "--no-rpc"
    multi = tuple(c for c in cfg.sessions if c > 1)
    max_s = max(cfg.sessions)
    ctx = max(cfg.n_prompt + cfg.n_gen, cfg.long_prompt + 8) + 16
    doc: dict[str, Any] = {
        "schema": SCHEMA, "model": str(model), "model_bytes": model.stat().st_size, "n_layer": n_layer,
        "n_embd": n_embd, "hosts": cfg.hosts, "split": [f"{a}:{b}" for a, b in split],
        "pipeline_groups": "auto" if cfg.pipeline_groups is None else cfg.pipeline_groups,
        "route_keep_warm_ms": cfg.keep_warm_ms,
        "split_policy": "given (--split)" if cfg.split else
        "balanced by weights per decode step (the tail holds the output matrix)", "threads_per_host": 1,
        "cores_per_host": 1, "n_prompt": cfg.n_prompt, "n_gen": cfg.n_gen, "long_prompt": cfg.long_prompt,
        "sessions": list(cfg.sessions), "repeats": cfg.repeats, "rtts_ms": list(cfg.rtts_ms),
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()},
        "seam_bytes_limit": 2 * n_embd * 4 + 256, "by_rtt": {}, "one_host": {"llama_bench": [], "batched_bench": []},
        # the same one-host measurements on every other host: the hosts of a lab need not be equally
        # fast (on a VM each is a vCPU), and the route runs on all of them; targets are judged
        # against the mean of the hosts per repeat (baseline_hosts), h1 alone is kept as well
        "other_hosts": {f"h{i}": {"llama_bench": [], "batched_bench": []} for i in range(2, cfg.hosts + 1)},
        "rpc_skipped": rpc_reason,
    }
    for rtt in cfg.rtts_ms:
        key = f"{rtt:g}"
        res: dict[str, Any] = {"route": {str(c): [] for c in cfg.sessions}, "whole_worker": {str(c): [] for c in cfg.sessions},
                               "replicas": {str(c): [] for c in cfg.sessions if c >= cfg.hosts},
                               "route_long_prefill": [], "whole_long_prefill": [], "rpc": []}
        lcfg = LabConfig(hosts=cfg.hosts, name=cfg.lab_name, cores_per_host=1, threads=1, rtt_ms=rtt,
                         rate_mbit=cfg.rate_mbit)
        say(f"lab: {cfg.hosts} hosts, 1 core/1 thread each, added RTT {rtt:g} ms"
            + (f", links shaped to {cfg.rate_mbit:g} Mbit/s" if cfg.rate_mbit else ""))
        with Lab.up(lcfg) as lab:
            res["lab"] = {k: lab.state[k] for k in ("subnet", "gateway", "shaping", "cgroup_mode", "hosts")}
            route = LabRoute(lab, model, split, slices=True, memory_budget=False, max_sessions=max_s,
                             ctx_per_session=ctx, backend=cfg.backend,
                             extra_args=(() if cfg.pipeline_groups is None else
                                         ("--pipeline-groups", str(cfg.pipeline_groups)))
                             + (("--keep-warm-ms", str(cfg.keep_warm_ms)) if cfg.keep_warm_ms else ()))
            whole = LabRoute(lab, model, [(0, n_layer)], placement=["h1"], slices=False, memory_budget=False,
                             max_sessions=max_s, ctx_per_session=ctx, backend=cfg.backend)
            # the replica ceiling: the whole model on every host (h1's is `whole`)
            others = [LabRoute(lab, model, [(0, n_layer)], placement=[f"h{i}"], slices=False, memory_budget=False,
                               max_sessions=max_s, ctx_per_session=ctx, backend=cfg.backend)
                      for i in range(2, cfg.hosts + 1)]
            with route, whole, contextlib.ExitStack() as stack, \
                    Pinned.on_host(lab, "h1") as pinned:
                for o in others:
                    stack.enter_context(o)
                res["driver_cpus"] = sorted(pinned.cpus)
                replicas = [(whole.endpoints, [p.direct for p in whole.placed])] + \
                    [(o.endpoints, [p.direct for p in o.placed]) for o in others]
                res["route_placement"], res["whole_placement"] = route.describe(), whole.describe()
                rd, wd = [p.direct for p in route.placed], [p.direct for p in whole.placed]
                tls = route.tls
                measure(route.endpoints, rd, tls, n_prompt=16, n_gen=4, sessions=1, seed=999)    # warm-up
                measure(whole.endpoints, wd, tls, n_prompt=16, n_gen=4, sessions=1, seed=999)
                rpc_srv = RpcServer(lab, "h2", cfg.backend, 1) if rpc_reason is None else None
                if rpc_srv:
                    rpc_srv.__enter__()
                try:
                    for rep in range(cfg.repeats):
                        if rtt == cfg.rtts_ms[0]:
                            say(f"[rtt {key} ms] repeat {rep + 1}/{cfg.repeats}: llama-bench, llama-batched-bench on h1")
                            doc["one_host"]["llama_bench"].append(llama_bench(
                                lab, "h1", lb_exe, model, threads=1, n_prompt=cfg.n_prompt,
                                long_prompt=cfg.long_prompt, n_gen=cfg.n_gen))
                            if multi:   # llama-batched-bench only for the session counts above 1
                                doc["one_host"]["batched_bench"].append(batched_bench(
                                    lab, "h1", bb_exe, model, threads=1, n_prompt=cfg.n_prompt, n_gen=cfg.n_gen,
                                    npl=multi))
                            for h, runs in doc["other_hosts"].items():
                                say(f"[rtt {key} ms] repeat {rep + 1}/{cfg.repeats}: the same on {h}")
                                runs["llama_bench"].append(llama_bench(
                                    lab, h, lb_exe, model, threads=1, n_prompt=cfg.n_prompt,
                                    long_prompt=cfg.long_prompt, n_gen=cfg.n_gen))
                                if multi:
                                    runs["batched_bench"].append(batched_bench(
                                        lab, h, bb_exe, model, threads=1, n_prompt=cfg.n_prompt, n_gen=cfg.n_gen,
                                        npl=multi))
                        for c in cfg.sessions:
                            say(f"[rtt {key} ms] repeat {rep + 1}/{cfg.repeats}: {c} session(s): route, whole worker")
                            res["route"][str(c)].append(measure(route.endpoints, rd, tls, n_prompt=cfg.n_prompt,
                                                                n_gen=cfg.n_gen, sessions=c, seed=rep * 100))
                            res["whole_worker"][str(c)].append(measure(whole.endpoints, wd, tls, n_prompt=cfg.n_prompt,
                                                                       n_gen=cfg.n_gen, sessions=c, seed=rep * 100))
                            if str(c) in res["replicas"]:
                                say(f"[rtt {key} ms] repeat {rep + 1}/{cfg.repeats}: {c} sessions over "
                                    f"{cfg.hosts} whole-model replicas")
                                res["replicas"][str(c)].append(measure_replicas(
                                    replicas, tls, n_prompt=cfg.n_prompt, n_gen=cfg.n_gen, sessions=c,
                                    seed=rep * 100))
                        say(f"[rtt {key} ms] repeat {rep + 1}/{cfg.repeats}: {cfg.long_prompt}-token prefill")
                        res["route_long_prefill"].append(measure(route.endpoints, rd, tls, n_prompt=cfg.long_prompt,
                                                                 n_gen=2, sessions=1, seed=7 + rep))
                        res["whole_long_prefill"].append(measure(whole.endpoints, wd, tls, n_prompt=cfg.long_prompt,
                                                                 n_gen=2, sessions=1, seed=7 + rep))
                        if rpc_srv:
                            say(f"[rtt {key} ms] repeat {rep + 1}/{cfg.repeats}: llama.cpp RPC (h1 + rpc-server on h2)")
                            ngl = str(n_layer - split[1][0] + 1)
                            extra = ["--rpc", rpc_srv.endpoint, "-ngl", ngl]
                            res["rpc"].append({
                                "llama_bench": llama_bench(lab, "h1", rpc_exes["llama-bench"], model, threads=1,
                                                           n_prompt=cfg.n_prompt, long_prompt=cfg.long_prompt,
                                                           n_gen=cfg.n_gen, extra=extra),
                                "batched_bench": batched_bench(lab, "h1", rpc_exes["llama-batched-bench"], model,
                                                               threads=1, n_prompt=cfg.n_prompt, n_gen=cfg.n_gen,
                                                               npl=multi, extra=extra) if multi else {"by_batch": {}}})
                finally:
                    if rpc_srv:
                        rpc_srv.__exit__()
                res["proxies"] = lab.proxy_stats()
        doc["by_rtt"][key] = res
    doc["machine"]["load_avg_end"] = os.getloadavg()
    doc["baseline_hosts"] = baseline(doc)[2]
    doc["targets"] = targets(doc)
    return doc
