"""`dgr serve`: an OpenAI-compatible HTTP gateway and web console over an Inference Route."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import DgrError


def serve(
    model: Optional[Path] = typer.Option(None, "--model", help="GGUF file for a local route (default: embedded "
                                         "SmolLM2-135M). Not with --shard."),
    split: Optional[str] = typer.Option(None, "--split", help="Local shard ranges, e.g. 0:15,15:30 (default: the "
                                        "whole model on one worker)."),
    shard: Optional[List[str]] = typer.Option(None, "--shard", help="HOST:PORT of a running worker, in route order "
                                              "(repeat); serve that route instead of starting workers."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on. Anything but loopback needs "
                             "--api-key and --tls-cert/--tls-key."),
    port: int = typer.Option(8080, "--port", help="TCP port to listen on."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="DGR_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on /v1 and /api (env DGR_API_KEY)."),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help="PEM certificate: serve HTTPS."),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="Model id clients send (default: the GGUF "
                                             "file's stem; with --shard, the artifact id)."),
    max_concurrent: Optional[int] = typer.Option(None, "--max-concurrent", help="Requests that run at once "
                                                 "(default: the workers' session slots)."),
    queue: int = typer.Option(64, "--queue", help="Requests that may wait for a slot; beyond that: 429."),
    max_sessions: int = typer.Option(8, "--max-sessions", help="Local route: sessions per worker."),
    ctx_per_session: int = typer.Option(2048, "--ctx-per-session", help="Local route: positions per session."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Local route: threads per worker "
                                          "(default: CPU count)."),
    slices: bool = typer.Option(False, "--slices", help="Local route: per-range slice files."),
    fake: bool = typer.Option(False, "--fake", hidden=True, help="Fake-model workers (tests)."),
) -> None:
    """Serve a route over HTTP: OpenAI API (/v1/chat/completions, /v1/completions, /v1/models), a web
    console at /, /health and /metrics. Starts local workers for --model/--split, or serves running
    workers given with --shard. Ctrl-C stops it (and the local workers)."""
    from ..gguf.models import resolve_model
    from ..route import local as rt
    from ..serve.server import ServeOptions, serve_route

    log = lambda m: typer.echo(f"dgr serve: {m}", err=True)  # noqa: E731
    opts = ServeOptions(host=host, port=port, api_key=api_key or None, tls_cert=tls_cert, tls_key=tls_key,
                        model_id=model_name, slots=max_concurrent, queue=queue)
    opts.check()

    def ready(u: str) -> None:
        log(f"serving {opts.model_id} at {u}/v1 (console: {u}/)")

    if shard:
        if model or split or fake:
            raise DgrError("give --shard (running workers) or --model/--split (local workers), not both")
        asyncio.run(serve_route(shard, opts, on_ready=ready))
        return
    if max_sessions < 1 or ctx_per_session < 1:
        raise DgrError("--max-sessions and --ctx-per-session must be >= 1")
    src = None if fake else resolve_model(model)
    n_layer = 8 if fake else rt.model_n_layer(src)
    rng = rt.parse_split(split) if split else [(0, n_layer)]
    if rng[-1][1] != n_layer:
        raise DgrError(f"split {split} ends at layer {rng[-1][1]}; the model has {n_layer} layers")
    if not fake:
        rt.ensure_worker()
    opts.model_id = opts.model_id or (src.stem if src else "fake")
    with rt.LocalRoute(src, rng, fake=fake, slices=slices, threads=threads or os.cpu_count() or 1,
                       max_sessions=max_sessions, ctx_per_session=ctx_per_session) as lr:
        log(f"route {','.join(f'{a}:{b}' for a, b in rng)} on {len(rng)} local worker(s)")
        try:
            asyncio.run(serve_route(lr.endpoints, opts, on_ready=ready))
        except KeyboardInterrupt:
            pass
