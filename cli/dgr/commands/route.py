"""`dgr route`: run an Inference Route (local workers for a split, or running workers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import DgrError

app = typer.Typer(no_args_is_help=True)


def _prompts(prompt: Optional[str], prompts_file: Optional[Path], sessions: int) -> list[str]:
    from ..route.sessions import DEFAULT_PROMPTS

    if prompt and prompts_file:
        raise DgrError("give --prompt or --prompts, not both")
    if prompts_file:
        try:
            items = [ln.strip() for ln in prompts_file.read_text().splitlines() if ln.strip()]
        except OSError as exc:
            raise DgrError(f"cannot read {prompts_file}: {exc.strerror}") from None
        if not items:
            raise DgrError(f"{prompts_file} holds no prompt (one per line)")
    elif prompt:
        items = [prompt]
    else:
        items = list(DEFAULT_PROMPTS)
    n = sessions or len(items)
    return [items[i % len(items)] for i in range(n)]


def _sampling(temperature: float, top_k: int, top_p: float, seed: int):
    from ..route.driver import Sampling

    if temperature < 0:
        raise DgrError("--temperature must be >= 0 (0 = greedy)")
    return Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def _printer(n: int, as_json: bool):
    if as_json:
        return None
    if n == 1:
        return lambda _i, text: (sys.stdout.write(text), sys.stdout.flush())
    return lambda i, text: typer.echo(f"[{i}] {text}".replace("\n", " "))


@app.command("run")
def run(
    model: Optional[Path] = typer.Option(None, "--model", help="GGUF file or any part of a split set "
                                         "(default: embedded SmolLM2-135M)."),
    split: str = typer.Option("0:15,15:30", "--split", help="Contiguous shard ranges, e.g. 0:15,15:30. 'auto': "
                              "this machine probes the model and the planner chooses; local workers share one "
                              "machine, so the model stays whole when it fits (a split adds hops, no capacity)."),
    slices: bool = typer.Option(False, "--slices", help="Serve per-range slice files (each worker maps only its tensors)."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="One prompt (repeated for --sessions)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="A file with one prompt per line."),
    sessions: int = typer.Option(0, "--sessions", min=0, help="Concurrent Route Sessions (default: one per prompt)."),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1, help="Tokens to generate per session."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy (the default)."),
    top_k: int = typer.Option(0, "--top-k", min=0),
    top_p: float = typer.Option(0.0, "--top-p", min=0.0, max=1.0),
    seed: int = typer.Option(0, "--seed", min=0, max=2**64 - 1),
    parity: bool = typer.Option(False, "--parity", help="Also run the whole model and report token agreement."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Threads per worker (default: CPU count)."),
    raw: bool = typer.Option(False, "--raw", help="Send prompts as-is (no chat template)."),
    as_json: bool = typer.Option(False, "--json", help="Print the full report as JSON."),
    backend: str = typer.Option("cpu", "--backend", help="Worker backend: one for every shard (cpu, vulkan, cuda) "
                                "or one per shard in route order, e.g. cpu,vulkan (a mixed route)."),
    whole_backend: Optional[str] = typer.Option(None, "--whole-backend", help="Backend of the whole-model worker "
                                                "--parity compares with (default: the route's, or cpu when mixed)."),
    fake: bool = typer.Option(False, "--fake", hidden=True, help="Fake-model workers (tests)."),
) -> None:
    """Start one local worker per shard of the split, run the sessions concurrently, print metrics."""
    from ..gguf.models import resolve_model
    from ..route import local, report
    from ..route import run as route_run

    items = _prompts(prompt, prompts, sessions)
    if split == "auto":
        if fake:
            raise DgrError("--split auto probes the model's GGUF; the fake model has none")
        if "," in backend:
            raise DgrError("--split auto plans for one backend; give --backend once")
        from ..route.autosplit import plan_local

        local.ensure_worker()
        auto = plan_local(resolve_model(model), len(items), threads=threads)
        for line in auto.describe(len(items)):
            typer.echo(f"dgr route run: {line}", err=True)
        rng = auto.ranges
    else:
        rng = local.parse_split(split)
    backends = local.parse_backends(backend, len(rng))
    if whole_backend is not None:
        local.parse_backends(whole_backend, 1)
    src = None if fake else resolve_model(model)
    if src is not None:
        n_layer = local.model_n_layer(src)
        if rng[-1][1] != n_layer:
            raise DgrError(f"split {split} ends at layer {rng[-1][1]}; the model has {n_layer} layers")
    res = route_run.run_local(src, rng, items, max_tokens=max_tokens,
                              sampling=_sampling(temperature, top_k, top_p, seed), parity=parity, fake=fake,
                              slices=slices, threads=threads, chat=not raw, on_text=_printer(len(items), as_json),
                              backends=backends, whole_backend=whole_backend)
    if as_json:
        typer.echo(json.dumps(res.to_json(), indent=2))
    else:
        typer.echo("")
        for s in res.route.sessions:
            if s.error:
                typer.echo(f"[{s.index}] error: {s.error}")
        typer.echo(report.summary_table(res))
    if not res.route.ok or (res.parity is not None and not res.parity.ok) or (res.isolation is not None and not res.isolation.ok):
        raise typer.Exit(1)


def parse_hops(items: List[str], shards: List[str]) -> list[str] | None:
    """``--hop SHARD=HOST:PORT`` items -> one hop per shard ("" for a direct one), None for none."""
    if not items:
        return None
    out = [""] * len(shards)
    for item in items:
        target, sep, via = item.rpartition("=")
        via = via.strip()
        if not sep or not target or not via or ":" not in via or via.startswith("relay+tcp://"):
            raise DgrError(f"--hop {item!r}: expected SHARD=HOST:PORT (SHARD as given to --shard; HOST:PORT the "
                           "relay egress that the shard before it dials)")
        if target not in shards:
            raise DgrError(f"--hop {item!r}: {target} is not a --shard of this route")
        i = shards.index(target)
        if i == 0:
            raise DgrError(f"--hop {item!r}: the head is dialled by the driver, not by another shard")
        if out[i]:
            raise DgrError(f"--hop {item!r}: {target} already has the hop {out[i]}")
        out[i] = via
    return out


@app.command("generate")
def generate(
    shard: List[str] = typer.Option(..., "--shard", help="HOST:PORT of a running worker, in route order (repeat)."),
    prompt: str = typer.Option(..., "--prompt", help="The prompt."),
    sessions: int = typer.Option(1, "--sessions", min=1, help="Concurrent sessions with this prompt."),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k", min=0),
    top_p: float = typer.Option(0.0, "--top-p", min=0.0, max=1.0),
    seed: int = typer.Option(0, "--seed", min=0, max=2**64 - 1),
    raw: bool = typer.Option(False, "--raw", help="No chat template."),
    as_json: bool = typer.Option(False, "--json"),
    tls_ca: Optional[Path] = typer.Option(None, "--tls-ca", help="PEM CA of the workers' certificates (TLS to every shard)."),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help="PEM client certificate (mutual TLS; with --tls-key)."),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key", help="PEM client key."),
    standby: List[str] = typer.Option([], "--standby", help="HOST:PORT of a running standby worker (repeat): a "
                                      "session whose shard fails restarts from token zero on a route using it "
                                      "(docs/failover.md); the JSON then carries work records."),
    max_restarts: int = typer.Option(2, "--max-restarts", min=0, help="With --standby: restarts per session."),
    hop: List[str] = typer.Option([], "--hop", help="SHARD=HOST:PORT (repeat): the relay egress that the shard "
                                  "before SHARD (a relay+tcp:// --shard) dials for it (`dgr relay egress`); the "
                                  "route then stays chained."),
) -> None:
    """Generate through already running workers (`dgr worker serve …`)."""
    from ..protocol.tls import TlsFiles
    from ..route import run as route_run

    if (tls_cert or tls_key) and not tls_ca:
        raise DgrError("--tls-cert/--tls-key need --tls-ca")
    tls = TlsFiles(tls_ca, tls_cert, tls_key) if tls_ca else None
    hops = parse_hops(hop, shard)
    if hops and standby:
        raise DgrError("--hop does not go with --standby (a route formed after a failure has no egress)")
    items = [prompt] * max(1, sessions)
    rep = route_run.generate_remote(shard, items, max_tokens=max_tokens,
                                    sampling=_sampling(temperature, top_k, top_p, seed), chat=not raw,
                                    on_text=_printer(len(items), as_json), tls=tls, standby=standby,
                                    max_restarts=max_restarts, hops=hops)
    if as_json:
        typer.echo(json.dumps(rep.to_json(), indent=2))
    else:
        typer.echo("")
        for s in rep.sessions:
            typer.echo(f"[{s.index}] " + (f"error: {s.error}" if s.error else
                       f"{len(s.tokens)} tokens, TTFT {s.ttft_s * 1e3:.0f} ms, decode {s.decode_tok_s:.1f} tok/s"))
        if rep.work is not None:
            w = rep.work
            typer.echo(f"work: {w['sessions']}, {w['restarts']} restart(s), {w['delivered_tokens']} tokens delivered, "
                       f"{w['recomputed_tokens']} recomputed; routes: " + " -> ".join(",".join(r) for r in rep.routes))
    if not rep.ok:
        raise typer.Exit(1)


@app.command("drift")
def drift(
    backend: str = typer.Option(..., "--backend", help="One backend per shard in route order, e.g. cpu,vulkan."),
    model: Optional[Path] = typer.Option(None, "--model", help="GGUF file or any part of a split set "
                                         "(default: embedded SmolLM2-135M)."),
    split: str = typer.Option("0:15,15:30", "--split", help="Contiguous shard ranges, e.g. 0:15,15:30."),
    reference: str = typer.Option("cpu", "--reference", help="Backend of the whole-model reference worker."),
    tokens: int = typer.Option(64, "--tokens", min=1, help="Generated tokens compared per prompt."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="One prompt (default: the built-in prompts)."),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts", help="A file with one prompt per line."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Threads per worker (default: CPU count)."),
    raw: bool = typer.Option(False, "--raw", help="Send prompts as-is (no chat template)."),
    as_json: bool = typer.Option(False, "--json", help="Print the full report as JSON."),
) -> None:
    """Measure a (mixed-backend) route's numeric drift against a whole model: top-1 agreement
    (teacher-forced), greedy agreement, max |d logprob|; and the registry status of its plan."""
    from ..gguf.models import resolve_model
    from ..gguf.recipe import backend_plan, load_registry, recipe_for
    from ..route import drift as route_drift
    from ..route import local

    rng = local.parse_split(split)
    backends = local.parse_backends(backend, len(rng))
    local.parse_backends(reference, 1)
    src = resolve_model(model)
    n_layer = local.model_n_layer(src)
    if rng[-1][1] != n_layer:
        raise DgrError(f"split {split} ends at layer {rng[-1][1]}; the model has {n_layer} layers")
    items = _prompts(prompt, prompts_file, 0)
    rep = route_drift.measure(src, rng, backends, items, n_tokens=tokens, reference_backend=reference,
                              threads=threads, chat=not raw)
    plan = backend_plan(backends)
    reg = load_registry()
    entry = reg.lookup(recipe_for(src, backend=backends[0], backends=plan, progress=False))
    certified = entry is not None and entry.status == "certified" and plan in entry.backends
    status = (f"certified by {entry.name} ({entry.evidence}) within {dict(entry.tolerance) or 'exact parity'}"
              if certified else f"not certified: admission refuses routes with plan {plan}")
    if as_json:
        typer.echo(json.dumps({**rep.to_json(), "registry": status}, indent=2))
    else:
        typer.echo(route_drift.summary(rep))
        typer.echo(f"  registry: {status}")
        if certified and entry.tolerance:
            bad = rep.violations(dict(entry.tolerance))
            typer.echo("  within the certified tolerance" if not bad else "  OUTSIDE the certified tolerance: " + "; ".join(bad))
