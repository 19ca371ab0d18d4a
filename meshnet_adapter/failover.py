"""The Tracker side of failover: a route finder over the Coverage Map.

``dgr.route.failover.FailoverRouter`` restarts a session from token zero on a new route when a
Shard fails; it asks a *route finder* for that route. :class:`TrackerRouteFinder` answers from
the Tracker's registrations (:mod:`meshnet_adapter.registration`) with the same rules as every
other route the Tracker forms (:func:`meshnet_adapter.routing.form_routes`: complete,
contiguous, one fingerprint, certified recipe, free capacity), minus the failed Shards, and
prefers the route that keeps most of the session's current Shards. When none forms, the
``NoRoute`` reasons become a :class:`~dgr.route.failover.NoRouteError` whose ``kind`` is
``capacity``, ``recipe_mismatch`` (another fingerprint, or a dark recipe), ``no_standby`` (a layer
range nobody else serves) or ``unreachable`` (nothing registered).

    finder = TrackerRouteFinder(lambda: tracker.coverage(), artifact_id)
    router = await FailoverRouter(first_route_endpoints, finder).connect()
    result = await router.generate(prompt_tokens, max_tokens=64)

:func:`coverage_from_nodes` builds the coverage callable for workers that already run (it reads
each worker's capability and load, as ``python -m meshnet_adapter.coverage`` does).
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Awaitable, Callable, Iterable, Sequence, Union

from dgr.route.failover import NoRouteError
from dgr.route.planner import ModelShape, Workload

from .registration import ShardRegistration
from .routing import NoRoute, form_routes

Coverage = Callable[[], Union[Iterable[ShardRegistration], Awaitable[Iterable[ShardRegistration]]]]


def no_route_kind(reasons: Sequence[str]) -> str:
    text = " ".join(reasons)
    if "no free session capacity" in text:
        return "capacity"
    if "incompatible recipe fingerprints" in text or "dark (uncertified)" in text:
        return "recipe_mismatch"
    if "not covered" in text or "do not chain" in text:
        return "no_standby"
    return "unreachable"


class TrackerRouteFinder:
    """``model`` / ``workload``: passed to :func:`form_routes`, so that among the routes that keep
    as many of the session's Shards, the one the cost model predicts fastest is taken (when every
    candidate's Shards are measured; else the fewest Shards, as without them)."""

    def __init__(self, coverage: Coverage, artifact_id: str, *, model: ModelShape | None = None,
                 workload: Workload | None = None) -> None:
        self.coverage = coverage
        self.artifact_id = artifact_id
        self.model = model
        self.workload = workload

    async def find(self, exclude: set[str], prefer: Sequence[str]) -> list[str]:
        regs = self.coverage()
        if inspect.isawaitable(regs):
            regs = await regs
        usable = [r for r in regs if r.endpoint not in exclude]
        routes = form_routes(usable, self.artifact_id, model=self.model, workload=self.workload)
        if isinstance(routes, NoRoute):
            why = list(routes.reasons)
            if exclude:
                why.append("failed: " + ", ".join(sorted(exclude)))
            raise NoRouteError(no_route_kind(routes.reasons), "; ".join(why))
        keep = set(prefer)
        best = max(routes, key=lambda r: sum(s.endpoint in keep for s in r.shards))   # first of the best
        return [s.endpoint for s in best.shards]


def coverage_from_nodes(nodes: list[tuple[str, str]], model: Path, *, backend: str = "cpu", tls=None,
                        timeout: float = 1.0) -> Coverage:
    """A coverage callable over running workers (``(node_id, endpoint)`` pairs serving ``model``):
    each call re-reads their capability and load; unreachable or foreign workers are left out."""
    from .coverage import register

    async def cov() -> list[ShardRegistration]:
        regs, _refused = await asyncio.to_thread(register, nodes, model, backend=backend, tls=tls, timeout=timeout)
        return regs
    return cov
