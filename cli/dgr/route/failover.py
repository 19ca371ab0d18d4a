"""Failover: a Route Session that loses a Shard restarts from token zero on a new route.

:class:`FailoverRouter` runs sessions like :class:`~dgr.route.driver.RouteDriver` and, when a
Shard fails mid-generation, asks a :class:`RouteFinder` for a new compatible route without the
failed Shard (a standby worker for that range, or another host serving it) and restarts the
session there: the prompt plus every token already delivered is prefilled again (the KV state is
recomputed, never copied), and generation continues with the remaining token budget. The client
(``on_token``) receives each token once: the tokens delivered before the failure are not sent
again and the restarted session only emits what follows them.

- **Greedy** sampling: the answer equals an uninterrupted run (the new route computes the same
  next token from the same context).
- **Seeded** sampling: the worker seeds the session's sampler when the session opens, so the
  restarted session draws from the seed again at the restart position. The tokens before the
  failure are kept; the tokens after it are reproducible for the same failure point but are not
  the tokens an uninterrupted run would have drawn.

Which failures restart: a Shard that is unreachable, closed its stream, missed its deadline or
keepalive, or reported an internal fault or shutdown (``UNAVAILABLE``) is excluded and the session
moves to a route without it; a Shard that lost the session's state (``CACHE_MISS``,
``UNKNOWN_SESSION``, ``SESSION_RELEASED``, ``STALE_EPOCH``, ``POSITION_GAP``, ``STEP_OUT_OF_ORDER``)
stays and the session restarts (new epoch) on the same route. A request error (bad token, bad
sampling, chunk too large, …) or a cancel is never retried. At most ``max_restarts`` restarts
per session; when no route can be formed the session fails with :class:`NoRouteError`, whose
``kind`` says why: ``no_standby`` (a range nobody else serves), ``recipe_mismatch`` (only
workers of another compatibility fingerprint serve it), ``capacity`` (the only candidates have
no free session slot) or ``unreachable``.

The route finder is pluggable: :class:`PoolRouteFinder` forms routes from a list of worker
endpoints (the route plus its standbys) by their capabilities; ``meshnet_adapter.failover`` forms
them from the Tracker's registrations.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol, Sequence

from ..errors import DgrError
from ..protocol.client import AsyncWorkerClient, WorkerError
from ..protocol.errors import Reason
from ..shard.v1 import shard_runtime_pb2 as pb
from .driver import GenerationResult, RouteDriver, RouteSessionError, Sampling, ShardUnreachable
from .work_records import AttemptRecord, SessionWorkRecord, ShardWork

log = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 2
PROBE_TIMEOUT_S = 1.0
# new routes formed in a row when a chosen worker stops answering between the finder's probe and
# the route's connect (each try excludes it)
CONNECT_TRIES = 3

# the Shard is gone (or its link): exclude it and move the session to another route
SHARD_LOST = frozenset({Reason.UNAVAILABLE, Reason.PEER_SILENT, Reason.KEEPALIVE, Reason.DEADLINE_EXCEEDED,
                        Reason.STREAM_CLOSED, Reason.INTERNAL, Reason.UNKNOWN, Reason.ABORTED, Reason.CANCELLED})
# the Shard is alive but lost the session's state: restart on the same route
STATE_LOST = frozenset({Reason.CACHE_MISS, Reason.UNKNOWN_SESSION, Reason.SESSION_RELEASED, Reason.STALE_EPOCH,
                        Reason.POSITION_GAP, Reason.STEP_OUT_OF_ORDER})


class NoRouteError(DgrError):
    """No compatible route without the failed Shards. ``kind``: no_standby, recipe_mismatch,
    capacity, unreachable (the first reason that applies to the first uncovered range)."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(f"no route ({kind}): {message}")


class RouteFinder(Protocol):
    async def find(self, exclude: set[str], prefer: Sequence[str]) -> list[str]:
        """Endpoints of a complete compatible route that uses none of ``exclude``, preferring the
        endpoints in ``prefer`` (the current route); raises :class:`NoRouteError`."""
        ...


def classify(exc: RouteSessionError) -> str:
    """``shard_lost``, ``state_lost`` or ``fatal`` (never retried)."""
    if exc.reason in STATE_LOST:
        return "state_lost"
    if exc.reason in SHARD_LOST:
        return "shard_lost"
    return "fatal"


@dataclass
class Candidate:
    endpoint: str
    start: int
    end: int
    n_layer: int
    fingerprint: str
    artifact_id: str
    free_sessions: int


class PoolRouteFinder:
    """Forms routes from a pool of worker endpoints (the original route and its standbys): probes
    each one's capability and load (``PROBE_TIMEOUT_S``), keeps those with the route's
    fingerprint and artifact and a free session slot, and chains them from layer 0 to the last,
    preferring the current route's workers, then longer ranges, then more free slots."""

    def __init__(self, endpoints: Sequence[str], *, fingerprint: str, artifact_id: str,
                 tls=None, need_sessions: int = 1) -> None:
        self.endpoints = list(dict.fromkeys(endpoints))
        self.fingerprint, self.artifact_id = fingerprint, artifact_id
        self.tls = tls
        self.need_sessions = need_sessions

    async def _probe(self, ep: str) -> Candidate | str:
        creds = self.tls.grpc_credentials() if self.tls else None
        c = AsyncWorkerClient(ep, timeout=PROBE_TIMEOUT_S, credentials=creds)
        try:
            cap = await c.capability()
            load = (await c.metrics()).load
        except WorkerError as exc:
            return f"{ep}: unreachable ({exc.code.name})"
        except Exception as exc:   # noqa: BLE001  (a probe never raises: it reports)
            return f"{ep}: unreachable ({exc})"
        finally:
            await c.close()
        i = cap.identity
        return Candidate(ep, i.range.start, i.range.end, i.n_layer, i.compatibility_fingerprint, i.artifact_id,
                         max(0, cap.capacity.max_sessions - load.active_sessions))

    async def find(self, exclude: set[str], prefer: Sequence[str]) -> list[str]:
        eps = [e for e in self.endpoints if e not in exclude]
        probed = await asyncio.gather(*(self._probe(e) for e in eps))
        unreachable = [p for p in probed if isinstance(p, str)]
        cands = [p for p in probed if isinstance(p, Candidate)]
        same = [c for c in cands if c.fingerprint == self.fingerprint and c.artifact_id == self.artifact_id]
        other = [c for c in cands if c not in same]
        usable = [c for c in same if c.free_sessions >= self.need_sessions]
        n_layer = same[0].n_layer if same else (cands[0].n_layer if cands else 0)
        chain = _chain(usable, n_layer, prefer)
        if chain:
            return [c.endpoint for c in chain]
        # why not: the first range not covered by usable candidates
        gap = _first_gap(usable, n_layer)
        a, b = gap if gap else (0, n_layer)
        covers = lambda c: c.start <= a < c.end   # noqa: E731
        if any(covers(c) for c in same):
            full = ", ".join(f"{c.endpoint}[{c.start}:{c.end})" for c in same if covers(c))
            raise NoRouteError("capacity", f"layers [{a}:{b}) are served only by workers with no free session "
                               f"slot: {full}")
        if any(covers(c) for c in other):
            mism = ", ".join(f"{c.endpoint}[{c.start}:{c.end}) fingerprint {c.fingerprint[:12]}"
                             for c in other if covers(c))
            raise NoRouteError("recipe_mismatch", f"layers [{a}:{b}) are served only by workers of another "
                               f"recipe than the route's {self.fingerprint[:12]}: {mism}")
        if unreachable and not cands:
            raise NoRouteError("unreachable", "no standby answers: " + "; ".join(unreachable))
        excluded = ", ".join(sorted(exclude)) or "none"
        raise NoRouteError("no_standby", f"no standby worker serves layers [{a}:{b}) (failed: {excluded}"
                           + (f"; unreachable: {'; '.join(unreachable)}" if unreachable else "") + ")")


def _chain(cands: list[Candidate], n_layer: int, prefer: Sequence[str]) -> list[Candidate] | None:
    if n_layer <= 0:
        return None
    rank = {e: i for i, e in enumerate(prefer)}
    by_start: dict[int, list[Candidate]] = {}
    for c in cands:
        by_start.setdefault(c.start, []).append(c)
    for lst in by_start.values():
        lst.sort(key=lambda c: (c.endpoint not in rank, -(c.end - c.start), -c.free_sessions, c.endpoint))

    def walk(pos: int, acc: list[Candidate], depth: int) -> list[Candidate] | None:
        if pos == n_layer:
            return acc
        if depth > len(cands):
            return None
        for c in by_start.get(pos, []):
            r = walk(c.end, acc + [c], depth + 1)
            if r:
                return r
        return None

    return walk(0, [], 0)


def _first_gap(cands: list[Candidate], n_layer: int) -> tuple[int, int] | None:
    reach, pos = {0}, 0
    frontier = [0]
    while frontier:   # every layer boundary reachable from 0 by chaining
        p = frontier.pop()
        for c in cands:
            if c.start == p and c.end not in reach:
                reach.add(c.end)
                frontier.append(c.end)
    if n_layer in reach:
        return None
    pos = max(reach)
    nxt = min((c.start for c in cands if c.start > pos), default=n_layer)
    return (pos, nxt)


@dataclass
class FailoverResult:
    """One session as the client saw it, over every attempt."""
    session_id: str
    prompt_tokens: list[int]
    tokens: list[int]                     # delivered tokens, in order, each once
    finish_reason: str
    record: SessionWorkRecord
    error: DgrError | None = None
    results: tuple[GenerationResult, ...] = ()
    failure_at: float | None = None       # monotonic time the first failure was seen (detection)
    first_new_token_at: float | None = None   # monotonic time of the first token on the new route


class FailoverRouter:
    """Sessions over a route that fail over to a new route (see the module docstring).

    ``finder`` forms new routes; ``endpoints`` is the first route. Drivers for the routes formed
    are kept open (sessions share them) until :meth:`close`."""

    def __init__(self, endpoints: Sequence[str], finder: RouteFinder | None = None, *,
                 max_restarts: int = DEFAULT_MAX_RESTARTS, timeout: float = 60.0, chain: bool | None = None,
                 tokens_per_answer: int | None = None, tls=None,
                 on_event: Callable[[str, dict], None] | None = None) -> None:
        if max_restarts < 0:
            raise DgrError(f"max_restarts must be >= 0, got {max_restarts}")
        self.endpoints = list(endpoints)
        self.finder = finder
        self.max_restarts = max_restarts
        self.driver_kw = {"timeout": timeout, "chain": chain, "tls": tls}
        if tokens_per_answer is not None:
            self.driver_kw["tokens_per_answer"] = tokens_per_answer
        self.failed: dict[str, str] = {}          # endpoint -> why it was excluded
        self.route: RouteDriver | None = None
        self.drivers: list[RouteDriver] = []
        self.routes: list[list[str]] = []         # every route used, in order
        self._lock = asyncio.Lock()
        self.on_event = on_event or (lambda _k, _d: None)
        self._current: dict[str, tuple[RouteDriver, str, int]] = {}   # session -> its running attempt
        self._cancel: set[str] = set()

    async def connect(self) -> "FailoverRouter":
        self.route = await RouteDriver(self.endpoints, **self.driver_kw).connect()
        self.drivers.append(self.route)
        self.routes.append(list(self.endpoints))
        if self.finder is None:
            self.finder = PoolRouteFinder(self.endpoints, fingerprint=self.route.fingerprint,
                                          artifact_id=self.route.head.capability.identity.artifact_id,
                                          tls=self.driver_kw.get("tls"))
        return self

    async def close(self) -> None:
        for d in self.drivers:
            await d.close()

    async def _reroute(self, used: RouteDriver, exc: RouteSessionError) -> RouteDriver:
        async with self._lock:
            if exc.shard_endpoint not in self.failed:
                self.failed[exc.shard_endpoint] = f"{exc.reason}: {exc.detail}"
                self.on_event("shard_failed", {"endpoint": exc.shard_endpoint, "reason": str(exc.reason)})
            assert self.route is not None
            if not any(ep in self.failed for ep in self.route.endpoints):
                return self.route          # another session formed a route without it already
            assert self.finder is not None
            for _ in range(CONNECT_TRIES):
                eps = await self.finder.find(set(self.failed), self.route.endpoints)
                d = RouteDriver(eps, **self.driver_kw)
                try:
                    await d.connect()
                    break
                except ShardUnreachable as gone:
                    # it answered the finder's probe, then not the connect: it ended in between
                    await d.close()
                    self.failed[gone.endpoint] = f"unreachable when the new route connected: {gone}"
                    self.on_event("shard_failed", {"endpoint": gone.endpoint, "reason": "unreachable"})
                except BaseException:
                    await d.close()
                    raise
            else:
                raise NoRouteError("unreachable", f"{CONNECT_TRIES} new routes in a row had a worker that "
                                   f"stopped answering before the route connected (failed: {sorted(self.failed)})")
            self.drivers.append(d)
            self.routes.append(eps)
            self.route = d
            self.on_event("route_formed", {"route": eps})
            log.info("failover: new route %s (failed: %s)", eps, sorted(self.failed))
            return d

    async def cancel(self, session_id: str) -> list[bool]:
        """Cancels a session wherever it runs now (its current attempt, on every Shard of that
        route); it is not restarted afterwards. Returns per Shard whether it held anything."""
        self._cancel.add(session_id)
        cur = self._current.get(session_id)
        if cur is None:
            return []
        d, asid, ep = cur
        return await d.cancel(asid, ep)

    async def generate(self, prompt_tokens: Sequence[int], *, max_tokens: int = 32,
                       sampling: Sampling = Sampling(), session_id: str | None = None, epoch: int = 1,
                       on_token: Callable[[int], Awaitable[None] | None] | None = None,
                       stop_on_eog: bool = True,
                       on_sampled: Callable[[pb.SampledToken], None] | None = None) -> FailoverResult:
        assert self.route is not None, "connect() first"
        sid = session_id or f"s-{uuid.uuid4().hex[:12]}"
        rec = SessionWorkRecord(sid, f"r-{uuid.uuid4().hex[:12]}", "failed", len(prompt_tokens))
        delivered: list[int] = []
        results: list[GenerationResult] = []
        out = FailoverResult(sid, list(prompt_tokens), delivered, "error", rec)
        driver = self.route
        attempt = 0

        async def tok(t: int) -> None:
            if out.failure_at is not None and out.first_new_token_at is None:
                out.first_new_token_at = time.monotonic()
            delivered.append(t)
            if on_token is not None:
                r = on_token(t)
                if asyncio.iscoroutine(r):
                    await r

        while True:
            before = len(delivered)
            ctx = list(prompt_tokens) + delivered
            asid = sid if attempt == 0 else f"{sid}~r{attempt}"
            t0 = time.monotonic()
            self._current[sid] = (driver, asid, epoch + attempt)
            try:
                res = await driver.generate(ctx, max_tokens=max_tokens - before, sampling=sampling, session_id=asid,
                                            epoch=epoch + attempt, on_token=tok, stop_on_eog=stop_on_eog,
                                            on_sampled=on_sampled)
            finally:
                self._current.pop(sid, None)
            results.append(res)
            a = AttemptRecord(attempt, asid, epoch + attempt, list(driver.endpoints), "completed", len(ctx), before,
                              len(delivered) - before, ttft_s=res.telemetry.ttft_s, total_s=time.monotonic() - t0)
            rec.attempts.append(a)
            exc = res.error
            a.shards = self._shard_work(driver, res, a, exc)
            if exc is None:
                rec.status, out.finish_reason = "completed", res.finish_reason
                break
            a.error, a.failed_shard = str(exc), exc.shard_endpoint
            kind = classify(exc)
            if sid in self._cancel and res.telemetry.status != "cancelled":
                res.telemetry.status = "cancelled"    # cancelled while the attempt was failing
            if res.telemetry.status == "cancelled" or kind == "fatal":
                a.status = rec.status = "cancelled" if res.telemetry.status == "cancelled" else "failed"
                rec.error, out.error = str(exc), exc
                break
            if out.failure_at is None:
                out.failure_at = time.monotonic()
            a.status = "restarted"
            if len(delivered) >= max_tokens:      # the answer was complete when the route failed
                a.status = rec.status = "completed"
                out.finish_reason = "length"
                break
            if attempt >= self.max_restarts:
                a.status = "failed"
                rec.error = f"gave up after {attempt} restart(s): {exc}"
                out.error = DgrError(rec.error)
                break
            try:
                if kind == "shard_lost":
                    driver = await self._reroute(driver, exc)
            except (NoRouteError, DgrError) as nr:
                a.status = "failed"
                rec.error = f"{exc}; {nr}"
                out.error = nr
                break
            attempt += 1
            rec.restarts = attempt
            self.on_event("restart", {"session": sid, "attempt": attempt, "delivered": len(delivered),
                                      "route": list(driver.endpoints)})
        self._cancel.discard(sid)
        rec.delivered_tokens = len(delivered)
        rec.recomputed_tokens = sum(a.recomputed_tokens for a in rec.attempts)
        out.results = tuple(results)
        results[-1].telemetry.work = rec.to_json()     # exported with the session's telemetry
        return out

    @staticmethod
    def _shard_work(driver: RouteDriver, res: GenerationResult, a: AttemptRecord,
                    exc: RouteSessionError | None) -> list[ShardWork]:
        busy = {n.node: n.busy_s for n in res.telemetry.nodes}
        out = []
        for s in driver.shards:
            name = f"{s.endpoint}[{s.start}:{s.end})"
            if exc is None:
                st = "completed"
            elif res.telemetry.status == "cancelled":
                st = "cancelled"
            elif s.endpoint == exc.shard_endpoint:
                st = "unverified" if exc.reason.silent else "failed"
            elif classify(exc) == "fatal":
                st = "failed"
            else:
                st = "restarted"
            out.append(ShardWork(name, st, a.prompt_tokens, a.recomputed_tokens, a.delivered_tokens,
                                 busy.get(name, 0.0)))
        return out
