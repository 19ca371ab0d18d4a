"""`dgr drill`: inject one fault into a running route and measure how its sessions recover."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer


def drill(
    fault: str = typer.Option(..., "--fault", help="kill (SIGKILL), stop (SIGSTOP, resumed at the end), term "
                              "(SIGTERM: drain 1 s, exit), blackhole (the link into the shard stops delivering), "
                              "latency (the link adds --latency-ms for --hold-s), loss (chunks cost a 200 ms "
                              "retransmission timeout with probability --loss, for --hold-s)."),
    target: str = typer.Option("tail", "--target", help="The shard (or the link into it): head, tail or its "
                               "index on the route (0-based)."),
    sessions: int = typer.Option(8, "--sessions", min=1, max=64, help="Concurrent sessions on the route (1..64)."),
    max_tokens: int = typer.Option(0, "--max-tokens", min=0, help="Tokens per session (0: 160 synthetic, 48 with --model)."),
    after_tokens: int = typer.Option(8, "--after-tokens", min=0, help="Inject the fault once every session delivered this many tokens."),
    synthetic: bool = typer.Option(False, "--synthetic", help="Fake-model workers (no GGUF; the CI mode). The "
                                   "default when --model is not given."),
    model: Optional[Path] = typer.Option(None, "--model", help="GGUF file the workers serve (e.g. SmolLM2)."),
    split: Optional[str] = typer.Option(None, "--split", help="Shard ranges, e.g. 0:15,15:30 (default: 0:4,4:8 "
                                        "synthetic, the model's layers in two halves with --model)."),
    lab: Optional[str] = typer.Option(None, "--lab", help="Run the workers on this lab's hosts (dgr lab up) "
                                      "instead of local processes: shard i on host i, its standby on the next host."),
    latency_ms: float = typer.Option(300.0, "--latency-ms", min=0.0, help="latency: one-way delay added during the spike."),
    loss: float = typer.Option(0.3, "--loss", min=0.0, max=0.999, help="loss: probability per chunk, in [0, 1)."),
    hold_s: float = typer.Option(2.0, "--hold-s", min=0.0, help="latency/loss: how long the fault lasts."),
    max_restarts: int = typer.Option(2, "--max-restarts", min=0, help="Restarts per session before it fails."),
    fake_delay_ms: int = typer.Option(5, "--fake-delay-ms", min=0, help="Synthetic: the fake model's sleep per decode "
                                      "call (keeps the sessions running when the fault lands)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Threads per worker (with --model)."),
    timeout_s: float = typer.Option(180.0, "--timeout-s", min=1.0, help="Bound on the faulted run."),
    as_json: bool = typer.Option(False, "--json", help="Print the full JSON document on stdout."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON document here."),
) -> None:
    """Run N sessions on a route with a standby worker per range, inject one fault into one shard
    or the link into it, and report time to detect, time to the first token on the new route,
    tokens lost/duplicated against an uninterrupted run, sessions recovered, work records and
    what every surviving worker still holds (sessions, KV cells, queued steps). Exit 1 when a
    session did not complete with the uninterrupted answer or a survivor kept resources."""
    from ..errors import DgrError
    from ..lab.drill import DrillConfig, run_drill
    from ..route.local import model_n_layer, parse_split

    if synthetic and model is not None:
        raise DgrError("give --synthetic or --model, not both")
    if model is not None:
        if not model.is_file():
            raise DgrError(f"model file not found: {model}")
        n_layer = model_n_layer(model)
        rng = parse_split(split or f"0:{n_layer // 2},{n_layer // 2}:{n_layer}")
        if rng[-1][1] != n_layer:
            raise DgrError(f"split ends at layer {rng[-1][1]}; {model.name} has {n_layer} layers")
    else:
        rng = parse_split(split or "0:4,4:8")
    if len(rng) < 2:
        raise DgrError("a drill needs a route of at least 2 shards")
    cfg = DrillConfig(fault=fault, target=target, sessions=sessions, max_tokens=max_tokens, after_tokens=after_tokens,
                      split=rng, model=model, lab=lab, latency_ms=latency_ms, loss=loss, hold_s=hold_s,
                      max_restarts=max_restarts, fake_delay_ms=fake_delay_ms, threads=threads, timeout_s=timeout_s)
    doc = run_drill(cfg)   # progress lines: dgr.lab.drill's logger (dgr.console shows INFO on stderr)
    text = json.dumps(doc, indent=1)
    if out:
        out.write_text(text + "\n")
    if as_json:
        typer.echo(text)
    else:
        s = doc["summary"]
        fmt = lambda r: "-" if r is None else f"{r['min']:.3f}..{r['max']:.3f} s"   # noqa: E731
        typer.echo(f"fault {doc['fault']['kind']} on {doc['fault']['target']}")
        typer.echo(f"  time to detect          {fmt(s['time_to_detect_s'])}")
        typer.echo(f"  first token, new route  {fmt(s['time_to_first_new_token_s'])} after the fault "
                   f"(re-prefill TTFT {fmt(s['reprefill_ttft_s'])})")
        typer.echo(f"  sessions                {s['sessions_completed']}/{s['sessions']} completed, "
                   f"{s['sessions_recovered']} recovered on a new route, {s['sessions_failed']} failed")
        typer.echo(f"  tokens                  lost {s['tokens_lost']}, duplicated {s['tokens_duplicated']}, "
                   f"mismatched {s['tokens_mismatched']}; {s['answers_equal_reference']}/{s['sessions']} answers "
                   "equal the uninterrupted run")
        for w in doc["survivors"]:
            if w.get("state") == "ended":
                typer.echo(f"  {w['worker']}: ended (exit {w['exit_code']})")
            elif "error" in w:
                typer.echo(f"  {w['worker']}: {w['state']}, unreadable: {w['error']}")
            else:
                typer.echo(f"  {w['worker']}: {w['state']}, {w['sessions']} sessions, {w['kv_cells_used']} KV cells, "
                           f"{w['queued_steps']} queued steps")
        if out:
            typer.echo(f"JSON written to {out}")
    s = doc["summary"]
    if s["sessions_failed"] or s["answers_equal_reference"] != s["sessions"] or s["survivors_holding"]:
        raise typer.Exit(1)
