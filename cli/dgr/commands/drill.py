"""`dgr drill`: inject one fault into a running route and measure how its sessions recover;
`dgr drill --soak MINUTES`: a bounded chaos soak through the gateway (dgr.lab.soak)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer


def drill(
    fault: Optional[str] = typer.Option(None, "--fault", help="kill (SIGKILL), stop (SIGSTOP, resumed at the end), "
                              "term (SIGTERM: drain 1 s, exit), blackhole (the link into the shard stops delivering), "
                              "latency (the link adds --latency-ms for --hold-s), loss (chunks cost a 200 ms "
                              "retransmission timeout with probability --loss, for --hold-s)."),
    target: str = typer.Option("tail", "--target", help="The shard (or the link into it): head, tail or its "
                               "index on the route (0-based)."),
    sessions: int = typer.Option(8, "--sessions", min=1, max=64, help="Concurrent sessions on the route (1..64); "
                                 "with --soak: streaming requests kept running through the gateway."),
    max_tokens: int = typer.Option(0, "--max-tokens", min=0, help="Tokens per session (0: 160 synthetic, 48 with "
                                   "--model; with --soak 64 and 32)."),
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
    hold_s: float = typer.Option(2.0, "--hold-s", min=0.0, help="latency/loss: how long the fault lasts; with "
                                 "--soak: how long a stop or blackhole lasts (x0.5..1.5, at random)."),
    max_restarts: Optional[int] = typer.Option(None, "--max-restarts", min=0, help="Restarts per session before "
                                               "it fails (default 2; with --soak 5: the gateway's --max-restarts)."),
    fake_delay_ms: int = typer.Option(5, "--fake-delay-ms", min=0, help="Synthetic: the fake model's sleep per decode "
                                      "call (keeps the sessions running when the fault lands)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Threads per worker (with --model)."),
    timeout_s: float = typer.Option(180.0, "--timeout-s", min=1.0, help="Bound on the faulted run; with --soak: "
                                    "the time allowed beyond MINUTES (setup, the last requests, the checks)."),
    soak: Optional[float] = typer.Option(None, "--soak", min=0.0, max=120.0, help="Chaos soak for MINUTES (up to "
                                         "120, fractions allowed) through the gateway (dgr serve's, in this "
                                         "process): --sessions streaming requests at all times, a random kill, "
                                         "stop, term, blackhole or restart every --fault-every-s; checks every "
                                         "answer against a reference and what every worker holds at the end."),
    fault_every_s: float = typer.Option(4.0, "--fault-every-s", min=0.2, max=600.0, help="--soak: mean time "
                                        "between two actions (each x0.5..1.5, at random)."),
    seed: int = typer.Option(0, "--seed", min=0, help="--soak: the random generator's seed (which action, "
                             "which worker, when)."),
    kinds: str = typer.Option("kill,stop,term,blackhole,restart", "--kinds", help="--soak: the actions drawn "
                              "from (comma-separated)."),
    prompt_ids: bool = typer.Option(False, "--prompt-ids", help="--soak: send each prompt as token ids "
                                    "(tokenized once up front), so that the gateway tokenizes nothing."),
    workers_per_range: int = typer.Option(2, "--workers-per-range", min=2, max=6, help="--soak: workers kept "
                                          "per range (the route's and its standbys); restart tops the pool up."),
    as_json: bool = typer.Option(False, "--json", help="Print the full JSON document on stdout."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON document here."),
) -> None:
    """Run N sessions on a route with a standby worker per range, inject one fault into one shard
    or the link into it, and report time to detect, time to the first token on the new route,
    tokens lost/duplicated against an uninterrupted run, sessions recovered, work records and
    what every surviving worker still holds (sessions, KV cells, queued steps). Exit 1 when a
    session did not complete with the uninterrupted answer or a survivor kept resources.

    With --soak MINUTES instead of --fault: a chaos soak through the gateway (random kill, stop,
    term, blackhole and restart under --sessions streaming requests; every answer checked
    against a reference, every worker's leftovers, the gateway's in-flight gauge, no process
    left). Exit 1 on any violation. See docs/failover.md."""
    from ..errors import DgrError
    from ..lab.drill import DrillConfig, run_drill
    from ..route.local import model_n_layer, parse_split

    if soak is not None and fault is not None:
        raise DgrError("give --fault (one fault, measured) or --soak MINUTES (a chaos soak), not both")
    if soak is None and fault is None:
        raise DgrError("give --fault KIND (one fault, measured) or --soak MINUTES (a chaos soak through the gateway)")
    if soak is not None and target != "tail":
        raise DgrError("--target is for the one-fault drill; a soak picks its targets at random (--seed)")
    soak_only = {"--fault-every-s": fault_every_s != 4.0, "--seed": seed != 0, "--prompt-ids": prompt_ids,
                 "--kinds": kinds != "kill,stop,term,blackhole,restart", "--workers-per-range": workers_per_range != 2}
    if soak is None and any(soak_only.values()):
        raise DgrError(f"{next(k for k, v in soak_only.items() if v)} goes with --soak MINUTES")
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
    if soak is not None:
        _soak(soak, sessions=sessions, max_tokens=max_tokens, split=rng, model=model, lab=lab, hold_s=hold_s,
              max_restarts=max_restarts, fake_delay_ms=fake_delay_ms, threads=threads, timeout_s=timeout_s,
              fault_every_s=fault_every_s, seed=seed, kinds=kinds, workers_per_range=workers_per_range,
              prompt_ids=prompt_ids, as_json=as_json, out=out)
        return
    cfg = DrillConfig(fault=fault, target=target, sessions=sessions, max_tokens=max_tokens, after_tokens=after_tokens,
                      split=rng, model=model, lab=lab, latency_ms=latency_ms, loss=loss, hold_s=hold_s,
                      max_restarts=2 if max_restarts is None else max_restarts, fake_delay_ms=fake_delay_ms,
                      threads=threads, timeout_s=timeout_s)
    doc = run_drill(cfg)   # progress lines: dgr.lab.drill's logger (dgr.console shows INFO on stderr)
    if not _emit(doc, out, as_json):
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


def _emit(doc: dict, out: Optional[Path], as_json: bool) -> bool:
    """Writes the JSON document to ``out`` (when given) and prints it with ``as_json``; True when
    it was printed (the caller then prints no summary)."""
    text = json.dumps(doc, indent=1)
    if out:
        out.write_text(text + "\n")
    if as_json:
        typer.echo(text)
    return as_json


def _soak(minutes: float, *, sessions: int, max_tokens: int, split, model: Optional[Path], lab: Optional[str],
          hold_s: float, max_restarts: Optional[int], fake_delay_ms: int, threads: Optional[int], timeout_s: float,
          fault_every_s: float, seed: int, kinds: str, workers_per_range: int, prompt_ids: bool, as_json: bool,
          out: Optional[Path]) -> None:
    from ..lab.soak import SoakConfig, run_soak

    cfg = SoakConfig(minutes=minutes, fault_every_s=fault_every_s, seed=seed, concurrency=sessions,
                     max_tokens=max_tokens, split=split, model=model, lab=lab, workers_per_range=workers_per_range,
                     hold_s=hold_s, max_restarts=5 if max_restarts is None else max_restarts,
                     fake_delay_ms=fake_delay_ms, threads=threads,
                     kinds=tuple(k.strip() for k in kinds.split(",") if k.strip()), grace_s=timeout_s,
                     prompt_ids=prompt_ids)
    cfg.validate()
    if out is not None and not out.parent.is_dir():
        from ..errors import DgrError
        raise DgrError(f"--out: the folder {out.parent} does not exist")
    doc = run_soak(cfg)    # progress lines: dgr.lab.soak's logger (dgr.console shows INFO on stderr)
    if not _emit(doc, out, as_json):
        f, r, nt = doc["faults"], doc["requests"], doc["next_delta_after_fault_s"]
        sec = lambda x: "-" if x is None else f"{x:.3f} s"   # noqa: E731
        typer.echo(f"soak {doc['soak_s']:.1f} s ({doc['placement']}, {doc['mode']}): {f['injected']} actions "
                   f"({', '.join(f'{k} {v}' for k, v in f['by_kind'].items())}), {f['on_route']} on the route")
        typer.echo(f"  requests                {r['ok']} ok, {r['failed']} failed of {r['started']}")
        typer.echo(f"  next delta after fault  p50 {sec(nt['p50'])}, p99 {sec(nt['p99'])}, max {sec(nt['max'])} "
                   f"({nt['n']} streams)")
        g = doc["gateway"]
        typer.echo(f"  gateway                 {g['failovers']} failovers, {g['restarted_requests']} restarted "
                   f"requests, in flight at the end {g['in_flight_at_end']}")
        typer.echo(f"  workers                 {doc['workers']['started']} started, "
                   f"{len(doc['workers']['retired'])} retired, {len(doc['workers']['survivors'])} checked at the end")
        for k, v in f["skipped"].items():
            typer.echo(f"  skipped ({k})          {v}")
        typer.echo(f"  violations              {doc['violations_total']}")
        for v in doc["violations"][:20]:
            typer.echo(f"    {v}")
        if out:
            typer.echo(f"JSON written to {out}")
    if doc["violations_total"]:
        raise typer.Exit(1)
