"""`dgr plan`: the split of a route over unequal hosts, from their measured capabilities."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer


def plan(
    capabilities: Optional[Path] = typer.Option(None, "--capabilities", "-c", help="The hosts' capabilities "
                                                "(JSON, schema dgr.capabilities.v1; docs/multi-host.md); the first "
                                                "host listed runs the gateway or driver."),
    worker: List[str] = typer.Option([], "--worker", help="NAME=HOST:PORT of a running worker that measured its "
                                     "range at start-up (--probe-budget-s), asked with GetCapability; repeat, "
                                     "in the order of the file's hosts, instead of --capabilities. Its range "
                                     "must end at the model's last layer."),
    tls_ca: Optional[Path] = typer.Option(None, "--tls-ca", help="With --worker: PEM CA of the workers' "
                                          "certificates."),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help="With --worker: client certificate (mTLS)."),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key", help="With --worker: its key."),
    model: Optional[str] = typer.Option(None, "--model", help="GGUF file (or any part of a split set), or a "
                                        "packaged model (default: the embedded SmolLM2-135M Q4_1)."),
    sessions: int = typer.Option(8, "--sessions", min=1, max=4096, help="Concurrent sessions to plan for."),
    prompt_tokens: int = typer.Option(512, "--prompt-tokens", min=1, max=1 << 20, help="Prompt length per session."),
    ctx: int = typer.Option(2048, "--ctx", min=1, max=1 << 20, help="KV cells per session (memory)."),
    rtt_ms: Optional[float] = typer.Option(None, "--rtt-ms", min=0.0, max=10000.0,
                                           help="Round trip between consecutive hosts (default: the file's "
                                           "link, else 0.5 ms)."),
    bandwidth_mbit: Optional[float] = typer.Option(None, "--bandwidth-mbit", min=0.001, max=1e7,
                                                   help="Link bandwidth (default: the file's link, else 1000)."),
    latency_bound: float = typer.Option(2.0, "--latency-bound", min=1.0, max=1000.0,
                                        help="A session's time between tokens may be at most this many times "
                                        "the least any candidate offers for the same load."),
    compare: Optional[str] = typer.Option(None, "--compare", help="Also predict this split (e.g. 0:15,15:30) "
                                          "over all the listed hosts, at its best group count; 'even': layers in "
                                          "equal parts."),
    token_overhead_ms: Optional[float] = typer.Option(None, "--token-overhead-ms", min=0.0, max=10000.0,
                                                      help="Per token on the head's host: the driver or gateway "
                                                      "beside it, gRPC, sampling (default: measured here, 1.7)."),
    step_overhead_ms: Optional[float] = typer.Option(None, "--step-overhead-ms", min=0.0, max=10000.0,
                                                     help="Per group step through the route: hand-offs, "
                                                     "scheduling (default: measured here, 2.7)."),
    hop_overhead_ms: Optional[float] = typer.Option(None, "--hop-overhead-ms", min=0.0, max=10000.0,
                                                    help="Per hop a group step crosses, CPU on both ends "
                                                    "(default: measured here, 2.1)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Choose the layer ranges and pipeline groups with the highest predicted aggregate decode,
    within each host's memory; print the predicted TTFT, decode rates and each stage's busy
    share, and name any host left out and why. Predictions, not measurements: see
    docs/multi-host.md for the cost model and its limits."""
    from ..errors import DgrError
    from ..gguf.models import resolve_model
    from ..route.local import parse_split
    from ..route.planner import (Link, Overheads, Workload, even_ranges, load_capabilities, model_shape, plan_route,
                                 predict)

    if (capabilities is None) == (not worker):
        raise DgrError("give --capabilities FILE or --worker NAME=HOST:PORT (repeated), one of the two")
    src = resolve_model(model)
    shape = model_shape(src)
    if capabilities is not None:
        hosts, file_link = load_capabilities(capabilities)
    else:
        hosts, file_link = _from_workers(worker, shape, tls_ca, tls_cert, tls_key), None
    link = file_link or Link()
    link = Link(rtt_s=link.rtt_s if rtt_ms is None else rtt_ms / 1e3,
                bandwidth_bytes_s=link.bandwidth_bytes_s if bandwidth_mbit is None else bandwidth_mbit * 1e6 / 8)
    work = Workload(sessions=sessions, prompt_tokens=prompt_tokens, ctx_per_session=ctx)
    base = Overheads()
    over = Overheads(token_s=base.token_s if token_overhead_ms is None else token_overhead_ms / 1e3,
                     step_s=base.step_s if step_overhead_ms is None else step_overhead_ms / 1e3,
                     hop_s=base.hop_s if hop_overhead_ms is None else hop_overhead_ms / 1e3)
    p = plan_route(shape, hosts, link, work, latency_bound=latency_bound, overheads=over)
    cmp = None
    if compare:
        rng = even_ranges(shape.n_layer, len(hosts)) if compare == "even" else parse_split(compare)
        if len(rng) != len(hosts):
            raise DgrError(f"--compare {compare} has {len(rng)} ranges for {len(hosts)} hosts")
        if rng[-1][1] != shape.n_layer:
            raise DgrError(f"--compare {compare} ends at layer {rng[-1][1]}; the model has {shape.n_layer}")
        cmp = max((predict(shape, hosts, rng, link, work, g, over, hosts[0].name) for g in range(1, min(sessions, len(hosts) + 1) + 1)),
                  key=lambda c: c.aggregate_tok_s)
    if as_json:
        out = {"schema": "dgr.plan.v1", "model": shape.name, "n_layer": shape.n_layer,
               "workload": {"sessions": sessions, "prompt_tokens": prompt_tokens, "ctx_per_session": ctx},
               "link": {"rtt_ms": link.rtt_s * 1e3, "bandwidth_mbit": link.bandwidth_bytes_s * 8 / 1e6},
               "overheads": {"token_ms": over.token_s * 1e3, "step_ms": over.step_s * 1e3, "hop_ms": over.hop_s * 1e3},
               "kind": "prediction", **p.to_json()}
        if cmp is not None:
            from dataclasses import asdict
            out["compare"] = {"split": compare, "prediction": asdict(cmp)}
        typer.echo(json.dumps(out, indent=2))
        return
    pr = p.prediction
    typer.echo(f"model {shape.name}: {shape.n_layer} layers; {sessions} session{'' if sessions == 1 else 's'}, "
               f"{prompt_tokens}-token prompts; "
               f"link {link.rtt_s * 1e3:g} ms RTT, {link.bandwidth_bytes_s * 8 / 1e6:g} Mbit/s")
    typer.echo(f"split {p.split} over {', '.join(p.hosts)}; {pr.groups} pipeline group(s) of {pr.rows_per_group} row(s)")
    typer.echo(f"  {'host':<16} {'layers':<9} {'ms/step':>8} {'busy':>6} {'memory':>17}")
    for s in pr.stages:
        typer.echo(f"  {s.host:<16} {s.layers[0]}:{s.layers[1]:<7} {s.decode_s * 1e3:>8.2f} {s.busy_share:>6.0%} "
                   f"{s.memory_bytes / 2**30:>6.2f}/{s.memory_budget_bytes / 2**30:.2f} GiB")
    typer.echo(f"predicted: aggregate decode {pr.aggregate_tok_s:.1f} tok/s, {pr.session_tok_s:.1f} tok/s per session "
               f"({pr.single_session_tok_s:.1f} alone); TTFT {pr.ttft_s * 1e3:.0f} ms alone, "
               f"{pr.ttft_all_s * 1e3:.0f} ms for the last of {sessions} together")
    typer.echo(f"token-latency bound: {p.latency_bound_s * 1e3:.1f} ms ({latency_bound:g}x the least of "
               f"{p.candidates} candidates)")
    for d in p.dropped:
        typer.echo(f"left out: {d['host']}: {d['why']}")
    if cmp is not None:
        typer.echo(f"compare {compare} ({cmp.groups} group(s)): aggregate {cmp.aggregate_tok_s:.1f} tok/s, "
                   f"{cmp.single_session_tok_s:.1f} tok/s alone "
                   f"(planned/compared: {pr.aggregate_tok_s / cmp.aggregate_tok_s:.2f}x)")


def _from_workers(worker: List[str], shape, tls_ca, tls_cert, tls_key) -> list:
    """Each --worker's measured cost (GetCapability.measured) as a host capability."""
    from ..errors import DgrError
    from ..protocol.client import WorkerClient
    from ..protocol.errors import WorkerError
    from ..protocol.tls import TlsFiles
    from ..route.probe import (capability_from_probe, capability_of, host_memory_bytes, output_ratio_of,
                               probe_of_capability)

    if (tls_cert or tls_key) and not tls_ca:
        raise DgrError("--tls-cert/--tls-key need --tls-ca")
    tls = TlsFiles(tls_ca, tls_cert, tls_key) if tls_ca else None
    from .named import named_values

    raws = []
    for name, target in named_values(worker, "--worker", "NAME=HOST:PORT"):
        try:
            with WorkerClient(target, timeout=10.0, tls=tls) as c:
                cap = c.capability()
        except WorkerError as exc:
            raise DgrError(f"--worker {name} ({target}): {exc}") from None
        raw = probe_of_capability(cap)
        if not raw["memory_budget_bytes"]:
            _no_budget(name)
        raws.append((name, target, raw))
    # a worker that is not a tail measured no output matrix: its cost is estimated from a tail
    # worker's output-to-layer ratio
    tails = [(n, t, r) for n, t, r in raws if r["tail"]]
    if not tails:
        raise DgrError("no --worker serves the model's last layer, so none measured the output matrix",
                       hint="include the route's tail worker, or probe each host with `dgr worker probe`")
    ratio = output_ratio_of(capability_from_probe(tails[0][2], shape, name=tails[0][0], memory_bytes=1))
    out = []
    for name, target, raw in raws:
        entry = capability_from_probe(raw, shape, name=name, memory_bytes=host_memory_bytes(raw, None),
                                      endpoint=target, output_ratio=None if raw["tail"] else ratio)
        if entry.get("output_estimated"):
            typer.echo(f"note: {name}'s output matrix cost is estimated from {tails[0][0]}'s (it serves no tail)",
                       err=True)
        out.append(capability_of(entry))
    return out


def _no_budget(name: str) -> int:
    from ..errors import DgrError

    raise DgrError(f"--worker {name} reports no memory budget",
                   hint="start it with --memory-budget-mb (its host's share for a Shard), or use --capabilities")
