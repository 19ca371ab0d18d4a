"""`dgr bench relay`: a route whose hops go through a byte relay, against the same route chained
directly.

One lab of two hosts (one core, one thread each), one worker per Shard (h1 the head, h2 the
tail), each with a relay bridge in its host, and a relay egress in h1 that the head dials for
the tail (:mod:`dgr.protocol.relay_egress`). The same workers serve every lane; the driver runs
in this process, pinned to h1's CPU with the relay processes of h1 (as a deployment runs it
next to the head):

- **direct**: chained, the driver and the head dial the workers' gRPC endpoints;
- **relay**: chained, the hop between the hosts through the relay (head -> h1's egress -> h2's
  bridge -> tail, the frames as opaque records); the driver, on the head's host, dials the head
  directly, as a gateway next to its head does;
- **relay_all**: chained, every hop through a relay, the driver's too (driver -> h1's bridge ->
  head -> ...): a driver that reaches its head only through a relay;
- **stepwise** (``--stepwise-lane``): the all-relayed route driven stepwise, as relayed routes
  ran before the egress existed.

Per repeat, in alternating order, ``--sessions`` concurrent greedy sessions of ``--max-tokens``
on each lane. Reported per repeat: aggregate decode, TTFT p50, seam bytes per token, and the CPU
seconds the relay processes (bridges and egress) used during the lane; the ratios relay/direct
(judged against the target) and relay_all/direct per pair, and their medians.
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
SCHEMA = "dgr.bench.relay.v1"
TARGET_RATIO = 0.9


@dataclass(frozen=True)
class RelayBenchConfig:
    sessions: int = 8
    max_tokens: int = 64
    repeats: int = 3
    stepwise_lane: bool = False
    split: tuple[tuple[int, int], ...] = ()      # empty: two even halves
    lab_name: str = "rly"
    # prompts as token ids (a model without a chat template, e.g. a synthetic one)
    token_prompts: bool = False

    def validate(self) -> None:
        if not 1 <= self.sessions <= 64:
            raise DgrError(f"--sessions must be 1..64, got {self.sessions}")
        if not 2 <= self.max_tokens <= 1024:
            raise DgrError(f"--max-tokens must be 2..1024, got {self.max_tokens}")
        if not 1 <= self.repeats <= 20:
            raise DgrError(f"--repeats must be 1..20, got {self.repeats}")
        if self.split and len(self.split) != 2:
            raise DgrError(f"--split must have two ranges (one per lab host), got {len(self.split)}")


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes used so far (0 for one that is gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _lane(endpoints: list[str], prompts: list[str], cfg: RelayBenchConfig, *, tls: Any, hops: list[str] | None,
          chain: bool | None, relay_pids: list[int], label: str) -> dict[str, Any]:
    from ..route.sessions import run_sessions

    cpu0 = _cpu_s(relay_pids)
    toks = [[1, 100 + i, 200 + i] for i in range(len(prompts))] if cfg.token_prompts else None
    rep = asyncio.run(run_sessions(endpoints, prompts, max_tokens=cfg.max_tokens, tls=tls, hops=hops, chain=chain,
                                   stop_on_eog=False, label=label, token_prompts=toks))
    doc = rep.to_json()
    sess = doc["sessions"]
    ttfts = sorted(s["ttft_s"] for s in sess if s.get("ttft_s") is not None)
    return {"ok": rep.ok, "mode": doc.get("mode"), "route": doc.get("route"), "errors": [s["error"] for s in sess if s.get("error")][:4],
            "aggregate_decode_tok_s": doc.get("aggregate_decode_tok_s"),
            "concurrent_decode_tok_s": doc.get("concurrent_decode_tok_s"), "driver_cpu_s": doc.get("driver_cpu_s"),
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "tokens": sum(len(s.get("tokens") or []) for s in sess),
            "seam_bytes_per_decode_token": doc.get("seam_bytes_per_decode_token"),
            "relay_cpu_s": round(_cpu_s(relay_pids) - cpu0, 3)}


def run_relay_bench(model: Path, cfg: RelayBenchConfig) -> dict[str, Any]:
    from ..lab.pin import Pinned
    from ..lab.config import LabConfig
    from ..lab.hosts import Lab
    from ..lab.route import LabRoute
    from ..route.local import ensure_worker, model_n_layer
    from ..route.sessions import DEFAULT_PROMPTS

    cfg.validate()
    ensure_worker()
    n_layer = model_n_layer(model)
    split = [tuple(r) for r in cfg.split] or [(0, n_layer // 2), (n_layer // 2, n_layer)]
    if split[0][0] != 0 or split[0][1] != split[1][0] or split[1][1] != n_layer:
        raise DgrError(f"--split must cover the model's {n_layer} layers in two contiguous ranges")
    prompts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(cfg.sessions)]
    lanes = ["direct", "relay", "relay_all"] + (["stepwise"] if cfg.stepwise_lane else [])
    doc: dict[str, Any] = {
        "schema": SCHEMA, "config": asdict(cfg), "model": str(model), "split": [list(r) for r in split],
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()},
        "setup": "lab of 2 hosts, 1 core and 1 thread each; head on h1, tail on h2; a relay bridge in each host and "
                 "a relay egress in h1 for the tail; the driver pinned to h1's CPU", "target_ratio": TARGET_RATIO,
        "lanes": {lane: [] for lane in lanes}, "ratios": [], "ratios_all_relayed": [],
    }
    lcfg = LabConfig(hosts=2, name=cfg.lab_name, cores_per_host=1, threads=1)
    with Lab.up(lcfg) as lab:
        doc["lab"] = {k: lab.state[k] for k in ("subnet", "cgroup_mode", "hosts")}
        lr = LabRoute(lab, model, split, placement=["h1", "h2"], relay=True, max_sessions=max(8, cfg.sessions),
                      ctx_per_session=1024)
        with lr, Pinned.on_host(lab, "h1") as pinned:
            doc["driver_cpus"] = sorted(pinned.cpus)
            doc["placement"] = lr.describe()
            relay_pids = lr.relay_pids
            runs = {
                "direct": dict(endpoints=lr.endpoints, hops=None, chain=True),
                "relay": dict(endpoints=lr.endpoints[:1] + lr.relay_endpoints[1:], hops=lr.relay_hops, chain=True),
                "relay_all": dict(endpoints=lr.relay_endpoints, hops=lr.relay_hops, chain=True),
                "stepwise": dict(endpoints=lr.relay_endpoints, hops=None, chain=False),
            }
            for lane in lanes:   # warm-up (not reported)
                _lane(runs[lane]["endpoints"], prompts[:2], RelayBenchConfig(max_tokens=4, token_prompts=cfg.token_prompts),
                      tls=lr.tls,
                      hops=runs[lane]["hops"], chain=runs[lane]["chain"], relay_pids=relay_pids, label=lane)
            for rep in range(cfg.repeats):
                order = lanes if rep % 2 == 0 else list(reversed(lanes))
                got: dict[str, dict[str, Any]] = {}
                for lane in order:
                    _log.info("repeat %d/%d: %s, %d sessions", rep + 1, cfg.repeats, lane, cfg.sessions)
                    res = _lane(runs[lane]["endpoints"], prompts, cfg, tls=lr.tls, hops=runs[lane]["hops"],
                                chain=runs[lane]["chain"], relay_pids=relay_pids, label=lane)
                    res["first"] = lane == order[0]
                    got[lane] = res
                    doc["lanes"][lane].append(res)
                d = got["direct"]
                for lane, key in (("relay", "ratios"), ("relay_all", "ratios_all_relayed")):
                    r = got[lane]
                    ok = d["ok"] and r["ok"] and (d["aggregate_decode_tok_s"] or 0) > 0
                    doc[key].append(r["aggregate_decode_tok_s"] / d["aggregate_decode_tok_s"] if ok else None)
    doc["machine"]["load_avg_end"] = os.getloadavg()
    ratios = [r for r in doc["ratios"] if r is not None]
    doc["median_ratio"] = statistics.median(ratios) if ratios else None
    all_relayed = [r for r in doc["ratios_all_relayed"] if r is not None]
    doc["median_ratio_all_relayed"] = statistics.median(all_relayed) if all_relayed else None
    doc["all_ok"] = len(ratios) == cfg.repeats and all(x["mode"] == "chained" for x in doc["lanes"]["relay"]
                                                       + doc["lanes"]["relay_all"])
    doc["target_met"] = bool(doc["all_ok"] and doc["median_ratio"] is not None and doc["median_ratio"] >= TARGET_RATIO)
    return doc


def summary(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = [f"relay bench ({cfg['sessions']} sessions, {cfg['max_tokens']} tokens, split {doc['split']}, load at "
             f"start {doc['machine']['load_avg_start'][0]:.2f})"]
    lanes = doc["lanes"]
    for i, r in enumerate(doc["ratios"]):
        parts = [f"{lane} {lanes[lane][i]['aggregate_decode_tok_s'] or 0:.1f} tok/s ({lanes[lane][i]['mode']}, relay "
                 f"CPU {lanes[lane][i]['relay_cpu_s']:.2f} s)" for lane in lanes]
        lines.append(f"  repeat {i + 1}: " + ", ".join(parts) + ", relay/direct " + ("-" if r is None else f"{r:.3f}"))
    med = doc["median_ratio"]
    lines.append(f"  median relay/direct: {'-' if med is None else f'{med:.3f}'} (target >= {doc['target_ratio']}): "
                 + ("met" if doc["target_met"] else "NOT met"))
    mall = doc.get("median_ratio_all_relayed")
    lines.append(f"  median relay_all/direct (the driver's hop relayed too): {'-' if mall is None else f'{mall:.3f}'}")
    return "\n".join(lines)
