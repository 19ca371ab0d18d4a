"""`dgr lab`: simulated hosts on one machine (network namespaces, own CPUs, memory, shaped links)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import DgrError

app = typer.Typer(no_args_is_help=True)

NAME_HELP = "Lab name (1-6 lower-case letters/digits); several labs may be up at once."


_log = logging.getLogger(__name__).info   # progress lines on stderr (dgr.console: -v/-q)


@app.command("up")
def up(
    hosts: int = typer.Option(2, "--hosts", min=1, help="Number of simulated hosts (h1..hN)."),
    name: str = typer.Option("lab", "--name", help=NAME_HELP),
    cores_per_host: int = typer.Option(1, "--cores-per-host", min=1, help="CPUs per host, handed out round robin."),
    cpus: Optional[str] = typer.Option(None, "--cpus", help="Explicit CPU sets, one per host, ';'-separated (e.g. '0;1')."),
    threads: Optional[str] = typer.Option(None, "--threads", help="Compute threads per host (default: its CPU count); one value for all, or one per host ';'-separated (e.g. '2;1')."),
    memory_mb: Optional[str] = typer.Option(None, "--memory-mb", help="Memory limit per host in MiB (cgroup; workers get it as their budget); one value for all, or one per host ';'-separated, '-' for none."),
    cpu_quota: Optional[str] = typer.Option(None, "--cpu-quota", help="CPU time per host in cores (cgroup cpu quota, e.g. 0.5: half a core; a fast and a slow host: '1;0.4'); one value for all, or one per host ';'-separated, '-' for none."),
    rate_mbit: Optional[float] = typer.Option(None, "--rate-mbit", min=0.001, help="Link rate per host, Mbit/s (tc tbf, both directions)."),
    rtt_ms: float = typer.Option(0.0, "--rtt-ms", min=0.0, help="Round trip added on every connection into a host."),
    jitter_ms: float = typer.Option(0.0, "--jitter-ms", min=0.0, help="Round-trip jitter (uniform, order kept)."),
    loss: float = typer.Option(0.0, "--loss", min=0.0, max=0.999, help="Loss probability (proxy: a chunk delivered one RTO late)."),
    shaper: str = typer.Option("auto", "--shaper", help="Delay/jitter/loss by: auto (netem if the kernel has it, else the proxy), netem, proxy."),
    subnet: Optional[str] = typer.Option(None, "--subnet", help="A /24 inside 198.18.0.0/15 (default: derived from the name)."),
    as_json: bool = typer.Option(False, "--json", help="Print the lab state as JSON."),
) -> None:
    """Create simulated hosts; they stay up until `dgr lab down` (Ctrl-C during creation rolls back)."""
    from ..lab.config import per_host
    from ..lab.hosts import Lab, LabConfig

    threads_all, threads_each = per_host(threads, "--threads", int)
    memory_all, memory_each = per_host(memory_mb, "--memory-mb", int)
    quota_all, quota_each = per_host(cpu_quota, "--cpu-quota", float)
    cfg = LabConfig(hosts=hosts, name=name, cores_per_host=cores_per_host,
                    cpus=[c.strip() for c in cpus.split(";")] if cpus else None, threads=threads_all,
                    memory_mb=memory_all, rate_mbit=rate_mbit, rtt_ms=rtt_ms, jitter_ms=jitter_ms, loss=loss,
                    shaper=shaper, subnet=subnet, threads_per_host=threads_each, memory_mb_per_host=memory_each,
                    cpu_quota=quota_each if quota_each is not None else
                    (None if quota_all is None else [quota_all] * hosts))
    lab = Lab.up(cfg)
    if as_json:
        typer.echo(json.dumps(lab.status(), indent=2))
    else:
        typer.echo(f"lab {lab.name} is up ({len(lab.hosts)} hosts, state {lab.path}); "
                   f"run commands in a host with `dgr lab exec HOST -- CMD`, remove it with `dgr lab down --name {lab.name}`")


@app.command("down")
def down(
    name: Optional[str] = typer.Option(None, "--name", help="The lab to remove (default: every lab that is up)."),
    strays: bool = typer.Option(False, "--strays", help="Also remove dgr-lab-prefixed objects no state file accounts for."),
) -> None:
    """Remove everything a lab created: processes, namespaces, links, cgroups, certificates, state."""
    from ..lab.hosts import Lab
    from ..lab.strays import remove_strays, stray_objects

    names = [name] if name else Lab.names()
    left: list[str] = []
    for n in names:
        left += Lab.load(n).down()["left"]
    if strays:
        found = stray_objects()
        if any(found.values()):
            _log("removing strays: " + ", ".join(x for v in found.values() for x in v))
            left += remove_strays(found)
    if not names and not strays:
        typer.echo("no lab is up")
    if left:
        raise DgrError("some lab objects could not be removed: " + ", ".join(left))


@app.command("status")
def status(
    name: Optional[str] = typer.Option(None, "--name", help="The lab (default: every lab that is up)."),
    as_json: bool = typer.Option(False, "--json", help="JSON output."),
) -> None:
    """Show each lab's hosts (address, CPUs, memory, processes), shaping, proxies and what exists."""
    from ..lab.hosts import Lab
    from ..lab.strays import stray_objects

    docs = [Lab.load(n).status() for n in ([name] if name else Lab.names())]
    strays = stray_objects()
    if as_json:
        typer.echo(json.dumps({"labs": docs, "strays": strays}, indent=2))
        return
    if not docs:
        typer.echo("no lab is up")
    for d in docs:
        sh = d["shaping"] or {}
        typer.echo(f"lab {d['name']}: {d['subnet']} (driver side {d['gateway']} on {d['bridge']}"
                   f"{'' if d['bridge_present'] else ', MISSING'}), cgroups {d['cgroup_mode']}, "
                   f"rate {sh.get('rate_mbit') or '-'} Mbit/s ({sh.get('rate_mechanism')}), rtt {sh.get('rtt_ms')} ms, "
                   f"jitter {sh.get('jitter_ms')} ms, loss {sh.get('loss')} ({sh.get('delay_mechanism')}; netem "
                   f"{'available' if sh.get('netem_available') else 'absent'})")
        for h in d["hosts"]:
            typer.echo(f"  {h['name']}: {h['ip']} netns {h['netns']}{'' if h['netns_present'] else ' MISSING'}, CPUs "
                       f"{h['cpus']}, {h['threads']} thread(s), memory {h['memory_mb'] or '-'} MiB, "
                       f"{len(h['processes'])} process(es)")
            for p in h["processes"]:
                typer.echo(f"      {p['pid']} {p['cmd']}")
        for p in d["proxies"]:
            typer.echo(f"  link proxy {p.get('listen')} -> {p['target']}: {p.get('connections', 0)} connection(s), "
                       f"{p.get('bytes_up', 0)} B up, {p.get('bytes_down', 0)} B down")
    if any(strays.values()):
        typer.echo("strays (no state file; `dgr lab down --strays`): " + ", ".join(x for v in strays.values() for x in v))


@app.command("exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def exec_(
    host: str = typer.Argument(..., help="Host name (h1, h2, …)."),
    command: List[str] = typer.Argument(None, help="The command, after --."),
    name: str = typer.Option("lab", "--name", help=NAME_HELP),
) -> None:
    """Run a command inside a host: its namespace, CPU set and memory limit (exit code passed on)."""
    from ..lab.hosts import Lab

    code = Lab.load(name).exec(host, command or [])
    raise typer.Exit(code)


@app.command("ca")
def ca(
    host: List[str] = typer.Option(..., "--host", help="NAME=IP[,IP…] per machine (repeat)."),
    out: Path = typer.Option(Path("dgr-pki"), "--out", help="Directory for ca.pem, NAME.pem/.key, client.pem/.key."),
    days: int = typer.Option(7, "--days", min=1, help="Validity in days."),
) -> None:
    """The same as `dgr pki issue` (kept for existing scripts; use that on real machines)."""
    from .pki import issue_certificates

    issue_certificates(host, out, days)


@app.command("route")
def route(
    name: str = typer.Option("lab", "--name", help=NAME_HELP),
    model: Optional[Path] = typer.Option(None, "--model", help="GGUF file (default: embedded SmolLM2-135M Q4_1)."),
    split: str = typer.Option("0:15,15:30", "--split", help="Shard ranges; shard i runs on host h(i+1) (round robin). "
                              "'auto': each host probes itself and `dgr plan` chooses the hosts, their order, the "
                              "ranges and the pipeline groups for --sessions."),
    hosts: Optional[str] = typer.Option(None, "--hosts", help="Host of each shard, comma-separated (e.g. h1,h2,h1)."),
    prompt: str = typer.Option("Write a haiku about the sea.", "--prompt", help="The prompt."),
    sessions: int = typer.Option(1, "--sessions", min=1, max=256,
                                 help="Concurrent sessions with this prompt (a worker holds at most 256)."),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1, help="Tokens to generate per session."),
    relay: bool = typer.Option(False, "--relay", help="Reach every shard through a relay bridge in its host (relay framing, "
                               "TLS); each shard's predecessor dials it through a relay egress in its own host, so the "
                               "route stays chained."),
    stepwise: bool = typer.Option(False, "--stepwise", help="Drive the route stepwise (the driver relays every step) "
                                  "instead of chained."),
    parity: bool = typer.Option(False, "--parity", help="Also run the whole model on a local worker (outside the lab) and compare greedy tokens."),
    budget: bool = typer.Option(True, "--budget/--no-budget", help="Give each worker its host's memory budget."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Run a route whose workers live on the lab's hosts (mTLS on every hop) and report it."""
    import asyncio

    from ..lab.hosts import Lab
    from ..lab.route import LabRoute
    from ..gguf.models import resolve_model
    from ..route.local import LocalRoute, model_n_layer, parse_split
    from ..route.sessions import run_sessions

    lab = Lab.load(name)
    src = resolve_model(model)
    extra: tuple[str, ...] = ()
    plan_doc = None
    if split == "auto":
        if hosts:
            raise DgrError("--split auto places the shards itself; leave out --hosts")
        from ..route.autosplit import plan_lab

        auto = plan_lab(lab, src, sessions, budget=budget)
        rng, placement, plan_doc, split, extra = auto.ranges, auto.placement, auto.plan, auto.split, auto.worker_args()
        for line in auto.describe(sessions):
            _log(line)
    else:
        rng = parse_split(split)
        if rng[-1][1] != model_n_layer(src):
            raise DgrError(f"split {split} does not end at the model's last layer ({model_n_layer(src)})")
        placement = [h.strip() for h in hosts.split(",")] if hosts else None
    items = [prompt] * max(1, sessions)
    with LabRoute(lab, src, rng, placement=placement, relay=relay, memory_budget=budget,
                  max_sessions=max(4, sessions), extra_args=extra) as lr:
        eps = lr.relay_endpoints if relay else lr.endpoints
        rep = asyncio.run(run_sessions(eps, items, max_tokens=max_tokens, tls=lr.tls, stats=lr.stats(),
                                       hops=lr.relay_hops if relay else None, chain=False if stepwise else None,
                                       pids=[w.pid for w in lr.workers], label=f"lab route {split}"))
        placed = lr.describe()
    doc = {"lab": lab.name, "placement": placed, "route": rep.to_json()}
    if plan_doc is not None:
        doc["plan"] = plan_doc
    ok = rep.ok
    if parity:
        from ..route.driver import Sampling

        _log("whole model on a local worker (outside the lab) for parity")
        with LocalRoute(src, [(0, rng[-1][1])], threads=lab.hosts[0].threads, max_sessions=max(4, sessions)) as lw:
            whole = asyncio.run(run_sessions(lw.endpoints, [prompt], max_tokens=max_tokens,
                                                sampling=Sampling(), label="whole"))
        same = [s.tokens == whole.sessions[0].tokens for s in rep.sessions]
        doc["parity"] = {"whole_tokens": whole.sessions[0].tokens, "sessions_identical": same}
        ok = ok and all(same)
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        for s in rep.sessions:
            typer.echo(f"[{s.index}] " + (f"error: {s.error}" if s.error else
                       f"{len(s.tokens)} tokens, TTFT {s.ttft_s * 1e3:.0f} ms, decode {s.decode_tok_s:.1f} tok/s: "
                       + s.text.replace("\n", " ")[:120]))
        typer.echo(f"route {rep.mode} over " + ", ".join(f"[{p['range']}) {p['host']} {p['endpoint']}" for p in placed)
                   + f"; seam {rep.seam_bytes_per_decode_token:.0f} B/token")
        if parity:
            typer.echo(f"greedy parity vs whole model: {sum(doc['parity']['sessions_identical'])}/{len(rep.sessions)} "
                       "sessions identical")
    if not ok:
        raise typer.Exit(1)
