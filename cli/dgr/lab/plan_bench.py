"""`dgr bench plan`: the planned split against the even split and the fastest host alone, on lab
hosts of unequal speed, with the planner's predictions next to what each route measured
(docs/multi-host.md, "Choosing a split").

One lab: one core and one thread per host, each host's CPU time capped by its quota (cgroup cpu
controller). Each host probes itself inside its namespace (``dgr-worker probe``, the model's last
layers), the planner plans for each session count from those figures, and then, per session
count and in alternating order per repeat:

- **planned**: the planner's hosts, split and pipeline groups;
- **even**: every host, layers in equal parts, the workers' own group policy;
- **first host alone**: the whole model on h1 (what adding the other hosts must not undercut);
- **given** (with ``--compare``): a hand-chosen split over every host.

The driver runs pinned to h1's CPU, as a deployment's gateway runs on the first host listed (the
planner counts its share there; the planned route may have another host as its head)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import platform
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import DgrError

_log = logging.getLogger(__name__)
SCHEMA = "dgr.bench.plan.v1"


@dataclass(frozen=True)
class PlanBenchConfig:
    cpu_quota: tuple[float | None, ...] = (None, 0.5)   # per host, in cores; None: the whole core
    # per host CPU sets (None: one core each, round robin); hosts given the same set share it,
    # and the planner is told so (HostCapability.core)
    cpus: tuple[str, ...] | None = None
    sessions: tuple[int, ...] = (1, 8)
    n_prompt: int = 64
    n_gen: int = 48
    repeats: int = 3
    probe_budget_s: float = 5.0
    lab_name: str = "planb"
    backend: str = "cpu"
    # a hand-chosen split over every host, in their order, run as a fourth route ("given")
    compare: tuple[tuple[int, int], ...] | None = None

    def validate(self) -> None:
        if not 2 <= len(self.cpu_quota) <= 8:
            raise DgrError(f"--cpu-quota must name 2 to 8 hosts ('-' for a whole core), got {len(self.cpu_quota)}")
        for q in self.cpu_quota:
            if q is not None and not (math.isfinite(q) and 0.05 <= q <= 1.0):
                raise DgrError(f"--cpu-quota {q:g}: a host here has one core; give 0.05..1 or '-'")
        if not self.sessions or len(self.sessions) > 8 or not all(1 <= s <= 64 for s in self.sessions):
            raise DgrError("--sessions needs 1 to 8 counts, each 1..64")
        if not 1 <= self.repeats <= 20:
            raise DgrError(f"--repeats must be 1..20, got {self.repeats}")
        if not (1 <= self.n_prompt <= 4096 and 1 <= self.n_gen <= 4096):
            raise DgrError("--n-prompt and --n-gen must be 1..4096")
        if not 0.5 <= self.probe_budget_s <= 600:
            raise DgrError("--probe-budget-s must be 0.5..600")
        if self.cpus is not None and len(self.cpus) != len(self.cpu_quota):
            raise DgrError(f"--cpus has {len(self.cpus)} sets for {len(self.cpu_quota)} hosts")
        if self.compare is not None and len(self.compare) != len(self.cpu_quota):
            raise DgrError(f"--compare has {len(self.compare)} ranges for {len(self.cpu_quota)} hosts")


def _ranges_text(r: list[tuple[int, int]]) -> str:
    return ",".join(f"{a}:{b}" for a, b in r)


def run_plan_bench(model: Path, cfg: PlanBenchConfig) -> dict[str, Any]:
    from ..route.planner import Link, Overheads, Workload, even_ranges, model_shape, plan_route, predict
    from ..route.probe import capability_from_probe, capability_of, default_probe_range, host_memory_bytes, run_probe
    from ..upstream.build import worker_binary_path
    from .bench import measure
    from .pin import Pinned
    from .hosts import Lab, LabConfig
    from .route import LabRoute

    cfg.validate()
    say = _log.info
    shape = model_shape(model)
    if cfg.compare is not None and cfg.compare[-1][1] != shape.n_layer:
        raise DgrError(f"--compare ends at layer {cfg.compare[-1][1]}; the model has {shape.n_layer}")
    n = len(cfg.cpu_quota)
    max_s = max(cfg.sessions)
    ctx = cfg.n_prompt + cfg.n_gen + 16
    # the lab's veth hops: no added delay; a loopback-class round trip and bandwidth
    link = Link(rtt_s=0.0002, bandwidth_bytes_s=1.25e9)
    doc: dict[str, Any] = {
        "schema": SCHEMA, "model": str(model), "n_layer": shape.n_layer, "hosts": n,
        "cpu_quota": [q for q in cfg.cpu_quota], "cpus": list(cfg.cpus) if cfg.cpus else None,
        "threads_per_host": 1, "cores_per_host": 1,
        "sessions": list(cfg.sessions), "n_prompt": cfg.n_prompt, "n_gen": cfg.n_gen, "repeats": cfg.repeats,
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()},
        "link_model": {"rtt_s": link.rtt_s, "bandwidth_bytes_s": link.bandwidth_bytes_s},
        "overheads_model": asdict(Overheads()),
        "capabilities": [], "levels": {},
    }
    lcfg = LabConfig(hosts=n, name=cfg.lab_name, cores_per_host=1, threads=1, rtt_ms=0.0,
                     cpu_quota=list(cfg.cpu_quota), cpus=list(cfg.cpus) if cfg.cpus else None)
    lcfg.validate()
    say(f"lab: {n} hosts, 1 core/1 thread each, CPU quotas "
        + ", ".join("whole" if q is None else f"{q:g}" for q in cfg.cpu_quota))
    with Lab.up(lcfg) as lab:
        doc["lab"] = {k: lab.state[k] for k in ("subnet", "cgroup_mode", "hosts")}
        entries = []
        for h in lab.hosts:
            say(f"probe on {h.name}")
            raw = run_probe(model, default_probe_range(shape.n_layer), threads=1, budget_s=cfg.probe_budget_s,
                            binary=worker_binary_path(cfg.backend), prefix=lab.prefix(h))
            entry = capability_from_probe(raw, shape, name=h.name, memory_bytes=host_memory_bytes(raw, None))
            if sum(o.cpus == h.cpus for o in lab.hosts) > 1:
                entry["core"] = f"cpus {h.cpus}"   # shared with another host: the model adds them up
            entries.append(entry)
        doc["capabilities"] = entries
        caps = [capability_of(e) for e in entries]
        for s in cfg.sessions:
            work = Workload(sessions=s, prompt_tokens=cfg.n_prompt, ctx_per_session=ctx)
            plan = plan_route(shape, caps, link, work)
            even = even_ranges(shape.n_layer, n)
            even_groups = min(s, n)   # the workers' auto policy: one group per host off-host
            first_alone = plan_route(shape, caps[:1], link, work).prediction
            variants = {
                "planned": {"hosts": plan.hosts, "split": [tuple(map(int, r.split(":"))) for r in plan.split.split(",")],
                            "groups": plan.prediction.groups, "predicted": asdict(plan.prediction)},
                "even": {"hosts": [h.name for h in lab.hosts], "split": even, "groups": None,
                         "predicted": asdict(predict(shape, caps, even, link, work, even_groups,
                                                     gateway=lab.hosts[0].name))},
                "first_alone": {"hosts": [lab.hosts[0].name], "split": [(0, shape.n_layer)], "groups": 1,
                                "predicted": asdict(first_alone)},
            }
            if cfg.compare is not None:
                given = list(cfg.compare)
                variants["given"] = {"hosts": [h.name for h in lab.hosts], "split": given, "groups": None,
                                     "predicted": asdict(predict(shape, caps, given, link, work, even_groups,
                                                                 gateway=lab.hosts[0].name))}
            say(f"{s} session(s): plan {plan.split} over {', '.join(plan.hosts)}, {plan.prediction.groups} group(s)")
            level: dict[str, Any] = {"plan": plan.to_json(), "variants": {}}
            routes = {}
            for name, v in variants.items():
                extra = ("--pipeline-groups", str(v["groups"])) if v["groups"] else ()
                routes[name] = LabRoute(lab, model, v["split"], placement=v["hosts"], slices=len(v["split"]) > 1,
                                        memory_budget=False, max_sessions=max_s, ctx_per_session=ctx,
                                        backend=cfg.backend, extra_args=extra)
                level["variants"][name] = {"hosts": v["hosts"], "split": _ranges_text(v["split"]),
                                           "pipeline_groups": v["groups"] or "auto",
                                           "predicted_decode_tok_s": v["predicted"]["aggregate_tok_s"]
                                           if s > 1 else v["predicted"]["single_session_tok_s"],
                                           "predicted": v["predicted"], "runs": []}
            with contextlib.ExitStack() as stack, Pinned.on_host(lab, "h1"):
                for r in routes.values():
                    stack.enter_context(r)
                for r in routes.values():   # warm-up
                    measure(r.endpoints, [p.direct for p in r.placed], r.tls, n_prompt=16, n_gen=4, sessions=1,
                            seed=999)
                order = list(routes)
                for rep in range(cfg.repeats):
                    for name in (order if rep % 2 == 0 else order[::-1]):
                        r = routes[name]
                        say(f"{s} session(s), repeat {rep + 1}/{cfg.repeats}: {name}")
                        m = measure(r.endpoints, [p.direct for p in r.placed], r.tls, n_prompt=cfg.n_prompt,
                                    n_gen=cfg.n_gen, sessions=s, seed=rep * 100)
                        m["load_avg"] = os.getloadavg()[0]
                        level["variants"][name]["runs"].append(m)
            for name, v in level["variants"].items():
                got = [m["decode_tok_s"] for m in v["runs"]]
                v["decode_tok_s"] = got
                v["median_decode_tok_s"] = statistics.median(got)
                v["prediction_error"] = v["median_decode_tok_s"] / v["predicted_decode_tok_s"] - 1.0
            pv = level["variants"]
            level["ratios"] = {
                "planned_vs_even": [p["decode_tok_s"] / e["decode_tok_s"]
                                    for p, e in zip(pv["planned"]["runs"], pv["even"]["runs"])],
                "planned_vs_first_alone": [p["decode_tok_s"] / a["decode_tok_s"]
                                           for p, a in zip(pv["planned"]["runs"], pv["first_alone"]["runs"])],
            }
            if "given" in pv:
                level["ratios"]["planned_vs_given"] = [p["decode_tok_s"] / g["decode_tok_s"]
                                                       for p, g in zip(pv["planned"]["runs"], pv["given"]["runs"])]
                level["ratios"]["planned_vs_given_median"] = statistics.median(level["ratios"]["planned_vs_given"])
            level["ratios"]["planned_vs_even_median"] = statistics.median(level["ratios"]["planned_vs_even"])
            level["ratios"]["planned_vs_first_alone_median"] = statistics.median(
                level["ratios"]["planned_vs_first_alone"])
            doc["levels"][str(s)] = level
    doc["machine"]["load_avg_end"] = os.getloadavg()
    return doc


def summary(doc: dict[str, Any]) -> str:
    q = ", ".join("whole core" if x is None else f"{x:g} core" for x in doc["cpu_quota"])
    cpus = f", CPUs {' / '.join(doc['cpus'])}" if doc.get("cpus") else ""
    lines = [f"planned split vs even vs h1 alone on {doc['hosts']} lab hosts ({q}{cpus}); {doc['n_layer']} layers"]
    for s, lv in doc["levels"].items():
        lines.append(f"{s} session(s): plan {lv['plan']['split']} over {', '.join(lv['plan']['hosts'])}")
        for name, v in lv["variants"].items():
            runs = ", ".join(f"{x:.1f}" for x in v["decode_tok_s"])
            lines.append(f"  {name:<12} {v['split']:<14} measured {v['median_decode_tok_s']:7.1f} tok/s [{runs}]  "
                         f"predicted {v['predicted_decode_tok_s']:7.1f} ({100 * v['prediction_error']:+.0f} %)")
        r = lv["ratios"]
        lines.append(f"  planned/even {r['planned_vs_even_median']:.2f}x "
                     f"[{', '.join(f'{x:.2f}' for x in r['planned_vs_even'])}]; planned/h1 alone "
                     f"{r['planned_vs_first_alone_median']:.2f}x "
                     f"[{', '.join(f'{x:.2f}' for x in r['planned_vs_first_alone'])}]"
                     + (f"; planned/given {r['planned_vs_given_median']:.2f}x "
                        f"[{', '.join(f'{x:.2f}' for x in r['planned_vs_given'])}]" if "planned_vs_given" in r else ""))
    return "\n".join(lines)
