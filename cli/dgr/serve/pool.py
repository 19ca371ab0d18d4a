"""Several routes behind one gateway: which route a request runs on, and which routes are up.

A gateway serves one or more routes (:class:`~dgr.serve.engine.Engine`, one per route), each
under a model id; routes with the same model id are replicas of one model (the same artifact,
whatever their splits). A request names its model; :meth:`Routes.pick` gives it the route of
that model with the most room: the most free session slots once the requests already assigned
to it are counted (running, queued, or still being tokenized), then the fewest queued, then the
one picked longest ago (so that equal routes take turns).

Health: every :data:`HEALTH_INTERVAL_S` each route's shards are asked the gRPC health check.
A route with a shard that does not answer ``SERVING`` is taken out: new requests go to the
other routes of its model. It is put back as soon as every shard answers ``SERVING`` again.
When every route of a model is out, requests still go to the one with the most room, and fail
there with the route's own error (502), as a gateway of one route does; the gateway never
refuses a request on a health guess alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from .engine import GatewayError

if TYPE_CHECKING:
    from .engine import Engine

_log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0      # between two health rounds
HEALTH_TIMEOUT_S = 1.5       # one shard's health check


@dataclass
class RouteState:
    """The gateway's bookkeeping of one route (the engine holds the route itself)."""

    name: str                        # "route-1", ... in the order given
    engine: "Engine"
    healthy: bool = True
    reason: str = ""                 # why it is out (empty while healthy)
    assigned: int = 0                # requests on this route now (from pick to the answer's end)
    picked: int = 0                  # requests ever given to it
    last_pick: int = 0               # pick order (ties go to the route picked longest ago)
    changed_s: float = 0.0           # time.time() of the last health change (0: never)

    @property
    def room(self) -> int:
        """Free session slots once the requests assigned to it are counted."""
        return self.engine.admission.slots - self.assigned


class Routes:
    """Every route of the gateway, by model id."""

    def __init__(self, engines: Sequence["Engine"]) -> None:
        if not engines:
            raise ValueError("a gateway serves at least one route")
        self.routes = [RouteState(f"route-{i + 1}", e) for i, e in enumerate(engines)]
        self.by_model: dict[str, list[RouteState]] = {}
        for r in self.routes:
            self.by_model.setdefault(r.engine.model_id, []).append(r)
        self._picks = 0
        self._health: asyncio.Task[None] | None = None

    @property
    def first(self) -> "Engine":
        return self.routes[0].engine

    @property
    def models(self) -> list[str]:
        return list(self.by_model)

    def state(self, engine: "Engine") -> RouteState:
        return next(r for r in self.routes if r.engine is engine)

    def of_model(self, model: str) -> list[RouteState]:
        """The routes serving ``model``; 404 (OpenAI's model_not_found) when none does."""
        got = self.by_model.get(model)
        if got is None:
            served = ", ".join(repr(m) for m in self.by_model)
            raise GatewayError(404, f"the model {ascii(model)} does not exist; this gateway serves {served}",
                               code="model_not_found", param="model")
        return got

    def pick(self, model: str) -> RouteState:
        """The route a new request of ``model`` runs on (see the module's docstring). The
        caller counts its request there with :meth:`take`."""
        cands = self.of_model(model)
        up = [r for r in cands if r.healthy] or cands
        return max(up, key=lambda r: (r.room, -r.engine.admission.waiting, -r.last_pick))

    def take(self, route: RouteState) -> RouteState:
        """Counts a request on ``route`` from now until :meth:`give_back`."""
        self._picks += 1
        route.picked += 1
        route.last_pick = self._picks
        route.assigned += 1
        return route

    @staticmethod
    def give_back(route: RouteState) -> None:
        route.assigned -= 1

    # -- health -------------------------------------------------------------------------
    async def check(self, route: RouteState) -> None:
        """One health round of one route: every shard of the route it runs on now."""
        shards = list(route.engine.driver.shards)

        async def one(sh: Any) -> str:
            try:
                status = await sh.client.health(timeout=HEALTH_TIMEOUT_S)
            except Exception as exc:   # noqa: BLE001 - any failure to answer is "not serving"
                return f"{sh.endpoint}: {getattr(exc, 'details', None) or type(exc).__name__}"
            return "" if status == "SERVING" else f"{sh.endpoint}: {status}"

        bad = [b for b in await asyncio.gather(*(one(s) for s in shards)) if b]
        healthy = not bad
        if healthy != route.healthy:
            route.changed_s = time.time()
            if healthy:
                _log.warning("%s (%s) is healthy again: back in service", route.name, route.engine.model_id)
            else:
                _log.warning("%s (%s) failed its health check, taken out: %s", route.name, route.engine.model_id,
                             "; ".join(bad))
        route.healthy, route.reason = healthy, "; ".join(bad)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.routes))

    async def _watch(self, interval: float) -> None:
        while True:
            try:
                await self.check_all()
            except Exception as exc:   # noqa: BLE001 - the watch must outlive any one round
                _log.error("health round failed: %s", exc, exc_info=exc)
            await asyncio.sleep(interval)

    def start_health(self, interval: float = HEALTH_INTERVAL_S) -> None:
        """Health rounds in the background (only with several routes: one route has no other
        to send requests to)."""
        if len(self.routes) > 1 and self._health is None:
            self._health = asyncio.ensure_future(self._watch(interval))

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(BaseException):
                await self._health
            self._health = None
        errors = await asyncio.gather(*(r.engine.close() for r in self.routes), return_exceptions=True)
        for e in errors:
            if isinstance(e, BaseException):
                _log.warning("closing a route: %s", e)

    def view(self) -> list[dict[str, Any]]:
        """Each route's state for /health and the console."""
        out = []
        for r in self.routes:
            e = r.engine
            d: dict[str, Any] = {"name": r.name, "model": e.model_id, "healthy": r.healthy,
                                 "route": list(e.driver.endpoints), "running": e.admission.running,
                                 "queued": e.admission.waiting, "slots": e.admission.slots,
                                 "assigned": r.assigned, "requests": r.picked}
            if r.reason:
                d["reason"] = r.reason
            if e.router is not None:
                d["failovers"] = e.failovers
                d["failed_shards"] = sorted(e.router.failed)
            out.append(d)
        return out
