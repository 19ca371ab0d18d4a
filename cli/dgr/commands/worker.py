"""`dgr worker serve`: run build/<backend>/bin/dgr-worker for one Shard (see docs/worker.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from ..errors import DgrError
from ..upstream.build import worker_binary_path

app = typer.Typer(no_args_is_help=True)


@app.command("serve")
def serve(
    model: Optional[Path] = typer.Option(None, "--model", help="GGUF file (whole model, any part of a split "
                                         "set, or a `dgr gguf slice`)."),
    fake_model: bool = typer.Option(False, "--fake-model", help="Deterministic arithmetic model (tests, no GGUF)."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Layer range A:B served (default: all)."),
    n_layer: Optional[int] = typer.Option(None, "--n-layer", min=1, help="Fake model: number of layers."),
    listen: Optional[str] = typer.Option(None, "--listen", help="HOST:PORT (the worker's default: loopback)."),
    allow_remote: bool = typer.Option(False, "--allow-remote", help="Allow a non-loopback --listen without TLS."),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help="PEM server certificate (TLS)."),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key", help="PEM server key (TLS)."),
    tls_client_ca: Optional[Path] = typer.Option(None, "--tls-client-ca", help="PEM CA for client certs (mTLS)."),
    require_client_auth: bool = typer.Option(
        False, "--require-client-auth",
        help="With --tls-client-ca: every ShardRuntimeService RPC needs a verified client certificate "
             "(UNAUTHENTICATED otherwise); health and reflection stay open to TLS clients without one."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Compute threads."),
    max_sessions: Optional[int] = typer.Option(None, "--max-sessions", min=1, max=256, help="Concurrent sessions."),
    ctx_per_session: Optional[int] = typer.Option(None, "--ctx-per-session", min=1, help="Positions per session."),
    kv_budget_mb: Optional[float] = typer.Option(None, "--kv-budget-mb", min=0.0, help="KV budget in MiB."),
    kv_cells: Optional[int] = typer.Option(None, "--kv-cells", min=1, help="KV budget in cells."),
    memory_budget_mb: Optional[float] = typer.Option(
        None, "--memory-budget-mb", min=0.0,
        help="What the shard may hold (weights + KV + compute) in MiB, checked before loading; a range that "
             "does not fit is refused, saying what would (docs/memory.md)."),
    chain_peers: Optional[str] = typer.Option(
        None, "--chain-peers", help="Hosts chained sessions may forward to (comma-separated, '*' any)."),
    chain_tls_ca: Optional[Path] = typer.Option(None, "--chain-tls-ca", help="PEM CA to verify downstream workers (TLS)."),
    io_nice: Optional[int] = typer.Option(None, "--io-nice", min=0, max=19, help="Nice value of gRPC/non-compute threads (0: off)."),
    queue_limit: Optional[int] = typer.Option(None, "--queue-limit", min=1, help="Unanswered frames."),
    max_batch_tokens: Optional[int] = typer.Option(None, "--max-batch-tokens", min=1, help="Rows per decode call."),
    max_prefill_chunk: Optional[int] = typer.Option(None, "--max-prefill-chunk", min=1, help="Rows per PREFILL step."),
    pipeline_groups: Optional[int] = typer.Option(
        None, "--pipeline-groups", min=0, max=16,
        help="Chained head: decode groups that overlap along the route (0 auto: one per Shard off-host; 1 off)."),
    metrics_listen: Optional[str] = typer.Option(None, "--metrics-listen", help="HOST:PORT for Prometheus text."),
    drain_timeout_s: Optional[float] = typer.Option(None, "--drain-timeout-s", min=0.0, help="SIGTERM drain deadline (seconds)."),
    session_ttl_s: Optional[float] = typer.Option(None, "--session-ttl-s", min=0.0, help="Idle session TTL (seconds)."),
    backend: str = typer.Option("cpu", "--backend", help="Which build/<backend> worker to run."),
    identity: bool = typer.Option(True, "--identity/--no-identity",
                                  help="Compute the artifact id and recipe fingerprint (dgr.gguf.recipe) and pass them; "
                                       "the worker proves them from the file either way and refuses a mismatch."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the worker command line and exit."),
) -> None:
    """Serve one Shard over gRPC (ShardRuntimeService, health, reflection) until SIGTERM.

    An option left out takes the worker's default: `dgr worker options` lists them with their
    bounds, from the worker's own table (the bounds checked here are tested against it)."""
    binary = worker_binary_path(backend)
    if fake_model == (model is not None):
        raise DgrError("give exactly one of --model FILE or --fake-model")
    from ..route.supervisor import WorkerArgs

    ident: dict[str, str] = {}
    path = None
    if model is not None:
        from ..gguf.models import resolve_model

        path = resolve_model(model)
        if identity:
            from ..gguf.recipe import recipe_for

            recipe = recipe_for(path, backend=backend)
            ident = dict(fingerprint=recipe.fingerprint(), artifact_id=recipe.artifact_id,
                         recipe_json=json.dumps(recipe.to_json(), sort_keys=True, separators=(",", ":")))
    args = WorkerArgs(
        listen=listen, model=path, fake_model=fake_model, **ident, layers=layers, n_layer=n_layer,
        tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca, require_client_auth=require_client_auth,
        threads=threads,
        max_sessions=max_sessions, ctx_per_session=ctx_per_session, kv_budget_mb=kv_budget_mb,
        kv_cells=kv_cells, queue_limit=queue_limit, max_batch_tokens=max_batch_tokens,
        max_prefill_chunk=max_prefill_chunk, pipeline_groups=pipeline_groups, metrics_listen=metrics_listen, drain_timeout_s=drain_timeout_s,
        session_ttl_s=session_ttl_s, memory_budget_mb=memory_budget_mb, chain_peers=chain_peers,
        chain_tls_ca=chain_tls_ca, io_nice=io_nice, allow_remote=allow_remote)
    argv = [str(binary), "serve", *args.argv()]
    if dry_run:
        typer.echo(" ".join(argv))
        return
    if not binary.is_file():
        raise DgrError(f"{binary} missing", hint=f"run `dgr build --backend {backend}`")
    os.execv(str(binary), argv)


@app.command("memory")
def memory(
    model: Path = typer.Argument(..., help="GGUF file, any part of a split set, or a slice."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Layer range A:B (default: all)."),
    max_sessions: Optional[int] = typer.Option(None, "--max-sessions", min=1, max=256, help="Default: the worker's."),
    ctx_per_session: Optional[int] = typer.Option(None, "--ctx-per-session", min=1, help="Default: the worker's."),
    memory_budget_mb: Optional[float] = typer.Option(None, "--memory-budget-mb", min=0.0,
                                                     help="Say whether this budget admits the range."),
    measure: bool = typer.Option(False, "--measure", help="Also start the worker, run a prompt and a few "
                                 "decode steps in every session and report its peak RSS against the prediction."),
    as_json: bool = typer.Option(False, "--json"),
    backend: str = typer.Option("cpu", "--backend"),
) -> None:
    """The host memory a worker would need for a range, computed before loading (docs/memory.md)."""
    from dataclasses import asdict

    from ..gguf.models import resolve_model
    from ..gguf.slice import LayerRange
    from ..route.memory_plan import MIB, measure_memory, plan_memory

    path = resolve_model(model)
    rng = None
    if layers:
        r = LayerRange.parse(layers)
        rng = (r.start, r.end)
    binary = worker_binary_path(backend)
    plan = plan_memory(path, rng, max_sessions=max_sessions, ctx_per_session=ctx_per_session,
                       memory_budget_mb=memory_budget_mb, binary=binary)
    out: dict = {"plan": asdict(plan)}
    if measure:
        sizes = {} if max_sessions is None else {"max_sessions": max_sessions}
        m = measure_memory(path, rng, **sizes, ctx_per_session=ctx_per_session, binary=binary)
        out["measured"] = asdict(m) | {"error": m.error}
    if as_json:
        typer.echo(json.dumps(out, indent=2))
        return
    typer.echo(f"layers [{plan.layer_start}, {plan.layer_end}) of {plan.n_layer}: {plan.total_bytes / MIB:.1f} MiB "
               f"(weights {plan.weights_bytes / MIB:.1f}, KV {plan.kv_bytes / MIB:.1f}, compute "
               f"{plan.compute_bytes / MIB:.1f}, runtime {plan.runtime_bytes / MIB:.1f})")
    if plan.budget_bytes:
        typer.echo(f"budget {plan.budget_bytes / MIB:.1f} MiB ({plan.budget_source}): "
                   + ("fits" if plan.fits else plan.refusal))
    if measure:
        m = out["measured"]
        typer.echo(f"measured peak RSS {m['peak_rss_bytes'] / MIB:.1f} MiB against {m['predicted_bytes'] / MIB:.1f} "
                   f"predicted ({100 * m['error']:+.1f} %)")


@app.command("probe")
def probe(
    model: Optional[str] = typer.Option(None, "--model", help="GGUF file (or any part of a split set), or a packaged "
                                        "model (default: the embedded SmolLM2-135M Q4_1)."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Range to measure; it must end at the last layer "
                                         "(default: the last 4 layers: little to load, a layer and the output "
                                         "matrix measured apart)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, max=512, help="Threads, as the Shard will serve "
                                          "(default: the worker's)."),
    name: Optional[str] = typer.Option(None, "--name", help="Host name in the capabilities (default: this host's)."),
    endpoint: str = typer.Option("", "--endpoint", help="The host's worker endpoint HOST:PORT, recorded for route "
                                 "formation."),
    memory_mb: Optional[float] = typer.Option(None, "--memory-mb", min=1.0, help="Memory a Shard may use here "
                                              "(default: the worker's budget, else MemAvailable)."),
    budget_s: float = typer.Option(5.0, "--budget-s", min=0.5, max=600.0, help="Time the probe may take; larger "
                                   "batches are left out first."),
    out: Optional[Path] = typer.Option(None, "--out", help="Add (or replace, by name) this host in a capabilities "
                                       "file for `dgr plan`."),
    as_json: bool = typer.Option(False, "--json", help="Print the host's capability entry as JSON."),
    backend: str = typer.Option("cpu", "--backend", help="Which build/<backend> worker measures."),
) -> None:
    """Measure what this host's worker spends on the model: a decode step at 1/4/8/16 rows, a
    prompt row, the output matrix apart; as the capability entry `dgr plan` reads."""
    from ..gguf.models import resolve_model
    from ..gguf.slice import LayerRange
    from ..route.planner import model_shape
    from ..route.probe import (capability_from_probe, default_host_name, default_probe_range, host_memory_bytes,
                               merge_capability, run_probe)

    path = resolve_model(model)
    shape = model_shape(path)
    if layers:
        r = LayerRange.parse(layers)
        rng = (r.start, r.end)
        if rng[1] != shape.n_layer:
            raise DgrError(f"--layers {layers} does not end at the model's last layer ({shape.n_layer})",
                           hint="the output matrix is measured on a tail range")
    else:
        rng = default_probe_range(shape.n_layer)
    raw = run_probe(path, rng, threads=threads, budget_s=budget_s, binary=worker_binary_path(backend))
    entry = capability_from_probe(raw, shape, name=name or default_host_name(),
                                  memory_bytes=host_memory_bytes(raw, memory_mb), endpoint=endpoint)
    if out is not None:
        merge_capability(out, entry)
    if as_json:
        typer.echo(json.dumps(entry, indent=2))
        return
    typer.echo(f"{entry['name']}: {shape.name} layers {rng[0]}:{rng[1]}, {raw.get('backend')}, "
               f"{raw.get('seconds', 0):.2f} s")
    for rows, s in entry["layer_decode_s"].items():
        typer.echo(f"  {int(rows):>2} rows: {1e3 * s:.3f} ms per mean layer, output matrix "
                   f"{1e3 * entry['output_decode_s'][rows]:.3f} ms")
    typer.echo(f"  prompt: {1e3 * entry['layer_prefill_s']:.4f} ms per mean layer per token; memory "
               f"{entry['memory_bytes'] / 2**30:.2f} GiB")
    if raw.get("skipped"):
        typer.echo(f"  left out (batch limit or time budget): {', '.join(map(str, raw['skipped']))} rows")
    if out is not None:
        typer.echo(f"written to {out}")


@app.command("options")
def options(
    as_json: bool = typer.Option(False, "--json", help="The table as the worker prints it (dgr-worker options --json)."),
    backend: str = typer.Option("cpu", "--backend", help="Which build/<backend> worker to ask."),
) -> None:
    """The worker's options, defaults and bounds, read from the worker's own table."""
    from ..route.worker_options import worker_options

    binary = worker_binary_path(backend)
    table = worker_options(binary)
    if as_json:
        from dataclasses import asdict

        typer.echo(json.dumps({"options": [asdict(o) for o in table.values()]}, indent=2))
        return
    for o in table.values():
        head = f"{o.flag} {o.metavar}".strip()
        bounds = "" if o.min is None and o.max is None else f" [{_num(o.min)} .. {_num(o.max)}]"
        default = f" (default {o.default_text})" if o.default_text else ""
        typer.echo(f"{head:<28}{o.help}{bounds}{default}")


def _num(v: float | None) -> str:
    return "" if v is None else f"{v:g}" if isinstance(v, float) and not v.is_integer() else str(int(v))
