"""`dgr bench replicas`: two whole-model replicas behind one gateway against one replica.

One lab of two hosts (one core, one thread each). The whole model runs on h1 and on h2, one
worker each. Two gateways run in this process, pinned to h1's CPU with the load generator (as a
deployment runs its gateway on one of its hosts, which then shares that host's core):

- **one**: a gateway over h1's replica alone;
- **two**: a gateway over both replicas (``dgr serve --route ... --route ...``), which spreads
  requests by free session slots.

Per repeat, in alternating order, ``--concurrency`` streaming chat requests (the serve bench's
OpenAI-API load generator) go to each. Reported per repeat: aggregate decode (tokens after each
request's first, over the window from the first first token to the last token), TTFT, the
requests each route took; the ratio two/one per pair, and its median against the target.

A third lane, **half**, sends half the requests to one replica alone: what each replica of
**two** does when the requests are spread evenly. ``2 x half`` is then what two replicas can
reach at all, since a worker decodes fewer tokens per second at half the batch; ``two / (2 x
half)`` (``spread_efficiency``) is the share of it the gateway delivers, and ``2 x half / one``
(``batch_ceiling``) the ratio the batch size alone allows.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import DgrError

_log = logging.getLogger(__name__)
SCHEMA = "dgr.bench.replicas.v1"
TARGET_RATIO = 1.8


@dataclass(frozen=True)
class ReplicaBenchConfig:
    concurrency: int = 16
    max_tokens: int = 64
    repeats: int = 3
    lab_name: str = "repl"
    # prompts as token ids to /v1/completions (a model without a chat template, e.g. a synthetic
    # one); otherwise chat requests with the default prompts
    token_prompts: bool = False

    def validate(self) -> None:
        if not 2 <= self.concurrency <= 64:
            raise DgrError(f"--concurrency must be 2..64, got {self.concurrency}")
        if not 2 <= self.max_tokens <= 1024:
            raise DgrError(f"--max-tokens must be 2..1024 (decode is timed after the first token), got {self.max_tokens}")
        if not 1 <= self.repeats <= 20:
            raise DgrError(f"--repeats must be 1..20, got {self.repeats}")


def _level(url: str, model_id: str, prompts: list[Any], max_tokens: int, lane: str) -> dict[str, Any]:
    from .loadgen import run_level

    lv = asyncio.run(run_level(url + "/v1", model_id, prompts, max_tokens=max_tokens, lane=lane))
    errors = [r.error for r in lv.requests if r.error is not None]
    return {"ok": lv.ok, "errors": errors[:4], "requests": len(lv.requests),
            "aggregate_decode_tok_s": lv.aggregate_decode_tok_s, "ttft_p50_s": lv.ttft_p50_s,
            "wall_s": lv.wall_s, "completion_tokens": sum(r.completion_tokens for r in lv.requests)}


def run_replica_bench(model: Path, cfg: ReplicaBenchConfig) -> dict[str, Any]:
    from ..lab.pin import Pinned
    from ..lab.config import LabConfig
    from ..lab.hosts import Lab
    from ..lab.route import LabRoute
    from ..route.local import ensure_worker, model_n_layer
    from ..route.sessions import DEFAULT_PROMPTS
    from ..serve.server import Gateway, RouteSpec

    cfg.validate()
    ensure_worker()
    n_layer = model_n_layer(model)
    prompts: list[Any] = ([[1, 100 + i, 200 + i] for i in range(cfg.concurrency)] if cfg.token_prompts else
                          [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(cfg.concurrency)])
    doc: dict[str, Any] = {
        "schema": SCHEMA, "config": asdict(cfg), "model": str(model),
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()},
        "setup": "lab of 2 hosts, 1 core and 1 thread each; the whole model on h1 and on h2; the gateways and "
                 "the load generator pinned to h1's CPU", "target_ratio": TARGET_RATIO,
        "one": [], "two": [], "half": [], "ratios": [], "spread_efficiency": [], "batch_ceiling": [],
    }
    lcfg = LabConfig(hosts=2, name=cfg.lab_name, cores_per_host=1, threads=1)
    slots = max(cfg.concurrency, 8)
    with Lab.up(lcfg) as lab:
        doc["lab"] = {k: lab.state[k] for k in ("subnet", "cgroup_mode", "hosts")}
        reps = [LabRoute(lab, model, [(0, n_layer)], placement=[h], slices=False, memory_budget=False,
                         max_sessions=slots, ctx_per_session=1024) for h in ("h1", "h2")]
        with reps[0], reps[1], Pinned.on_host(lab, "h1") as pinned:
            doc["gateway_cpus"] = sorted(pinned.cpus)
            tls = reps[0].tls
            specs = [RouteSpec(tuple(r.endpoints), "m") for r in reps]
            with Gateway(routes=specs[:1], route_tls=tls, slots=slots) as one, \
                    Gateway(routes=specs, route_tls=tls, slots=slots) as two:
                for gw, lane in ((one, "one"), (two, "two")):   # warm-up (not reported)
                    _level(gw.url, "m", prompts[:2], 4, lane)
                for rep in range(cfg.repeats):
                    order = [(one, "one"), (two, "two"), (one, "half")]
                    order = order if rep % 2 == 0 else order[::-1]
                    got: dict[str, dict[str, Any]] = {}
                    for gw, lane in order:
                        _log.info("repeat %d/%d: %s replica(s), %d concurrent requests", rep + 1, cfg.repeats,
                                  lane, cfg.concurrency)
                        before = [r.picked for r in gw.routes.routes]
                        res = _level(gw.url, "m", prompts[:cfg.concurrency // 2] if lane == "half" else prompts,
                                     cfg.max_tokens, lane)
                        res["requests_per_route"] = [r.picked - b for r, b in zip(gw.routes.routes, before)]
                        res["first"] = lane == order[0][1]
                        got[lane] = res
                        doc[lane].append(res)
                    one_r, two_r, half_r = got["one"], got["two"], got["half"]
                    ok = one_r["ok"] and two_r["ok"] and one_r["aggregate_decode_tok_s"] > 0
                    doc["ratios"].append(two_r["aggregate_decode_tok_s"] / one_r["aggregate_decode_tok_s"]
                                         if ok else None)
                    ok_half = ok and half_r["ok"] and half_r["aggregate_decode_tok_s"] > 0
                    ideal = 2 * half_r["aggregate_decode_tok_s"]
                    doc["spread_efficiency"].append(two_r["aggregate_decode_tok_s"] / ideal if ok_half else None)
                    doc["batch_ceiling"].append(ideal / one_r["aggregate_decode_tok_s"] if ok_half else None)
    doc["machine"]["load_avg_end"] = os.getloadavg()
    ratios = [r for r in doc["ratios"] if r is not None]
    doc["median_ratio"] = statistics.median(ratios) if ratios else None
    for key in ("spread_efficiency", "batch_ceiling"):
        vals = [v for v in doc[key] if v is not None]
        doc[f"median_{key}"] = statistics.median(vals) if vals else None
    doc["all_ok"] = len(ratios) == cfg.repeats
    doc["target_met"] = bool(doc["all_ok"] and doc["median_ratio"] is not None and doc["median_ratio"] >= TARGET_RATIO)
    return doc


def summary(doc: dict[str, Any]) -> str:
    lines = [f"replicas bench ({doc['config']['concurrency']} concurrent requests, load at start "
             f"{doc['machine']['load_avg_start'][0]:.2f})"]
    for i, (a, b, h, r) in enumerate(zip(doc["one"], doc["two"], doc["half"], doc["ratios"])):
        lines.append(f"  repeat {i + 1}: one {a['aggregate_decode_tok_s']:.1f} tok/s, two "
                     f"{b['aggregate_decode_tok_s']:.1f} tok/s {b['requests_per_route']}, half (one replica, "
                     f"{h['requests']} requests) {h['aggregate_decode_tok_s']:.1f} tok/s, ratio "
                     + ("-" if r is None else f"{r:.2f}"))
    med = doc["median_ratio"]
    lines.append(f"  median two/one: {'-' if med is None else f'{med:.2f}'} (target >= {doc['target_ratio']}): "
                 + ("met" if doc["target_met"] else "NOT met"))
    eff, ceil = doc.get("median_spread_efficiency"), doc.get("median_batch_ceiling")
    if eff is not None and ceil is not None:
        lines.append(f"  median two / (2 x half): {eff:.3f} (the spread); 2 x half / one: {ceil:.2f} (what the batch "
                     "size allows)")
    return "\n".join(lines)
