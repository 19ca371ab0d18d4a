"""`dgr bench`: measure against baselines (JSON out) and check results against the contract."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(no_args_is_help=True)

_started_at: dict = {}   # the dgr tree's git state when this benchmark started (see _tree_state)


@app.callback()
def _tree_state() -> None:
    """Records the commit the dgr tree is at when a benchmark starts, and whether it has
    changes: every results JSON carries it (``git``), so that a figure can be traced to the
    code that produced it and a run from a dirty tree is visible as one."""
    from ..accept.evidence import git_state
    from ..errors import DgrError

    try:
        _started_at.update(git_state(ignore=()))
    except DgrError:   # not run from a clone: nothing to record
        _started_at.update(git_commit=None, git_dirty=None, git_dirty_paths=[])


def _check_out(out: Path) -> None:
    """Refuses, before a benchmark runs for minutes, an --out it could not write at the end: a
    directory, or a place where no file can be created (tried with a temporary file there)."""
    import tempfile

    from ..errors import DgrError

    if out.is_dir():
        raise DgrError(f"--out {out} is a directory", hint="give a file name, e.g. results.json")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=".dgr-out-check-"):
            pass
    except OSError as exc:
        raise DgrError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None


def _write(out: Path, doc: dict, summary: str) -> None:
    """Writes a benchmark's results JSON to ``out`` (with the tree's git state at the start)
    and prints its summary and where it went."""
    if _started_at and isinstance(doc, dict):
        doc = {**doc, "git": dict(_started_at)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    typer.echo(summary)
    typer.echo(f"results written to {out}")


@app.command("baseline")
def baseline(
    model: Optional[Path] = typer.Option(None, "--model", help="Source GGUF (default: embedded SmolLM2-135M Q4_1)."),
    out: Path = typer.Option(Path("baseline.json"), "--out", help="Where to write the results JSON."),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda (both lanes)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Threads for every recipe (default: CPU count)."),
    quick: bool = typer.Option(False, "--quick", help="Short prompts and outputs: a smoke run of a few minutes."),
) -> None:
    """Transformers/safetensors (fp32, bf16) vs whole-model llama.cpp (F32, Q8_0, Q4_1), side by side."""
    _check_out(out)
    from ..bench import baseline as bl
    from ..gguf.models import resolve_model

    src = resolve_model(model)
    cfg = bl.BaselineConfig.make(device=device, threads=threads, quick=quick)
    doc = bl.run_baseline(src, cfg)
    _write(out, doc, bl.summary(doc))
    if doc["failures"]:
        raise typer.Exit(1)


@app.command("contract")
def contract(
    results: Path = typer.Argument(..., help="A `dgr bench baseline` results JSON."),
    out: Path = typer.Option(Path("performance-contract.json"), "--out", help="Where to write the contract."),
) -> None:
    """Write a performance contract from baseline results (`dgr accept DGR-001` does this)."""
    _check_out(out)
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
    split: str = typer.Option("0:15,15:30", "--split",
                              help="Shard ranges of the route (with --hosts, unless given: balanced by weights per stage)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Threads for every side (default: CPU count)."),
    n_prompt: int = typer.Option(128, "--n-prompt", min=1, max=32768),
    n_gen: int = typer.Option(64, "--n-gen", min=1, max=32768),
    repeats: int = typer.Option(3, "--repeats", min=1, max=50),
    rpc: bool = typer.Option(True, "--rpc/--no-rpc",
                             help="Also measure llama.cpp's RPC split (two local rpc-servers; builds them once)."),
    llama_server: bool = typer.Option(True, "--llama-server/--no-llama-server",
                                      help="Also stream the same prompts from llama-server (whole model): its "
                                           "inter-token latency next to the route's."),
    out: Path = typer.Option(Path("route-bench.json"), "--out", help="Where to write the results JSON."),
    hosts: int = typer.Option(0, "--hosts", min=0, help="Run the route over N simulated hosts (`dgr lab`, 1 core/1 thread "
                              "each, mTLS) against one such host; 0: the local route on this machine's cores."),
    rtt_ms: str = typer.Option("0,10", "--rtt-ms", help="With --hosts: added round trips to measure, ms (comma-separated)."),
    sessions: str = typer.Option("1,4,8", "--sessions", help="With --hosts: concurrent session counts."),
    long_prompt: int = typer.Option(512, "--long-prompt", min=1, max=32768, help="With --hosts: the prompt of the prefill comparison."),
    pipeline_groups: Optional[int] = typer.Option(
        None, "--pipeline-groups", min=0, max=16,
        help="With --hosts: the route workers' --pipeline-groups (default: theirs, auto = one per host)."),
    keep_warm_ms: int = typer.Option(
        50, "--keep-warm-ms", min=0, max=10000,
        help="With --hosts: the route workers' --keep-warm-ms (keep each host's core awake between "
             "batches; 0: off)."),
    rate_mbit: Optional[float] = typer.Option(None, "--rate-mbit", min=0.001, max=100000.0,
                                              help="With --hosts: shape every host's link to "
                                              "this rate (tc tbf, as `dgr lab up --rate-mbit`)."),
) -> None:
    """Route vs whole-model llama.cpp (llama-bench, llama-batched-bench), same run and threads; --hosts N: across
    simulated hosts."""
    _check_out(out)
    from ..bench import route as rb
    from ..errors import DgrError
    from ..gguf.models import resolve_model
    from ..route.local import parse_split

    if rate_mbit is not None and not hosts:
        raise DgrError("--rate-mbit goes with --hosts (links between simulated hosts)")
    if hosts:
        from ..lab import bench as hb
        from ..lab.bench_report import summary as hosts_summary

        try:
            rtts = tuple(float(x) for x in rtt_ms.split(",") if x.strip())
            levels = tuple(int(x) for x in sessions.split(",") if x.strip())
        except ValueError:
            raise DgrError("--rtt-ms and --sessions take comma-separated numbers") from None
        split_given = split != "0:15,15:30"
        hcfg = hb.HostsBenchConfig(hosts=hosts, split=tuple(parse_split(split)) if split_given else None,
                                   n_prompt=n_prompt, n_gen=n_gen, long_prompt=long_prompt, sessions=levels,
                                   rtts_ms=rtts, repeats=repeats, rpc=rpc, pipeline_groups=pipeline_groups,
                                   keep_warm_ms=keep_warm_ms, rate_mbit=rate_mbit)
        hcfg.validate()
        doc = hb.run_hosts_bench(resolve_model(model), hcfg)
        _write(out, doc, hosts_summary(doc))
        return

    cfg = rb.RouteBenchConfig(split=tuple(parse_split(split)), threads=threads or 0, n_prompt=n_prompt,
                              n_gen=n_gen, repeats=repeats, rpc=rpc, llama_server=llama_server)
    doc = rb.run_route_bench(resolve_model(model), cfg)
    _write(out, doc, rb.summary(doc))


@app.command("plan")
def plan_bench(
    model: Optional[str] = typer.Option(None, "--model", help="GGUF file, or a packaged model (default: the embedded "
                                        "SmolLM2-135M Q4_1)."),
    cpu_quota: str = typer.Option("-;0.5", "--cpu-quota", help="One value per lab host, ';'-separated: its CPU time "
                                  "in cores (cgroup cpu quota), '-' for the whole core; 2..8 hosts."),
    sessions: str = typer.Option("1,8", "--sessions", help="Concurrent session counts (comma-separated)."),
    n_prompt: int = typer.Option(64, "--n-prompt", min=1, max=4096),
    n_gen: int = typer.Option(48, "--n-gen", min=1, max=4096),
    repeats: int = typer.Option(3, "--repeats", min=1, max=20),
    probe_budget_s: float = typer.Option(5.0, "--probe-budget-s", min=0.5, max=600.0,
                                         help="Time each host's capability probe may take."),
    compare: Optional[str] = typer.Option(None, "--compare", help="Also run this hand-chosen split over every "
                                          "host, in order (e.g. 0:19,19:30)."),
    cpus: Optional[str] = typer.Option(None, "--cpus", help="CPU set per host, ';'-separated (e.g. '0;1;1': h2 and "
                                       "h3 share CPU 1, and the planner is told so); default one core each."),
    out: Path = typer.Option(Path("plan-bench.json"), "--out", help="Where to write the results JSON."),
) -> None:
    """The planned split (dgr plan, from each lab host's own probe) against the even split and the
    first host alone, on lab hosts of unequal CPU quota; measured next to predicted, every repeat."""
    _check_out(out)
    from ..errors import DgrError
    from ..gguf.models import resolve_model
    from ..lab.config import per_host
    from ..lab.plan_bench import PlanBenchConfig, run_plan_bench, summary

    all_q, each_q = per_host(cpu_quota, "--cpu-quota", float)
    if each_q is None:
        raise DgrError("--cpu-quota needs one value per host, ';'-separated (e.g. '-;0.5')")
    try:
        levels = tuple(int(x) for x in sessions.split(",") if x.strip())
    except ValueError:
        raise DgrError("--sessions takes comma-separated numbers") from None
    from ..route.local import parse_split

    cfg = PlanBenchConfig(cpu_quota=tuple(each_q), sessions=levels, n_prompt=n_prompt, n_gen=n_gen,
                          repeats=repeats, probe_budget_s=probe_budget_s,
                          compare=tuple(parse_split(compare)) if compare else None,
                          cpus=tuple(c.strip() for c in cpus.split(";")) if cpus else None)
    cfg.validate()
    doc = run_plan_bench(resolve_model(model), cfg)
    _write(out, doc, summary(doc))


@app.command("replicas")
def replicas_bench(
    model: Optional[str] = typer.Option(None, "--model", help="GGUF file, or a packaged model (default: the embedded "
                                        "SmolLM2-135M Q4_1)."),
    concurrency: int = typer.Option(16, "--concurrency", min=2, max=64, help="Concurrent streaming requests."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, max=1024, help="Tokens per answer (at least 2: decode is timed after the first)."),
    repeats: int = typer.Option(3, "--repeats", min=1, max=20),
    out: Path = typer.Option(Path("replicas-bench.json"), "--out", help="Where to write the results JSON."),
) -> None:
    """Two whole-model replicas on two lab hosts behind one gateway (dgr serve --route twice) against
    one replica, at --concurrency streaming requests; the gateway pinned with h1; every repeat."""
    _check_out(out)
    from ..bench.replicas import ReplicaBenchConfig, run_replica_bench, summary
    from ..gguf.models import resolve_model

    cfg = ReplicaBenchConfig(concurrency=concurrency, max_tokens=max_tokens, repeats=repeats)
    cfg.validate()
    doc = run_replica_bench(resolve_model(model), cfg)
    _write(out, doc, summary(doc))


@app.command("relay")
def relay_bench(
    model: Optional[str] = typer.Option(None, "--model", help="GGUF file, or a packaged model (default: the embedded "
                                        "SmolLM2-135M Q4_1)."),
    split: Optional[str] = typer.Option(None, "--split", help="Two ranges START:END,START:END, head on h1 and tail "
                                        "on h2 (default: two even halves)."),
    sessions: int = typer.Option(8, "--sessions", min=1, max=64, help="Concurrent greedy sessions per lane."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, max=1024, help="Tokens per session (at least 2: decode "
                                   "is timed after the first)."),
    repeats: int = typer.Option(3, "--repeats", min=1, max=20),
    stepwise_lane: bool = typer.Option(False, "--stepwise-lane", help="Also drive the relayed route stepwise."),
    out: Path = typer.Option(Path("relay-bench.json"), "--out", help="Where to write the results JSON."),
) -> None:
    """A route whose hops all go through relays (chained, through a relay egress) against the same
    workers chained directly, on two lab hosts, at --sessions; the driver pinned with h1; every repeat."""
    _check_out(out)
    from ..bench.relay import RelayBenchConfig, run_relay_bench, summary
    from ..gguf.models import resolve_model
    from ..route.local import parse_split

    rng = tuple(parse_split(split)) if split else ()
    cfg = RelayBenchConfig(sessions=sessions, max_tokens=max_tokens, repeats=repeats, stepwise_lane=stepwise_lane,
                           split=rng)
    cfg.validate()
    doc = run_relay_bench(resolve_model(model), cfg)
    _write(out, doc, summary(doc))


@app.command("gate")
def gate(
    model: Optional[Path] = typer.Option(None, "--model", help="Source GGUF (default: embedded SmolLM2-135M Q4_1)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Threads per shard (default: CPU count - 1)."),
    quick: bool = typer.Option(False, "--quick", help="Short prompts and outputs: a smoke run."),
    repeats: Optional[int] = typer.Option(None, "--repeats", min=1, max=9,
                                          help="Repeats of the speed section, judged on each metric's median "
                                               "(default 3; 1 with --quick)."),
    contract: Path = typer.Option(Path("evidence/DGR-001/performance-contract.json"), "--contract",
                                  help="The locked DGR-001 contract the GGUF routes are judged against."),
    out: Path = typer.Option(Path("gate.json"), "--out", help="Where to write the measurements JSON."),
) -> None:
    """The release gate without evidence: safetensors route vs GGUF F32/Q8_0/Q4_1 routes (needs the baseline extra)."""
    _check_out(out)
    from ..bench import contract as bc
    from ..bench import gate as g
    from ..bench import gate_judge as gj
    from ..gguf.models import resolve_model

    c = bc.load_contract(contract)
    doc = g.run_gate(resolve_model(model), g.GateConfig.make(threads=threads, quick=quick, repeats=repeats))
    out.write_text(json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n")
    judged = gj.judge(c, {n: gj.results_for(doc, n) for n in g.GGUF_ROUTES})
    paired = gj.paired_repeats(c, doc)
    for n, j in judged.items():
        fails = [v["id"] for v in j["verdicts"] if v["status"] == "fail"]
        typer.echo(f"{n}: stop condition {j['stop_condition']['status']}; "
                   + ("every threshold met" if not fails else "missed " + ", ".join(fails)))
        for tid, v in paired[n].items():
            reps = "/".join("n/a" if x is None else f"{x:.3f}" for x in v["repeats"])
            judged_v = "n/a" if v["judged"] is None else f"{v['judged']:.3f}"
            typer.echo(f"  {tid}: {judged_v} (medians; repeats {reps}; {v['op']} {v['bound']:g})")
    rec = gj.recommend(judged, doc)
    typer.echo(f"recommendation: {rec['decision'].upper()}: {rec['text']}")
    typer.echo(f"measurements written to {out}")


@app.command("numerics")
def numerics(
    model: list[str] = typer.Option(..., "--model", help="GGUF file, packaged model or synthetic:PRESET[:DTYPE] "
                                    "(repeat for several)."),
    tokens: int = typer.Option(2048, "--tokens", min=2, max=131072, help="Random token ids scored in one chunk."),
    threads: int = typer.Option(2, "--threads", min=1),
    seed: int = typer.Option(0, "--seed", min=0),
    out: Path = typer.Option(Path("numerics.json"), "--out", help="Where to write the results JSON."),
) -> None:
    """Are a model's activations finite over a long prompt? Whole-model llama.cpp scores --tokens
    seeded random ids in one chunk; any NaN or infinity reaches a position's log-likelihood.
    Meant for synthetic (random-weight) models, whose residual stream can overflow where trained
    weights do not. Exit 1 when any model is not finite."""
    _check_out(out)
    import os
    import tempfile
    import time

    from ..bench.numerics import check_numerics
    from ..gguf.inspect import open_gguf
    from ..gguf.models import resolve_model

    rows = []
    load_before = list(os.getloadavg())
    for name in model:
        path = resolve_model(name)
        with open_gguf(path) as gf:
            desc = str(gf.get("general.description", ""))
            n_layer = gf.n_layer
        typer.echo(f"scoring {tokens} random tokens with {path.name} ({n_layer} layers) ...", err=True)
        t = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="dgr-numerics-") as work:
            r = check_numerics(path, n_tokens=tokens, threads=threads, seed=seed, work=Path(work))
        rows.append({**r.to_json(), "path": str(path), "bytes": path.stat().st_size, "n_layer": n_layer,
                     "synthetic": "synthetic" in desc.lower(), "seconds": round(time.monotonic() - t, 1)})
    doc = {"bench": "numerics", "tokens": tokens, "threads": threads, "seed": seed, "results": rows,
           "all_finite": all(r["finite"] for r in rows),
           "host": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": list(os.getloadavg())}}
    lines = [f"{r['model']}: {'finite' if r['finite'] else 'NOT FINITE'}, {r['n_scored']} positions scored, "
             f"{r['nll_per_token'] if r['finite'] else float('nan'):.3f} nats/token ({r['seconds']} s)"
             for r in rows]
    _write(out, doc, "\n".join(lines))
    if not doc["all_finite"]:
        raise typer.Exit(1)


@app.command("worker")
def worker(
    model: Optional[Path] = typer.Option(None, "--model", help="GGUF file (default: embedded SmolLM2-135M Q4_1)."),
    sessions: str = typer.Option("1,2,4,8", "--sessions", help="Concurrent session counts."),
    threads: int = typer.Option(2, "--threads", min=1),
    n_prompt: int = typer.Option(32, "--n-prompt", min=1, max=32768),
    n_gen: int = typer.Option(64, "--n-gen", min=1, max=32768),
    repeats: int = typer.Option(3, "--repeats", min=1, max=50),
    out: Path = typer.Option(Path("worker-bench.json"), "--out", help="Where to write the results JSON."),
) -> None:
    """One dgr-worker (whole model): aggregate decode tok/s per session count next to llama-batched-bench."""
    _check_out(out)
    from .. import paths
    from ..bench import worker as wb
    from ..gguf.models import resolve_model

    levels = tuple(int(x) for x in sessions.split(",") if x.strip())
    cfg = wb.WorkerBenchConfig(levels=levels, prompt_tokens=n_prompt, gen_tokens=n_gen, threads=threads,
                               repeats=repeats)
    from ..upstream.build import worker_binary

    bin_dir = paths.backend_build_dir("cpu") / "bin"
    # the worker measured is the one every command runs ($DGR_WORKER_BIN, else the build's)
    doc = wb.run_worker_bench(resolve_model(model), cfg, worker_bin=worker_binary("cpu"),
                              batched_bench=bin_dir / "llama-batched-bench")
    _write(out, doc, wb.summary(doc))


@app.command("serve")
def serve(
    model: Optional[Path] = typer.Option(None, "--model", help="GGUF file (default: embedded SmolLM2-135M Q4_1)."),
    split: Optional[str] = typer.Option(None, "--split", help="The 2-shard route (default: the model's layers halved)."),
    levels: str = typer.Option("1,4,8", "--levels", help="Concurrent streaming requests per level."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Threads for every worker and llama-server "
                                          "(default: CPU count - 1, at least 1: the load generator and the "
                                          "gateway need a core)."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, help="Tokens per answer (generated through EOS)."),
    repeats: int = typer.Option(2, "--repeats", min=1, max=50, help="Requests per lane and level, as a multiple of the "
                                "top level (rotations: repeats x top / level; medians reported)."),
    llama_server: bool = typer.Option(True, "--llama-server/--no-llama-server",
                                      help="Run the llama-server lane (built on first use)."),
    prompt: Optional[list[str]] = typer.Option(
        None, "--prompt", help="A user message (repeat for several; cycled to each level's requests). Default: "
                               "four short questions. For the streaming cadence give prompts whose answers outlast "
                               "--max-tokens (docs/serve.md)."),
    out: Path = typer.Option(Path("serve-bench.json"), "--out", help="Where to write the results JSON."),
) -> None:
    """dgr serve vs the route driver called directly and vs llama-server (-np = top level), one run:
    1/4/8 concurrent streaming chat requests (an OpenAI-API load generator on httpx); JSON with every number."""
    _check_out(out)
    from ..errors import DgrError
    from ..bench import serve as sb
    from ..gguf.models import resolve_model
    from ..route.local import parse_split

    try:
        lv = tuple(int(x) for x in levels.split(",") if x.strip())
    except ValueError:
        raise DgrError(f"bad --levels {levels!r}", hint="e.g. 1,4,8") from None
    if not lv or min(lv) < 1 or repeats < 1 or max_tokens < 2:
        raise DgrError("--levels must be positive, --repeats >= 1, --max-tokens >= 2")
    if prompt is not None and not all(p.strip() for p in prompt):
        raise DgrError("--prompt must not be empty")
    cfg = sb.ServeBenchConfig(split=tuple(parse_split(split)) if split else (), levels=lv, threads=threads or 0,
                              max_tokens=max_tokens, repeats=repeats, llama_server=llama_server,
                              prompts=tuple(prompt or ()))
    doc = sb.run_serve_bench(resolve_model(model), cfg)
    _write(out, doc, sb.summary(doc))
