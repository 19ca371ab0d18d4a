"""`dgr serve`: an OpenAI-compatible HTTP gateway and web console over an Inference Route."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import DgrError


def serve(
    model: Optional[Path] = typer.Option(None, "--model", help="GGUF file for a local route (default: embedded "
                                         "SmolLM2-135M). Not with --shard."),
    split: Optional[str] = typer.Option(None, "--split", help="Local shard ranges, e.g. 0:15,15:30 (default: the "
                                        "whole model on one worker). 'auto': the hosts probe themselves and the "
                                        "planner chooses (with --lab: hosts, order, ranges, pipeline groups for "
                                        "--max-sessions; local workers: one machine, so the model stays whole "
                                        "when it fits)."),
    shard: Optional[List[str]] = typer.Option(None, "--shard", help="HOST:PORT of a running worker, in route order "
                                              "(repeat); serve that route instead of starting workers."),
    route: Optional[List[str]] = typer.Option(None, "--route", help="[MODEL=]HOST:PORT,HOST:PORT,... one route of "
                                              "running workers in route order (repeat: several routes behind this "
                                              "gateway; the same MODEL for replicas of one model, which share its "
                                              "requests, another MODEL for another model). Not with --shard."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on. Anything but loopback needs "
                             "--api-key and --tls-cert/--tls-key."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="TCP port to listen on."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="DGR_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on /v1 and /api (env DGR_API_KEY)."),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help="PEM certificate: serve HTTPS."),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="Model id clients send (default: the GGUF "
                                             "file's stem, a split set's PREFIX; with --shard, the artifact id)."),
    max_concurrent: Optional[int] = typer.Option(None, "--max-concurrent", min=1, help="Requests that run at once "
                                                 "(default: the workers' session slots)."),
    queue: int = typer.Option(64, "--queue", min=0, help="Requests that may wait for a slot; beyond that: 429."),
    max_sessions: int = typer.Option(8, "--max-sessions", min=1, help="Local route: sessions per worker."),
    ctx_per_session: Optional[int] = typer.Option(None, "--ctx-per-session", min=1, help="Local route: positions per "
                                                  "session (default: the worker's, `dgr worker options`)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Local route: threads per worker "
                                          "(default: CPU count)."),
    slices: bool = typer.Option(False, "--slices", help="Local route: per-range slice files."),
    lab: Optional[str] = typer.Option(None, "--lab", help="Start the route's workers on this lab's simulated "
                                      "hosts (see `dgr lab up`; mTLS on every hop); --split defaults to one "
                                      "even range per host."),
    lab_hosts: Optional[str] = typer.Option(None, "--lab-hosts", help="With --lab: the host of each shard, "
                                            "comma-separated (e.g. h1,h2); default h1, h2, ... in order."),
    local_standby: bool = typer.Option(False, "--local-standby", help="With --model/--split (local workers): also "
                                       "start a standby worker per range on this machine (failover as with --standby; "
                                       "each standby loads its range too: twice the memory)."),
    lab_standby: bool = typer.Option(False, "--lab-standby", help="With --lab: also start a standby worker per range, "
                                     "on the lab host after its shard's (failover as with --standby)."),
    shard_ca: Optional[Path] = typer.Option(None, "--shard-tls-ca", help="With --shard: PEM CA of workers that "
                                            "serve TLS (the gateway then dials them over TLS)."),
    shard_cert: Optional[Path] = typer.Option(None, "--shard-tls-cert", help="With --shard-tls-ca: the gateway's "
                                              "client certificate, for workers that require mutual TLS."),
    shard_key: Optional[Path] = typer.Option(None, "--shard-tls-key", help="Private key of --shard-tls-cert."),
    standby: Optional[List[str]] = typer.Option(None, "--standby", help="With --shard or --route: HOST:PORT of a "
                                                 "running standby worker (repeat). A request whose shard fails then "
                                                 "restarts on a route through a standby; the client's answer goes "
                                                 "on without losing or repeating tokens. With several --route, every "
                                                 "route fails over to the standbys that fit its model and ranges."),
    max_restarts: int = typer.Option(2, "--max-restarts", min=0, help="With --standby: restarts per request."),
    hop: Optional[List[str]] = typer.Option(None, "--hop", help="With --shard or --route: SHARD=HOST:PORT (repeat), "
                                            "the relay egress that the worker before SHARD (a relay+tcp:// worker) "
                                            "dials for it (`dgr relay egress`); the route then stays chained."),
    fake: bool = typer.Option(False, "--fake", hidden=True, help="Fake-model workers (tests)."),
) -> None:
    """Serve a route over HTTP: OpenAI API (/v1/chat/completions, /v1/completions, /v1/models), a web
    console at /, /health and /metrics. Starts local workers for --model/--split, or serves running
    workers given with --shard (one route) or --route (one or more routes: replicas of a model, or
    several models), or starts them on a lab's simulated hosts with --lab. Ctrl-C or SIGTERM stops
    it: it stops admitting, gives answers in progress a few seconds, then stops the workers it
    started (which also stop if this process is killed)."""
    from ..serve.server import sigterm_as_interrupt

    with sigterm_as_interrupt():
        try:
            _serve(model, split, shard, host, port, api_key, tls_cert, tls_key, model_name, max_concurrent, queue,
                   max_sessions, ctx_per_session, threads, slices, lab, lab_hosts, shard_ca, shard_cert, shard_key,
                   fake, standby or [], max_restarts, route or [], lab_standby, local_standby, hop or [])
        except KeyboardInterrupt:   # Ctrl-C or SIGTERM: the workers were stopped on the way out
            pass


MAX_ROUTES = 64


def parse_routes(items: List[str]) -> list:
    """``--route [MODEL=]HOST:PORT,HOST:PORT,...`` each -> a RouteSpec (workers in route order)."""
    from ..serve.server import RouteSpec

    if len(items) > MAX_ROUTES:
        raise DgrError(f"at most {MAX_ROUTES} --route options, got {len(items)}")
    out = []
    for item in items:
        name, sep, rest = item.rpartition("=") if "=" in item else ("", "", item)
        if sep and (not name.strip() or name != name.strip() or not name.isprintable()):
            raise DgrError(f"--route {item!r}: the model name before '=' must be printable, non-empty text "
                           "without leading or trailing spaces")
        eps = [e.strip() for e in rest.split(",")]
        if not rest.strip() or any(not e for e in eps):
            raise DgrError(f"--route {item!r}: expected [MODEL=]HOST:PORT,HOST:PORT,... (workers in route order)")
        out.append(RouteSpec(tuple(eps), model_id=name or None))
    return out


def _with_hops(specs: list, items: List[str]) -> list:
    """Each ``--hop SHARD=HOST:PORT`` onto the route that has SHARD (dgr route generate's rules)."""
    from dataclasses import replace

    from .route import parse_hops

    out = []
    for sp in specs:
        mine = [it for it in items if it.rpartition("=")[0] in sp.endpoints]
        hops = parse_hops(mine, list(sp.endpoints)) if mine else None
        out.append(replace(sp, hops=tuple(hops)) if hops else sp)
    for it in items:
        if not any(it.rpartition("=")[0] in sp.endpoints for sp in specs):
            parse_hops([it], [ep for sp in specs for ep in sp.endpoints] or ["-"])   # says what is wrong
            raise DgrError(f"--hop {it!r}: {it.rpartition('=')[0]} is not a worker of any route")
    return out


def fake_n_layer() -> int:
    """The fake model's layer count: the worker's own --n-layer default (`dgr worker options`)."""
    from ..route.worker_options import worker_default

    return int(worker_default("n-layer"))


def _serve(model: Optional[Path], split: Optional[str], shard: Optional[List[str]], host: str, port: int,
           api_key: Optional[str], tls_cert: Optional[Path], tls_key: Optional[Path], model_name: Optional[str],
           max_concurrent: Optional[int], queue: int, max_sessions: int, ctx_per_session: Optional[int],
           threads: Optional[int], slices: bool, lab: Optional[str], lab_hosts: Optional[str],
           shard_ca: Optional[Path], shard_cert: Optional[Path], shard_key: Optional[Path], fake: bool,
           standby: List[str] = (), max_restarts: int = 2, route: List[str] = (), lab_standby: bool = False,
           local_standby: bool = False, hop: List[str] = ()) -> None:
    from ..gguf.gguf_set import model_stem
    from ..gguf.models import resolve_model
    from ..route import local as rt
    from ..serve.server import RouteSpec, ServeOptions, serve_route, serve_routes

    log = lambda m: typer.echo(f"dgr serve: {m}", err=True)  # noqa: E731
    opts = ServeOptions(host=host, port=port, api_key=api_key or None, tls_cert=tls_cert, tls_key=tls_key,
                        model_id=model_name, slots=max_concurrent, queue=queue, standby=list(standby),
                        max_restarts=max_restarts)
    opts.check()
    specs = parse_routes(route) if route else []
    if route and shard:
        raise DgrError("give --shard (one route) or --route (one or more), not both")
    if standby and not (shard or route):
        raise DgrError("--standby goes with --shard (running workers of the route, then the standbys)")
    running = list(shard or []) + [ep for sp in specs for ep in sp.endpoints]
    if standby and set(standby) & set(running):
        raise DgrError("a --standby worker is already a --shard of the route"
                       + ("" if not specs else " (or of a --route)"))

    def ready(u: str, model_id: str) -> None:
        log(f"serving {model_id} at {u}/v1 (console: {u}/)")

    if (shard_cert or shard_key or shard_ca) and not running:
        raise DgrError("--shard-tls-ca/--shard-tls-cert/--shard-tls-key go with --shard (a --lab route has its own CA)")
    if hop and not running:
        raise DgrError("--hop goes with --shard or --route (running workers, some reached through a relay)")
    if hop and standby:
        raise DgrError("--hop does not go with --standby (a route formed after a failure has no relay egress)")
    if hop:
        specs = _with_hops(specs or [RouteSpec(tuple(shard or []))], hop)
    if local_standby and (running or lab):
        raise DgrError("--local-standby goes with local workers (--model/--split); "
                       + ("use --standby HOST:PORT with running workers" if running else "use --lab-standby on a lab"))
    if running:
        if model or split or fake or lab:
            raise DgrError("give only one of --shard/--route (running workers), --lab (workers on lab hosts) or --model/--split (local workers), not both kinds")
        if (shard_cert or shard_key) and not shard_ca:
            raise DgrError("--shard-tls-cert/--shard-tls-key need --shard-tls-ca")
        if shard_ca:
            from ..protocol.tls import TlsFiles
            opts.route_tls = TlsFiles(shard_ca, shard_cert, shard_key)
        if specs:
            asyncio.run(serve_routes(specs, opts, on_ready=ready))
        else:
            asyncio.run(serve_route(shard, opts, on_ready=ready))
        return
    if max_sessions < 1 or (ctx_per_session is not None and ctx_per_session < 1):
        raise DgrError("--max-sessions and --ctx-per-session must be >= 1")
    if (lab_hosts or lab_standby) and not lab:
        raise DgrError(f"{'--lab-hosts' if lab_hosts else '--lab-standby'} goes with --lab")
    if lab:
        _serve_lab(lab, model, split, lab_hosts, opts, max_sessions, ctx_per_session, fake, log, ready, lab_standby)
        return
    src = None if fake else resolve_model(model)
    n_layer = fake_n_layer() if fake else rt.model_n_layer(src)
    if split == "auto":
        if src is None:
            raise DgrError("--split auto probes the model's GGUF; the fake model has none")
        from ..route.autosplit import plan_local

        rt.ensure_worker()
        auto = plan_local(src, max_sessions, threads=threads, ctx_per_session=ctx_per_session or 2048)
        for line in auto.describe(max_sessions):
            log(line)
        rng = auto.ranges
    else:
        rng = rt.parse_split(split) if split else [(0, n_layer)]
    if rng[-1][1] != n_layer:
        raise DgrError(f"split {split} ends at layer {rng[-1][1]}; the model has {n_layer} layers")
    if not fake:
        rt.ensure_worker()
    opts.model_id = opts.model_id or (model_stem(src) if src else "fake")
    local = dict(fake=fake, slices=slices, threads=threads or os.cpu_count() or 1, max_sessions=max_sessions,
                 ctx_per_session=ctx_per_session)
    with rt.LocalRoute(src, rng, **local) as lr, contextlib.ExitStack() as stack:
        log(f"route {','.join(f'{a}:{b}' for a, b in rng)} on {len(rng)} local worker(s)")
        if local_standby:
            spares = stack.enter_context(rt.LocalRoute(src, rng, **local))
            opts.standby = list(spares.endpoints)
            log("standbys " + ", ".join(f"{a}:{b} at {ep}" for (a, b), ep in zip(rng, spares.endpoints)))
        asyncio.run(serve_route(lr.endpoints, opts, on_ready=ready))


def _serve_lab(name: str, model: Optional[Path], split: Optional[str], hosts: Optional[str], opts, max_sessions: int,
               ctx_per_session: Optional[int], fake: bool, log, ready, standby: bool = False) -> None:
    """Workers on a lab's hosts (each in its namespace, CPU set and memory budget, mTLS on every
    hop); the gateway runs here and dials the head with the lab's driver certificate. With
    ``standby``: one more worker per range, on the lab host after its shard's (its failover pool)."""
    from ..gguf.gguf_set import model_stem
    from ..gguf.models import resolve_model
    from ..lab.hosts import Lab
    from ..lab.route import LabRoute
    from ..route import local as rt
    from ..serve.server import serve_route

    lab = Lab.load(name)
    src = None if fake else resolve_model(model)
    n_layer = fake_n_layer() if fake else rt.model_n_layer(src)
    placement = [h.strip() for h in hosts.split(",") if h.strip()] if hosts else None
    extra: tuple[str, ...] = ()
    if split == "auto":
        if hosts:
            raise DgrError("--split auto places the shards itself; leave out --lab-hosts")
        if src is None:
            raise DgrError("--split auto probes the model's GGUF; the fake model has none")
        from ..route.autosplit import plan_lab

        rt.ensure_worker()
        auto = plan_lab(lab, src, max_sessions)
        for line in auto.describe(max_sessions):
            log(line)
        rng, placement, extra = auto.ranges, auto.placement, auto.worker_args()
    elif split:
        rng = rt.parse_split(split)
    else:
        n = len(placement) if placement else len(lab.hosts)
        if n > n_layer:
            raise DgrError(f"the lab has {n} hosts but the model only {n_layer} layers; give --split")
        cuts = [round(i * n_layer / n) for i in range(n + 1)]
        rng = [(a, b) for a, b in zip(cuts, cuts[1:])]
    if rng[-1][1] != n_layer:
        raise DgrError(f"split {split} ends at layer {rng[-1][1]}; the model has {n_layer} layers")
    if not fake:
        rt.ensure_worker()
    opts.model_id = opts.model_id or (model_stem(src) if src else "fake")
    with LabRoute(lab, src, rng, placement=placement, max_sessions=max_sessions, ctx_per_session=ctx_per_session,
                  fake=fake, extra_args=extra) as lr, contextlib.ExitStack() as stack:
        opts.route_tls = lr.tls
        where = ", ".join(f"{p.host.name} {a}:{b}" for p, (a, b) in zip(lr.placed, rng))
        log(f"route on lab {name!r}: {where}")
        if standby:
            names = [h.name for h in lab.hosts]
            spare_at = [names[(names.index(p.host.name) + 1) % len(names)] for p in lr.placed]
            spares = stack.enter_context(LabRoute(lab, src, rng, placement=spare_at, max_sessions=max_sessions,
                                                  ctx_per_session=ctx_per_session, fake=fake, extra_args=extra))
            opts.standby = list(spares.endpoints)
            log("standbys on lab " + ", ".join(f"{p.host.name} {a}:{b}" for p, (a, b) in zip(spares.placed, rng)))
        asyncio.run(serve_route(lr.endpoints, opts, on_ready=ready))
