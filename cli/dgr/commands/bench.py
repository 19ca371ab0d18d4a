"""`dgr bench`: measure against baselines (JSON out) and check results against the contract."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("baseline")
def baseline(
    model: Optional[Path] = typer.Option(None, "--model", help="Source GGUF (default: embedded SmolLM2-135M Q4_1)."),
    out: Path = typer.Option(Path("baseline.json"), "--out", help="Where to write the results JSON."),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda (both lanes)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Threads for every recipe (default: CPU count)."),
    quick: bool = typer.Option(False, "--quick", help="Short prompts and outputs: a smoke run of a few minutes."),
) -> None:
    """Transformers/safetensors (fp32, bf16) vs whole-model llama.cpp (F32, Q8_0, Q4_1), side by side."""
    from ..bench import baseline as bl
    from ..gguf.models import resolve_model

    src = resolve_model(model)
    cfg = bl.BaselineConfig.make(device=device, threads=threads, quick=quick)
    doc = bl.run_baseline(src, cfg, progress=lambda s: typer.echo(s, err=True))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    typer.echo(bl.summary(doc))
    typer.echo(f"results written to {out}")
    if doc["failures"]:
        raise typer.Exit(1)


@app.command("contract")
def contract(
    results: Path = typer.Argument(..., help="A `dgr bench baseline` results JSON."),
    out: Path = typer.Option(Path("performance-contract.json"), "--out", help="Where to write the contract."),
) -> None:
    """Write a performance contract from baseline results (`dgr accept DGR-001` does this)."""
    from ..bench import contract as bc

    doc = json.loads(results.read_text())
    c = bc.build_contract(doc)
    out.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    typer.echo(f"contract (schema_version {c['schema_version']}) written to {out}; "
               f"stop condition now: {c['stop_condition']['verdict_now']}")


@app.command("check")
def check(
    results: Path = typer.Argument(..., help="A results JSON (schema dgr.bench.results/1)."),
    contract: Path = typer.Option(..., "--contract", help="evidence/DGR-001/performance-contract.json"),
) -> None:
    """Evaluate results against the contract: pass/fail per threshold; exit 1 on any fail."""
    from ..bench import contract as bc

    c = bc.load_contract(contract)
    r = bc.load_results(results)
    note = bc.hardware_note(c, r)
    if note:
        typer.echo(f"note: {note}")
    verdicts = bc.check(c, r)
    for v in verdicts:
        typer.echo(f"{v.status.upper():4}  {v.id}: {v.detail}")
    failed = [v for v in verdicts if v.status == "fail"]
    typer.echo(f"{sum(v.status == 'pass' for v in verdicts)} passed, {len(failed)} failed, "
               f"{sum(v.status == 'skip' for v in verdicts)} skipped")
    if failed:
        raise typer.Exit(1)


@app.command("route")
def route(
    model: Optional[Path] = typer.Option(None, "--model", help="GGUF file (default: embedded SmolLM2-135M Q4_1)."),
    split: str = typer.Option("0:15,15:30", "--split", help="Shard ranges of the route."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Threads for every side (default: CPU count)."),
    n_prompt: int = typer.Option(128, "--n-prompt"),
    n_gen: int = typer.Option(64, "--n-gen"),
    repeats: int = typer.Option(3, "--repeats"),
    rpc: bool = typer.Option(True, "--rpc/--no-rpc",
                             help="Also measure llama.cpp's RPC split (two local rpc-servers; builds them once)."),
    out: Path = typer.Option(Path("route-bench.json"), "--out", help="Where to write the results JSON."),
) -> None:
    """2-shard route vs whole-model llama.cpp (llama-bench, llama-batched-bench), same run and threads."""
    from ..bench import route as rb
    from ..gguf.models import resolve_model
    from ..route.local import parse_split

    cfg = rb.RouteBenchConfig(split=tuple(parse_split(split)), threads=threads or 0, n_prompt=n_prompt,
                              n_gen=n_gen, repeats=repeats, rpc=rpc)
    doc = rb.run_route_bench(resolve_model(model), cfg, progress=lambda s: typer.echo(s, err=True))
    out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    typer.echo(rb.summary(doc))
    typer.echo(f"results written to {out}")


@app.command("gate")
def gate(
    model: Optional[Path] = typer.Option(None, "--model", help="Source GGUF (default: embedded SmolLM2-135M Q4_1)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Threads per shard (default: CPU count - 1)."),
    quick: bool = typer.Option(False, "--quick", help="Short prompts and outputs: a smoke run."),
    contract: Path = typer.Option(Path("evidence/DGR-001/performance-contract.json"), "--contract",
                                  help="The locked DGR-001 contract the GGUF routes are judged against."),
    out: Path = typer.Option(Path("gate.json"), "--out", help="Where to write the measurements JSON."),
) -> None:
    """The release gate without evidence: safetensors route vs GGUF F32/Q8_0/Q4_1 routes (needs the baseline extra)."""
    from ..bench import contract as bc
    from ..bench import gate as g
    from ..bench import gate_judge as gj
    from ..gguf.models import resolve_model

    c = bc.load_contract(contract)
    doc = g.run_gate(resolve_model(model), g.GateConfig.make(threads=threads, quick=quick),
                     progress=lambda m: typer.echo(m, err=True))
    out.write_text(json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n")
    judged = gj.judge(c, {n: gj.results_for(doc, n) for n in g.GGUF_ROUTES})
    for n, j in judged.items():
        fails = [v["id"] for v in j["verdicts"] if v["status"] == "fail"]
        typer.echo(f"{n}: stop condition {j['stop_condition']['status']}; "
                   + ("every threshold met" if not fails else "missed " + ", ".join(fails)))
    rec = gj.recommend(judged, doc)
    typer.echo(f"recommendation: {rec['decision'].upper()}: {rec['text']}")
    typer.echo(f"measurements written to {out}")


@app.command("worker")
def worker(
    model: Optional[Path] = typer.Option(None, "--model", help="GGUF file (default: embedded SmolLM2-135M Q4_1)."),
    sessions: str = typer.Option("1,2,4,8", "--sessions", help="Concurrent session counts."),
    threads: int = typer.Option(2, "--threads"),
    n_prompt: int = typer.Option(32, "--n-prompt"),
    n_gen: int = typer.Option(64, "--n-gen"),
    repeats: int = typer.Option(3, "--repeats"),
    out: Path = typer.Option(Path("worker-bench.json"), "--out", help="Where to write the results JSON."),
) -> None:
    """One dgr-worker (whole model): aggregate decode tok/s per session count next to llama-batched-bench."""
    from .. import paths
    from ..bench import worker as wb
    from ..gguf.models import resolve_model

    levels = tuple(int(x) for x in sessions.split(",") if x.strip())
    cfg = wb.WorkerBenchConfig(levels=levels, prompt_tokens=n_prompt, gen_tokens=n_gen, threads=threads,
                               repeats=repeats)
    bin_dir = paths.backend_build_dir("cpu") / "bin"
    doc = wb.run_worker_bench(resolve_model(model), cfg, worker_bin=bin_dir / "dgr-worker",
                              batched_bench=bin_dir / "llama-batched-bench", progress=lambda s: typer.echo(s, err=True))
    out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    typer.echo(wb.summary(doc))
    typer.echo(f"results written to {out}")
