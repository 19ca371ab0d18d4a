"""Placement for the Tracker: which contiguous layer range each host should serve so that every
host's worker admits its range under its memory budget. The figure is the worker's own
(``dgr-worker plan-memory``, :func:`dgr.route.memory_plan.plan_memory`): the same need that
the worker's admission refuses before loading, so a split chosen here is one the workers start.

An even split is taken when every host admits its part (balanced compute); otherwise hosts are
filled in order, each with the longest range its budget admits (a binary search over the range
end: the need grows with every layer, and by the output matrix at the tail)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from dgr.errors import DgrError
from dgr.route.memory_plan import MIB, MemoryPlan, plan_memory

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostBudget:
    """A host that may serve a range: its name and the ``--memory-budget-mb`` its worker gets."""
    name: str
    memory_budget_mb: float


@dataclass(frozen=True)
class Placement:
    host: str
    start: int
    end: int
    need_bytes: int     # what the worker's admission holds against the budget
    budget_bytes: int


Planner = Callable[[tuple[int, int], float], MemoryPlan]


def plan_split(model: Path, hosts: Sequence[HostBudget], *, n_layer: int, max_sessions: int = 16,
               ctx_per_session: int = 2048, kv_unified: bool = False,
               planner: Planner | None = None) -> list[Placement]:
    """Ranges ``[0, a), [a, b), …, [z, n_layer)`` for (a prefix of) ``hosts``, each admitted by
    its host's budget; DgrError naming the host and the need when no split fits."""
    if not hosts:
        raise DgrError("no hosts to place the model on")
    cache: dict[tuple[tuple[int, int], float], MemoryPlan] = {}

    def plan(rng: tuple[int, int], budget_mb: float) -> MemoryPlan:
        key = (rng, budget_mb)
        if key not in cache:
            cache[key] = (planner(rng, budget_mb) if planner else
                          plan_memory(model, rng, max_sessions=max_sessions, ctx_per_session=ctx_per_session,
                                      kv_unified=kv_unified, memory_budget_mb=budget_mb))
        return cache[key]

    def placed(h: HostBudget, a: int, b: int) -> Placement:
        p = plan((a, b), h.memory_budget_mb)
        return Placement(h.name, a, b, p.shard_bytes, int(h.memory_budget_mb * MIB))

    # 1. an even split over every host, when each admits its part
    k = min(len(hosts), n_layer)
    cuts = [round(i * n_layer / k) for i in range(k + 1)]
    if all(plan((cuts[i], cuts[i + 1]), hosts[i].memory_budget_mb).fits for i in range(k)):
        return [placed(hosts[i], cuts[i], cuts[i + 1]) for i in range(k)]
    # 2. fill hosts in order, each with the longest range it admits
    out: list[Placement] = []
    pos = 0
    for h in hosts:
        if pos == n_layer:
            break
        if not plan((pos, pos + 1), h.memory_budget_mb).fits:
            _log.info("host %s admits no layer from %d: %s", h.name, pos, plan((pos, pos + 1), h.memory_budget_mb).refusal)
            continue
        lo, hi = pos + 1, n_layer  # lo fits; find the largest end that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if plan((pos, mid), h.memory_budget_mb).fits:
                lo = mid
            else:
                hi = mid - 1
        out.append(placed(h, pos, lo))
        pos = lo
    if pos < n_layer:
        held = ", ".join(f"{p.host} [{p.start}, {p.end})" for p in out) or "nothing"
        last = plan((pos, min(pos + 1, n_layer)), hosts[-1].memory_budget_mb)
        raise DgrError(f"the hosts' memory budgets hold {held} of the model's {n_layer} layers; layers "
                       f"[{pos}, {n_layer}) fit nowhere (one more layer alone needs "
                       f"{last.shard_bytes / MIB:.1f} MiB): add hosts or memory, or lower --max-sessions "
                       f"{max_sessions} / --ctx-per-session {ctx_per_session}")
    return out
