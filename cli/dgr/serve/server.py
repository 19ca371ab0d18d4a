"""Serving: one route or several (local workers it starts, or running shards), the app, uvicorn.

:class:`Gateway` is also what tests and ``dgr bench serve`` use: it starts uvicorn on a free
port in a background thread with its own event loop, and stops it cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from dgr.errors import DgrError
from dgr.netaddr import is_loopback_host

LOOPBACK = "127.0.0.1"
# SIGTERM or Ctrl-C: answers in progress get this long to finish (uvicorn's graceful shutdown;
# new connections are refused meanwhile), then they are cancelled (each session on every shard)
DRAIN_TIMEOUT_S = 5

_log = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    host: str = LOOPBACK
    port: int = 8080
    api_key: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    model_id: str | None = None
    slots: int | None = None          # concurrent requests (default: the workers' session slots)
    queue: int = 64                   # requests waiting for a slot before 429
    timeout: float = 60.0
    route_tls: Any = None             # dgr.protocol.tls.TlsFiles: (m)TLS to the shards, when they serve TLS
    standby: list[str] = field(default_factory=list)   # standby workers: failover (dgr.route.failover)
    max_restarts: int = 2             # with standby workers: restarts per request

    def check(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise DgrError("--tls-cert and --tls-key go together")
        for p in (self.tls_cert, self.tls_key):
            if p is not None and not p.is_file():
                raise DgrError(f"{p} does not exist")
        if not is_loopback(self.host) and not self.api_key:
            raise DgrError(f"--host {self.host} exposes the gateway beyond this machine without an API key",
                           hint="give --api-key (and --tls-cert/--tls-key), or serve on 127.0.0.1")
        if not is_loopback(self.host) and not self.tls_cert:
            raise DgrError(f"--host {self.host} exposes the gateway beyond this machine without TLS",
                           hint="give --tls-cert and --tls-key, or serve on 127.0.0.1")
        if self.slots is not None and self.slots < 1:
            raise DgrError("--max-concurrent must be >= 1")
        if self.queue < 0:
            raise DgrError("--queue must be >= 0")
        if self.max_restarts < 0:
            raise DgrError("--max-restarts must be >= 0")
        if not 0 <= self.port <= 65535:
            raise DgrError(f"--port {self.port} is not a TCP port")


@dataclass(frozen=True)
class RouteSpec:
    """One route the gateway serves: its workers in route order, the model id clients name it
    by (None: ServeOptions.model_id, else the artifact id the head reports) and its standby
    workers (failover, dgr.route.failover)."""

    endpoints: tuple[str, ...]
    model_id: str | None = None
    standby: tuple[str, ...] = ()
    # per worker, the relay egress its predecessor dials ("" direct; RouteDriver's ``hops``)
    hops: tuple[str, ...] = ()


def is_loopback(host: str) -> bool:
    """Parsed or resolved, every address checked (dgr.netaddr); never a prefix match."""
    return is_loopback_host(host)


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _config(app: Any, opts: ServeOptions, log_level: str) -> Any:
    import uvicorn

    return uvicorn.Config(app, host=opts.host, port=opts.port, log_level=log_level, access_log=False,
                          ssl_certfile=str(opts.tls_cert) if opts.tls_cert else None,
                          ssl_keyfile=str(opts.tls_key) if opts.tls_key else None,
                          timeout_graceful_shutdown=DRAIN_TIMEOUT_S, lifespan="off")


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt (see :func:`sigterm_as_interrupt`)."""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within: SIGTERM (how systemd, Docker and Kubernetes stop a service) stops ``dgr serve`` as
    Ctrl-C does. While uvicorn serves, it takes both signals itself and drains (stops accepting,
    gives answers in progress :data:`DRAIN_TIMEOUT_S`, cancels the rest), then raises the signal
    again on its way out; outside that, and on that second raise, SIGTERM raises
    :class:`Stopped` (a KeyboardInterrupt), so that every ``finally``/``with`` on the way out
    runs: the workers this process started are stopped, none is left behind. Main thread only
    (elsewhere a no-op: signals reach the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(_sig: int, _frame: Any) -> None:
        # once: a second SIGTERM must not cut short the cleanup the first one started (a
        # supervisor's SIGKILL still ends it; the workers then stop by their parent-death signal)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Stopped("SIGTERM")

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _route_label(spec: RouteSpec) -> str:
    return ",".join(spec.endpoints)


async def connect_routes(specs: Sequence[RouteSpec], opts: ServeOptions) -> Any:
    """Connects every route (side by side) and returns them as :class:`~dgr.serve.pool.Routes`.
    Any route that cannot be connected fails the whole start, naming it (the others are
    closed). Routes under one model id must serve the same artifact: they are replicas."""
    from .engine import Engine
    from .pool import Routes

    if not specs:
        raise DgrError("no route to serve")
    seen: dict[str, int] = {}
    for i, sp in enumerate(specs):
        if not sp.endpoints:
            raise DgrError(f"route {i + 1} has no worker")
        for ep in sp.endpoints:
            if ep in seen:
                raise DgrError(f"the worker {ep} is in route {seen[ep] + 1} and in route {i + 1}",
                               hint="a worker serves one route of a gateway; start another for the second route")
            seen[ep] = i

    async def one(sp: RouteSpec) -> Any:
        return await Engine.connect(list(sp.endpoints), model_id=sp.model_id or opts.model_id, slots=opts.slots,
                                    queue=opts.queue, timeout=opts.timeout, tls=opts.route_tls,
                                    # the gateway's standbys are every route's failover pool (a
                                    # failover takes the ones whose range and fingerprint fit)
                                    standby=list(sp.standby) or list(opts.standby),
                                    max_restarts=opts.max_restarts, hops=list(sp.hops) or None)

    got = await asyncio.gather(*(one(sp) for sp in specs), return_exceptions=True)
    engines = [g for g in got if not isinstance(g, BaseException)]
    failed = [(sp, g) for sp, g in zip(specs, got) if isinstance(g, BaseException)]
    try:
        if failed:
            sp, exc = failed[0]
            if len(specs) == 1 or not isinstance(exc, Exception):
                raise exc
            raise DgrError(f"route {specs.index(sp) + 1} ({_route_label(sp)}): {exc}") from exc
        first: dict[str, Any] = {}
        for sp, e in zip(specs, engines):
            ident = e.driver.shards[0].capability.identity
            if e.model_id not in first:
                first[e.model_id] = (sp, ident)
                continue
            sp0, id0 = first[e.model_id]
            if (ident.artifact_id, ident.n_vocab) != (id0.artifact_id, id0.n_vocab):
                raise DgrError(f"routes {_route_label(sp0)} and {_route_label(sp)} are both named {e.model_id!r} but "
                               f"serve different models (artifacts {id0.artifact_id!r} and {ident.artifact_id!r})",
                               hint="name each model's routes: --route NAME=HOST:PORT,...")
        return Routes(engines)
    except BaseException:
        await asyncio.gather(*(e.close() for e in engines), return_exceptions=True)
        raise


async def serve_route(endpoints: Sequence[str], opts: ServeOptions, *, log_level: str = "warning",
                      on_ready: Callable[[str, str], None] | None = None, hops: Sequence[str] = ()) -> None:
    """Connects to the route and serves until interrupted; ``on_ready(url, model id)`` once
    listening."""
    await serve_routes([RouteSpec(tuple(endpoints), hops=tuple(hops))], opts, log_level=log_level,
                       on_ready=on_ready)


async def serve_routes(specs: Sequence[RouteSpec], opts: ServeOptions, *, log_level: str = "warning",
                       on_ready: Callable[[str, str], None] | None = None) -> None:
    """Connects to every route and serves until interrupted; ``on_ready(url, model ids)`` once
    listening."""
    import uvicorn

    from .app import create_app

    opts.check()
    routes = await connect_routes(specs, opts)
    try:
        app = create_app(routes, api_key=opts.api_key)
        routes.start_health()
        server = uvicorn.Server(_config(app, opts, log_level))
        if on_ready is not None:
            async def announce() -> None:
                while not server.started:
                    if server.should_exit:
                        return
                    await asyncio.sleep(0.05)
                if opts.port == 0:      # any free port: announce the one the system gave
                    opts.port = bound_port(server) or 0
                on_ready(url(opts), ", ".join(routes.models))
            asyncio.ensure_future(announce())
        await server.serve()
        if not server.started:
            raise DgrError(f"cannot listen on {opts.host}:{opts.port} (in use, or not an address of this machine)")
    finally:
        await routes.close()


def bound_port(server: Any) -> int | None:
    """The TCP port a started uvicorn server listens on (None when it has no socket)."""
    for srv in getattr(server, "servers", None) or ():
        for sock in getattr(srv, "sockets", None) or ():
            name = sock.getsockname()
            if isinstance(name, tuple) and len(name) >= 2:
                return int(name[1])
    return None


def url(opts: ServeOptions) -> str:
    scheme = "https" if opts.tls_cert else "http"
    host = f"[{opts.host}]" if ":" in opts.host else opts.host
    return f"{scheme}://{host}:{opts.port}"


class Gateway:
    """A gateway on a free loopback port, in a background thread (tests, benchmarks): over one
    route (``endpoints``) or several (``routes``: :class:`RouteSpec` s)."""

    def __init__(self, endpoints: Sequence[str] | None = None, *, routes: Sequence[RouteSpec] | None = None,
                 **kw: Any) -> None:
        if (endpoints is None) == (routes is None):
            raise ValueError("give endpoints (one route) or routes")
        self.specs = list(routes) if routes is not None else [RouteSpec(tuple(endpoints or ()))]
        self.endpoints = list(self.specs[0].endpoints)
        from .pool import HEALTH_INTERVAL_S

        self.health_interval = float(kw.pop("health_interval", HEALTH_INTERVAL_S))
        self.opts = ServeOptions(port=kw.pop("port", 0) or free_port(), **kw)
        self.engine: Any = None       # the first route's Engine
        self.routes: Any = None       # every route (dgr.serve.pool.Routes)
        self._server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return url(self.opts)

    def start(self, timeout: float = 30.0) -> "Gateway":
        self._thread = threading.Thread(target=self._run, name="dgr-gateway", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise DgrError(f"the gateway did not start within {timeout:.0f}s")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        import uvicorn

        from .app import create_app

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            try:
                self.opts.check()
                self.routes = await connect_routes(self.specs, self.opts)
                self.engine = self.routes.first
                self._server = uvicorn.Server(_config(create_app(self.routes, api_key=self.opts.api_key),
                                                      self.opts, "warning"))
                self.routes.start_health(self.health_interval)
                self._server.install_signal_handlers = lambda: None   # not the main thread
                serving = asyncio.ensure_future(self._server.serve())
                while not self._server.started and not serving.done():
                    await asyncio.sleep(0.02)
                if serving.done():
                    serving.result()
                    raise DgrError(f"the gateway could not listen on {self.opts.host}:{self.opts.port}")
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                self._error = exc
                self._ready.set()
                if self.routes is not None:
                    await self.routes.close()
                return
            self._ready.set()
            try:
                await serving
            finally:
                await self.routes.close()

        asyncio.run(main())

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(15)

    def __enter__(self) -> "Gateway":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
