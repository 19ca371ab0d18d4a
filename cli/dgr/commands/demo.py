"""`dgr demo`: one GGUF model split across two local worker processes, end to end."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Optional

import typer


def demo(
    model: Optional[str] = typer.Option(
        None, "--model", help="GGUF file (or any part of a split set), or a packaged model: smollm2-135m (default, embedded SmolLM2-135M Q4_1), "
        "gemma3-270m (Gemma 3 270M Q4_K_M, the gemma3 extra)."),
    split: Optional[str] = typer.Option(None, "--split", help="Shard ranges, e.g. 0:9,9:18 (default: the model's "
                                        "layers in two halves on two local workers)."),
    max_tokens: int = typer.Option(48, "--max-tokens", min=1, help="Tokens per chat answer."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Threads per worker (default: CPU count)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the full report (JSON) here."),
) -> None:
    """Split the default model over two local workers, run 4 chat prompts concurrently with live
    output, check greedy parity against the whole model and print TTFT/throughput/memory, next
    to the whole model on one dgr-worker and stock llama.cpp (llama-server serving the same prompts)."""
    from ..errors import DgrError
    from ..gguf.models import resolve_model
    from ..route import local, report, sessions
    from ..route import run as route_run

    log = logging.getLogger("dgr.demo")
    src = resolve_model(model)
    n_layer = local.model_n_layer(src)
    if split is None:
        split = f"0:{n_layer // 2},{n_layer // 2}:{n_layer}"
    rng = local.parse_split(split)
    if rng[-1][1] != n_layer:
        raise DgrError(f"split {split} ends at layer {rng[-1][1]}; {src.name} has {n_layer} layers")
    local.ensure_worker()
    log.info(f"model {src.name}: {n_layer} layers, route {split} on {len(rng)} local worker processes")
    prompts = list(sessions.DEFAULT_PROMPTS)
    for i, p in enumerate(prompts):
        typer.echo(f"[{i}] user: {p}")
    typer.echo("")
    res = route_run.run_local(src, rng, prompts, max_tokens=max_tokens, parity=True, threads=threads,
                              on_text=lambda i, t: typer.echo(f"[{i}] {t}".replace("\n", " ")),
                              llama_baseline=True)
    typer.echo("")
    for s in res.route.sessions:
        typer.echo(f"[{s.index}] assistant: {s.text.strip()}" if s.error is None else f"[{s.index}] error: {s.error}")
    typer.echo("")
    typer.echo(report.summary_table(res))
    if out:
        out.write_text(json.dumps(res.to_json(), indent=2) + "\n")
        typer.echo(f"report written to {out}")
    sys.stdout.flush()
    if not res.route.ok or (res.parity is not None and not res.parity.ok) or (res.isolation is not None and not res.isolation.ok):
        raise typer.Exit(1)
