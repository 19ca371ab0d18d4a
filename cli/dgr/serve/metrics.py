"""The gateway's own Prometheus metrics (``GET /metrics``), with prometheus_client.

Requests by status, tokens in and out, time to first token, and the admission state (running,
queued), summed over the gateway's routes, then per route (``route`` label: route-1, ...): its
health, its requests running, queued and assigned. The workers' own metrics stay on the workers
(``dgr worker serve --metrics-port``).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily

disable_created_metrics()   # no *_created series: counters are read as rates


class _PerRoute:
    """Per-route gauges, read when scraped (a custom collector: the routes are fixed, their
    figures live on the routes)."""

    def __init__(self, routes: Any) -> None:
        self.routes = routes

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        fams = {
            "healthy": GaugeMetricFamily("dgr_gateway_route_healthy", "1 while the route passes its health "
                                         "check and takes requests", labels=["route", "model"]),
            "running": GaugeMetricFamily("dgr_gateway_route_running_requests", "Requests holding a session on "
                                         "the route", labels=["route", "model"]),
            "queued": GaugeMetricFamily("dgr_gateway_route_queued_requests", "Requests waiting for a slot of "
                                        "the route", labels=["route", "model"]),
            "assigned": GaugeMetricFamily("dgr_gateway_route_assigned_requests", "Requests given to the route "
                                          "and not yet answered", labels=["route", "model"]),
        }
        for rs in self.routes.routes:
            lab = [rs.name, rs.engine.model_id]
            fams["healthy"].add_metric(lab, 1.0 if rs.healthy else 0.0)
            fams["running"].add_metric(lab, rs.engine.admission.running)
            fams["queued"].add_metric(lab, rs.engine.admission.waiting)
            fams["assigned"].add_metric(lab, rs.assigned)
        yield from fams.values()


class GatewayMetrics:
    def __init__(self, routes: Any) -> None:
        """``routes``: the gateway's :class:`~dgr.serve.pool.Routes`."""
        engines = [rs.engine for rs in routes.routes]
        self.registry = r = CollectorRegistry()
        self.requests = Counter("dgr_gateway_requests", "HTTP generation requests by final status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("dgr_gateway_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("dgr_gateway_completion_tokens", "Tokens generated for finished requests",
                                         registry=r)
        self.ttft = Histogram("dgr_gateway_time_to_first_token_seconds", "Request handling start (before prompt formatting) to the route's first token",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        running = Gauge("dgr_gateway_running_requests", "Requests holding a route session", registry=r)
        running.set_function(lambda: sum(e.admission.running for e in engines))
        queued = Gauge("dgr_gateway_queued_requests", "Requests waiting for a session slot", registry=r)
        queued.set_function(lambda: sum(e.admission.waiting for e in engines))
        self.in_flight = Gauge("dgr_gateway_in_flight_requests", "Generation requests being answered", registry=r)
        # with standby workers (dgr serve --standby): how often a shard failed under requests
        failovers = Gauge("dgr_gateway_failovers", "Routes formed after a shard failed (0 without standbys)",
                          registry=r)
        failovers.set_function(lambda: sum(e.failovers for e in engines))
        restarts = Gauge("dgr_gateway_restarted_requests", "Requests restarted on a new route after a shard "
                         "failed (0 without standbys)", registry=r)
        restarts.set_function(lambda: sum(getattr(e, "restarts", 0) for e in engines))
        r.register(_PerRoute(routes))

    def started(self) -> None:
        self.in_flight.inc()

    def finished(self, gen: Any, status: int) -> None:
        """A started request's end (``gen``: its generation, None when it was refused before one)."""
        self.in_flight.dec()
        self.requests.labels(status=str(status)).inc()
        if gen is None:
            return
        self.prompt_tokens.inc(gen.usage.prompt_tokens)
        self.completion_tokens.inc(gen.usage.completion_tokens)
        if gen.ttft_s is not None:
            self.ttft.observe(gen.ttft_s)

    def refused(self, status: int) -> None:
        """A request refused before it started (its body did not parse or validate)."""
        self.requests.labels(status=str(status)).inc()

    def render(self) -> str:
        return generate_latest(self.registry).decode()
