"""``--split auto``: the hosts measure themselves, the planner chooses the split.

Two placements use it:

- **a lab** (``dgr lab route``, ``dgr serve --lab``): each lab host runs the worker's probe in
  its own namespace on its own threads; the planner (:func:`dgr.route.planner.plan_route`)
  chooses the hosts, their order, the layer ranges and the head's pipeline groups for the
  workload, and may leave out a host that would slow the route (it says why);
- **this machine** (``dgr route run``, ``dgr serve`` with local workers): one probe, one host.
  Local workers share this machine's cores and memory, so a split adds hops and no capacity:
  the planner keeps the model whole when it fits the memory this machine has, and refuses it
  (with the figures) when it does not, since no split on one machine would hold it either.

Each returns an :class:`AutoSplit`: the ranges, the placement (lab host names, or None), the
pipeline groups, and the plan as JSON (what ``dgr plan --json`` prints).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DgrError

_log = logging.getLogger(__name__)

PROBE_BUDGET_S = 5.0


@dataclass
class AutoSplit:
    ranges: list[tuple[int, int]]
    placement: list[str] | None      # lab host of each range (None: local workers)
    groups: int                      # the head's pipeline groups (1: no pipelining)
    plan: dict[str, Any]             # the planner's JSON

    @property
    def split(self) -> str:
        return ",".join(f"{a}:{b}" for a, b in self.ranges)

    def worker_args(self) -> tuple[str, ...]:
        """The head's extra worker arguments (its pipeline groups; none on a single worker)."""
        return ("--pipeline-groups", str(self.groups)) if len(self.ranges) > 1 else ()

    def describe(self, sessions: int) -> list[str]:
        """Lines for the user: the plan, its prediction, and every host it left out."""
        where = f" over {', '.join(self.placement)}" if self.placement else " on this machine"
        out = [f"plan: {self.split}{where}, {self.groups} pipeline group(s); predicted "
               f"{self.plan['prediction']['aggregate_tok_s']:.1f} tok/s at {sessions} session(s)"]
        out += [f"plan leaves out {d['host']}: {d['why']}" for d in self.plan.get("dropped", [])]
        return out


def _ranges(plan: Any) -> list[tuple[int, int]]:
    return [tuple(map(int, r.split(":"))) for r in plan.split.split(",")]   # type: ignore[misc]


def plan_lab(lab: Any, src: Path, sessions: int, *, budget: bool = True) -> AutoSplit:
    """Each lab host's probe (in its namespace, on its threads), then the plan for ``sessions``
    concurrent sessions over the lab's link shaping."""
    from .planner import Link, Workload, model_shape, plan_route
    from .probe import capability_from_probe, capability_of, default_probe_range, host_memory_bytes, run_probe

    shape = model_shape(src)
    caps = []
    for h in lab.hosts:
        _log.info("probe on %s (%s thread(s))", h.name, h.threads)
        raw = run_probe(src, default_probe_range(shape.n_layer), threads=h.threads, prefix=lab.prefix(h),
                        budget_s=PROBE_BUDGET_S)
        mem = host_memory_bytes(raw, (h.worker_budget_mb if budget else None))
        caps.append(capability_of(capability_from_probe(raw, shape, name=h.name, memory_bytes=mem)))
    shaping = lab.shaping or {}
    rtt_ms = float(shaping.get("rtt_ms") or 0.0)
    rate = float(shaping.get("rate_mbit") or 0.0)
    link = Link(rtt_s=max(rtt_ms, 0.2) / 1e3, bandwidth_bytes_s=(rate or 10000.0) * 1e6 / 8)
    p = plan_route(shape, caps, link, Workload(sessions=sessions, prompt_tokens=64, ctx_per_session=2048))
    return AutoSplit(_ranges(p), list(p.hosts), p.prediction.groups, p.to_json())


def plan_local(src: Path, sessions: int, *, threads: int | None = None, ctx_per_session: int = 2048) -> AutoSplit:
    """This machine's probe, then the plan for one host (see the module's docstring)."""
    from .planner import Link, Workload, model_shape, plan_route
    from .probe import capability_from_probe, capability_of, default_probe_range, host_memory_bytes, run_probe

    shape = model_shape(src)
    _log.info("probe on this machine (%s thread(s), up to %g s)", threads or "all", PROBE_BUDGET_S)
    raw = run_probe(src, default_probe_range(shape.n_layer), threads=threads, budget_s=PROBE_BUDGET_S)
    cap = capability_of(capability_from_probe(raw, shape, name="local", memory_bytes=host_memory_bytes(raw, None)))
    try:
        p = plan_route(shape, [cap], Link(), Workload(sessions=sessions, prompt_tokens=64,
                                                       ctx_per_session=ctx_per_session))
    except DgrError as exc:
        raise DgrError(f"--split auto: {exc.one_line()}",
                       hint="local workers share this machine's memory, so no split of them holds more; "
                            "run the shards on several machines (docs/multi-host.md)") from None
    return AutoSplit(_ranges(p), None, p.prediction.groups, p.to_json())
