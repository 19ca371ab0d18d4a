"""DGR-019: larger than any one host, at realistic size (SYNTHETIC weights).

An 8B-shaped Q4_K_M (the `llama-3.1-8b` preset: Llama 3.1 8B's exact shapes, random weights,
about 4.6 GiB) is served by simulated hosts whose memory limits refuse the whole model on any
one of them (the refusal is shown), with mTLS on every hop:
- 2 hosts, each holding only its own slice: 4 concurrent sessions, greedy tokens identical to
  the whole model on an unlimited host (no memory limit, outside the lab), and what each host
  mapped and read from storage;
- 3 hosts (h3 shares h1's core);
- the same 2-host route behind `dgr serve`, asked with the official `openai` client;
- the same model as a 3-part split GGUF set (llama.cpp's gguf-split format): one artifact id,
  and a 2-host route whose workers load their ranges from the set.
Sizes, per-host peak RSS and KV, load time, TTFT and tokens/s are recorded. Every figure here
comes from synthetic weights: it measures memory and speed at a realistic shape and certifies
no recipe.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ... import childproc
from ..evidence import StoryContext, story
from .dgr011 import _tokenize  # one prompt tokenizer for the route stories

N_PREDICT = 16
CTX = 512
SESSIONS = 4
HOST_MEMORY_MB = 3584     # per host: the whole 8B-shaped model (4.6 GiB of weights) cannot fit, half of it can
# Exact parity needs the same batch shapes on both sides: with this CPU's K-quant kernels a row's
# result moves by rounding with the rows computed beside it (docs/realistic-size.md), and a
# chained head cuts a prompt into pipelined pieces. The parity routes therefore prefill each
# prompt in one piece (--pipeline-groups 1), as the whole model does; concurrency is judged as in
# DGR-011, against each session run alone.
PARITY_ARGS = ("--pipeline-groups", "1")
PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
          "combined movable metal type, oil-based ink and a wooden screw press into a system that")


def _files_and_io(pid: int, names: set[str]) -> dict[str, Any]:
    """Which model files a worker has mapped (bytes of address space), the bytes of each it has
    faulted in (resident), and its read() bytes (rchar) and storage reads (read_bytes: zero when
    the file was in the page cache)."""
    resident: dict[str, int] = {}
    mapped: dict[str, int] = {}
    try:
        cur = None
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's first line
                cur = Path(head[5]).name if len(head) >= 6 and Path(head[5]).name in names else None
                if cur:
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    mapped[cur] = mapped.get(cur, 0) + hi - lo
                    resident.setdefault(cur, 0)
            elif cur and head and head[0] == "Rss:":
                resident[cur] += int(head[1]) * 1024
        io = dict(x.split(": ") for x in Path(f"/proc/{pid}/io").read_text().splitlines())
        return {"mapped_model_files": dict(sorted(resident.items())), "mapped_bytes": dict(sorted(mapped.items())),
                "read_bytes": int(io["read_bytes"]), "rchar": int(io["rchar"])}
    except (OSError, ValueError, KeyError) as exc:
        return {"error": str(exc)}


def _parts_of_range(parts: list[Path], start: int, end: int, n_layer: int) -> set[str]:
    """The names of the parts of a split set that hold a tensor of layers [start, end) (the
    token embedding for the head, the output matrix and norm for the tail, and the embedding for
    a tail whose output is tied to it, and the shared tensors every range creates)."""
    from ...gguf.inspect import open_gguf

    names: dict[str, list[str]] = {}
    for p in parts:
        with open_gguf(p) as gf:
            names[p.name] = [t.name for t in gf.tensors]
    tied = not any(n == "output.weight" for ns in names.values() for n in ns)
    head, tail = start == 0, end == n_layer

    def held(n: str) -> bool:
        if n.startswith("blk."):
            return start <= int(n.split(".")[1]) < end
        if n.startswith("token_embd."):
            return head or (tail and tied)
        if n.startswith(("output.", "output_norm.")):
            return tail
        return True  # shared tensors (llama: rope_freqs.weight) are created by every range

    return {p for p, ns in names.items() if any(held(n) for n in ns)}


async def _generate(endpoints, toks, *, n, tls):
    from ...route.driver import RouteDriver, Sampling

    d = await RouteDriver(endpoints, timeout=600, tls=tls).connect()
    try:
        res = await asyncio.gather(*(d.generate(p, max_tokens=n, sampling=Sampling(ignore_eog=True),
                                                stop_on_eog=False) for p in toks))
        return res, d.mode
    finally:
        await d.close()


def _gateway(ctx: StoryContext, endpoints: list[str], tls, name: str) -> tuple[subprocess.Popen, str]:
    """`dgr serve --shard …` over running workers (mTLS to the head when ``tls``), on a free port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "dgr.main", "serve", "--port", str(port), "--model-name", name]
    for ep in endpoints:
        argv += ["--shard", ep]
    if tls is not None:
        argv += ["--shard-tls-ca", str(tls.ca), "--shard-tls-cert", str(tls.cert), "--shard-tls-key", str(tls.key)]
    ctx.commands.append("$ " + " ".join(argv[2:]).replace("dgr.main", "dgr"))
    p = childproc.popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    end = time.monotonic() + 120
    while time.monotonic() < end:
        if p.poll() is not None:
            raise RuntimeError(f"dgr serve exited: {(p.stderr.read() if p.stderr else b'').decode()[-400:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return p, url
        except OSError:
            time.sleep(0.2)
    p.kill()
    raise RuntimeError("dgr serve did not answer /health within 120 s")


def _ask(url: str, name: str, prompt: str, n: int) -> dict[str, Any]:
    """The same greedy question, once whole and once streamed, with the official openai client."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", timeout=600)
    msgs = [{"role": "user", "content": prompt}]
    t0 = time.monotonic()
    r = client.chat.completions.create(model=name, messages=msgs, max_tokens=n, temperature=0)
    whole_s = time.monotonic() - t0
    parts, first = [], None
    t0 = time.monotonic()
    for chunk in client.chat.completions.create(model=name, messages=msgs, max_tokens=n, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.monotonic() - t0
            parts.append(chunk.choices[0].delta.content)
    return {"text": r.choices[0].message.content, "stream_text": "".join(parts),
            "completion_tokens": r.usage.completion_tokens if r.usage else None,
            "finish_reason": r.choices[0].finish_reason, "seconds": round(whole_s, 2),
            "stream_ttft_s": round(first or 0.0, 3), "models": [m.id for m in client.models.list().data]}


@story("DGR-019", "Larger than any one host at realistic size: an 8B-shaped Q4_K_M (synthetic weights) over 2 and "
       "3 lab hosts, through the gateway, and as a split GGUF set", lane="multi-host-simulated", needs_model=True,
       default_model="synthetic:llama-3.1-8b")
def run(ctx: StoryContext) -> None:
    from ...errors import DgrError
    from ...gguf.identity import identify
    from ...gguf.inspect import open_gguf
    from ...lab import system as sx
    from ...lab.hosts import Lab, LabConfig
    from ...lab.route import LabRoute
    from ...route.local import LocalRoute, ensure_worker
    from ...route.driver import Sampling
    from ...route.parity import compare, isolation
    from ...route.run import _sequential
    from ...route.sessions import DEFAULT_PROMPTS, run_sessions

    assert ctx.model is not None
    model = ctx.model
    reason = sx.preflight()
    if reason:
        ctx.check("simulated hosts can be created on this machine", False, reason)
        return
    ensure_worker(ctx.backend)
    from ...gguf.synth import synthetic_description

    t0 = time.monotonic()
    ident = identify(model, progress=True)
    with open_gguf(model) as gf:
        n_layer = gf.n_layer
        desc = str(gf.get("general.description", ""))
        shape = {k: gf.hparam(k) for k in ("embedding_length", "feed_forward_length", "attention.head_count",
                                            "attention.head_count_kv", "context_length", "rope.freq_base")}
        shape["vocab_size"] = len(gf.get("tokenizer.ggml.tokens") or [])
        shape["n_layer"] = n_layer
    ctx.results["model"] = {"file": str(model), "bytes": model.stat().st_size, "artifact_id": ident.artifact_id,
                            "description": desc, "shape": shape, "identify_seconds": round(time.monotonic() - t0, 1),
                            "weights": "SYNTHETIC (random, seeded): measures memory and speed, certifies nothing"}
    ctx.check("the model is a realistic-size synthetic: an 8B-class shape of at least 4 GiB, labelled synthetic in "
              "its own metadata",
              model.stat().st_size >= 4 << 30 and synthetic_description(model) is not None
              and shape["vocab_size"] >= 32000
              and n_layer >= 32 and (shape["embedding_length"] or 0) >= 4096,
              f"{model.name}: {model.stat().st_size / 2**30:.2f} GiB, {n_layer} layers, n_embd "
              f"{shape['embedding_length']}, {shape['attention.head_count']}/{shape['attention.head_count_kv']} "
              f"heads, vocabulary {shape['vocab_size']}; description: {desc[:90]}")

    half = n_layer // 2
    split2 = [(0, half), (half, n_layer)]
    third = n_layer // 3
    split3 = [(0, third), (third, 2 * third), (2 * third, n_layer)]
    cfg = LabConfig(hosts=3, name="acc19", cores_per_host=1, threads=1, memory_mb=HOST_MEMORY_MB)
    ctx.record_command(f"dgr lab up --hosts 3 --name acc19 --threads 1 --memory-mb {HOST_MEMORY_MB}")
    slices = ctx.tmp / "slices"
    lab = Lab.up(cfg)
    try:
        with lab:
            ctx.results["lab"] = {"hosts": lab.state["hosts"], "cgroup_mode": lab.state["cgroup_mode"]}

            # -- the whole model is refused on any one host ----------------------------------------
            refusals = {}
            for name in ("h1", "h2"):
                t = time.monotonic()
                try:
                    with LabRoute(lab, model, [(0, n_layer)], placement=[name], slices=False, max_sessions=SESSIONS,
                                  ctx_per_session=CTX):
                        refusals[name] = {"result": "STARTED"}
                except DgrError as exc:
                    refusals[name] = {"result": exc.one_line()[-400:], "seconds": round(time.monotonic() - t, 1)}
            ctx.results["whole_model_refusals"] = refusals
            ctx.check("the whole model is refused on either host under its memory limit, with the figures",
                      all(v["result"] != "STARTED" and "budget" in v["result"].lower() for v in refusals.values()),
                      "; ".join(f"{k} ({v.get('seconds', '?')} s): {v['result'][-260:]}" for k, v in refusals.items()))

            # -- the whole model on an unlimited host (outside the lab): the reference ------------
            prompts = list(DEFAULT_PROMPTS)[:SESSIONS]
            with LocalRoute(model, [(0, n_layer)], threads=1, max_sessions=SESSIONS, ctx_per_session=CTX) as whole:
                ptoks = asyncio.run(_tokenize(whole.endpoints[0], [PROMPT], chat=False))
                chat = asyncio.run(_tokenize(whole.endpoints[0], prompts, chat=True))
                t = time.monotonic()
                (r_whole,), _ = asyncio.run(_generate(whole.endpoints, ptoks, n=N_PREDICT, tls=None))
                whole_s = time.monotonic() - t
                wseq = asyncio.run(_sequential(whole.endpoints, prompts, "whole (sequential)", max_tokens=N_PREDICT,
                                               sampling=Sampling(top_logprobs=5)))
                gw, url = _gateway(ctx, whole.endpoints, None, "whole")
                try:
                    ans_whole = _ask(url, "whole", prompts[0], N_PREDICT)
                finally:
                    gw.terminate()
                    gw.wait(30)
            ctx.results["whole"] = {"tokens": r_whole.tokens, "seconds": round(whole_s, 2),
                                    "sequential": wseq.to_json(), "gateway_answer": ans_whole}

            # -- 2 hosts, each holding only its slice: 4 sessions over mTLS ------------------------
            t = time.monotonic()
            with LabRoute(lab, model, split2, placement=["h1", "h2"], max_sessions=SESSIONS, ctx_per_session=CTX,
                          slice_dir=slices, extra_args=PARITY_ARGS) as lr:
                load_s = time.monotonic() - t
                tls = lr.tls
                placed = lr.describe()
                for p in placed:
                    ctx.commands.append(f"$ {p['command']}\n# worker [{p['range']}) in {p['host']}, pid {p['pid']}")
                names = {f.name for f in lr.files} | {model.name}
                io = {p.host.name: _files_and_io(p.worker.pid, names) for p in lr.placed}
                (r2,), mode = asyncio.run(_generate(lr.endpoints, ptoks, n=N_PREDICT, tls=tls))
                seq = asyncio.run(_sequential(lr.endpoints, prompts, "route (sequential)", max_tokens=N_PREDICT,
                                              sampling=Sampling(top_logprobs=5), tls=tls))
                conc = asyncio.run(run_sessions(lr.endpoints, prompts, token_prompts=chat, stats=lr.stats(),
                                                pids=[w.pid for w in lr.workers], label="route 2 hosts",
                                                max_tokens=N_PREDICT, tls=tls, timeout=600,
                                                sampling=Sampling(top_logprobs=5)))
                par = compare(seq, wseq)
                iso = isolation(conc, seq)
                io_after = {p.host.name: _files_and_io(p.worker.pid, names) for p in lr.placed}
                gw, url = _gateway(ctx, lr.endpoints, tls, "route")
                try:
                    ans_route = _ask(url, "route", prompts[0], N_PREDICT)
                finally:
                    gw.terminate()
                    gw.wait(30)
                slice_bytes = {f.name: f.stat().st_size for f in lr.files}
            rep = conc.to_json()
            ws = rep["workers"]
            ctx.results["route2"] = {
                "split": [f"{a}:{b}" for a, b in split2], "placement": placed, "mode": mode,
                "start_seconds": round(load_s, 1), "slice_bytes": slice_bytes,
                "io_after_load": io, "io_after_run": io_after, "tokens": r2.tokens, "report": rep,
                "parity_sequential_vs_whole": par.to_json(), "isolation_concurrent_vs_sequential": iso.to_json(),
                "gateway_answer": ans_route}
            ctx.check(f"2 hosts (each under its {HOST_MEMORY_MB} MiB limit, mTLS on every hop): prefill and "
                      f"{N_PREDICT} greedy tokens identical to the whole model on an unlimited host",
                      r2.error is None and r2.tokens == r_whole.tokens and len(r2.tokens) == N_PREDICT,
                      f"{mode} route {split2}; {sum(a == b for a, b in zip(r2.tokens, r_whole.tokens))}/{N_PREDICT} "
                      f"tokens identical")
            ctx.check(f"{SESSIONS} concurrent sessions over the 2-host route: every session completes and passes "
                      "isolation; each session alone is identical to the whole model alone",
                      rep["ok"] and par.ok and iso.ok
                      and len(rep["sessions"]) == len(seq.sessions) == len(wseq.sessions) == SESSIONS,
                      f"alone: {par.matched_sessions}/{SESSIONS} identical to the whole model; concurrent: "
                      f"{iso.identical}/{SESSIONS} identical to alone, {iso.near_tie_divergences} near-tie "
                      f"{iso.violations or ''}; aggregate decode "
                      f"{rep['aggregate_decode_tok_s']:.2f} tok/s; TTFT {[round(s['ttft_s'], 2) for s in rep['sessions']]} s; "
                      f"peak RSS {[round(w['rss_peak_bytes'] / 2**20) for w in ws]} MiB; KV peak "
                      f"{[round(w['kv_peak_bytes'] / 2**20) for w in ws]} MiB")
            own = all(set(v.get("mapped_model_files", {})) == {f"{model.stem}.{a}-{b}.gguf"}
                      for v, (a, b) in zip(io_after.values(), split2))
            touched = {k: sum(v.get("mapped_model_files", {}).values()) for k, v in io_after.items()}
            ctx.check("each host maps only its own slice (never the whole model) and faults in at most that slice's "
                      "bytes; its read() calls take only headers",
                      own and all(touched[k] <= b for k, b in zip(touched, slice_bytes.values()))
                      and all(v.get("rchar", 1 << 40) < 64 << 20 for v in io_after.values()),
                      f"mapped {json.dumps({k: list(v.get('mapped_model_files', {})) for k, v in io_after.items()})}; "
                      f"resident of the mapped file after the run {({k: round(v / 2**20) for k, v in touched.items()})} "
                      f"MiB against slices {({k: round(v / 2**20) for k, v in slice_bytes.items()})} MiB; read() "
                      f"{({k: round(v.get('rchar', 0) / 2**20, 1) for k, v in io_after.items()})} MiB")
            ctx.check("the same route behind `dgr serve`, asked with the official openai client (whole and "
                      "streamed), answers exactly what the gateway over the whole model answers",
                      ans_route["text"] == ans_route["stream_text"] == ans_whole["text"] and bool(ans_route["text"])
                      and ans_route["completion_tokens"] == N_PREDICT,
                      f"route: {ans_route['text']!r}; whole: {ans_whole['text']!r}; streamed TTFT "
                      f"{ans_route['stream_ttft_s']} s")

            # -- 3 hosts ---------------------------------------------------------------------------
            with LabRoute(lab, model, split3, placement=["h1", "h2", "h3"], max_sessions=SESSIONS,
                          ctx_per_session=CTX, slice_dir=slices, extra_args=PARITY_ARGS) as l3:
                (r3,), mode3 = asyncio.run(_generate(l3.endpoints, ptoks, n=N_PREDICT, tls=l3.tls))
                ws3 = l3.describe()
            ctx.results["route3"] = {"split": [f"{a}:{b}" for a, b in split3], "mode": mode3, "tokens": r3.tokens,
                                     "placement": ws3}
            ctx.check("3 hosts (h3 shares a core with h1): greedy tokens identical to the whole model",
                      r3.error is None and r3.tokens == r_whole.tokens and len(r3.tokens) == N_PREDICT,
                      f"{mode3} route {split3}; {sum(a == b for a, b in zip(r3.tokens, r_whole.tokens))}/"
                      f"{N_PREDICT} tokens identical")

            # -- the same model as a 3-part split set ----------------------------------------------
            _split_set_lane(ctx, lab, model, ident.artifact_id, split2, ptoks, r_whole.tokens)
    finally:
        down = lab.down() if lab.path.exists() else {"left": []}
    leftovers = [n for n in sx.netns_list() if n.startswith(f"{sx.NETNS_PREFIX}acc19-")]
    pids = [p["pid"] for p in lab.state.get("processes", []) if sx.alive(p["pid"])]
    ctx.results["teardown"] = {"left": down["left"] + leftovers, "live_pids": pids}
    ctx.check("the lab goes down cleanly: no namespace, link, cgroup or process left",
              not down["left"] and not leftovers and not pids,
              f"left: {down['left'] + leftovers or 'nothing'}; live processes: {pids or 'none'}")
    ctx.limitation("SYNTHETIC weights: random values in the exact shapes of Llama 3.1 8B (and a padded SentencePiece "
                   "vocabulary of the same size instead of its BPE tokenizer). Memory, speed and parity between the "
                   "route and the whole model are real; nothing here says anything about answer quality, and no "
                   "recipe is certified by it.")
    from ...route.parity import NEAR_TIE_NATS

    ctx.limitation("Isolation of the concurrent sessions tolerates a session that departs from its own run alone at "
                   f"a near-tie (top-1/top-2 gap <= {NEAR_TIE_NATS} nats); such a session is counted in the detail, "
                   "not failed. The parity checks compare greedy tokens only, not log-probabilities.")
    ctx.limitation("Simulated hosts share one machine's memory bus, caches and disk; each has one core (h3 shares "
                   "h1's). Speed figures are for that setting; `dgr bench route --hosts` judges throughput.")


def _split_set_lane(ctx: StoryContext, lab, model: Path, artifact_id: str, split, ptoks, whole_tokens) -> None:
    """Cut the model into 3 parts with the pinned llama-gguf-split; same artifact id; a route whose
    workers load their ranges from the set (each mapping only the parts its range needs)."""
    import asyncio as _asyncio

    from ...gguf.identity import identify
    from ...gguf.inspect import open_gguf
    from ...lab.route import LabRoute
    from ...upstream import build

    tool = build.tool_binary("llama-gguf-split", ctx.backend)
    out = ctx.tmp / "set" / model.stem
    out.parent.mkdir(parents=True, exist_ok=True)
    # exactly 3 parts: by tensor count (a size cap lands on tensor boundaries and can make 4)
    with open_gguf(model) as gf:
        n_tensors = len(gf.tensors)
    per_part = -(-n_tensors // 3)
    ctx.command([str(tool), "--split", "--split-max-tensors", str(per_part), str(model), str(out)], timeout=1200)
    parts = sorted(out.parent.glob(f"{model.stem}-*-of-*.gguf"))
    sid = identify(parts[0], progress=True).artifact_id if parts else ""
    ctx.results["split_set"] = {"parts": {p.name: p.stat().st_size for p in parts}, "artifact_id": sid}
    ctx.check("the 3-part split set has one artifact id, equal to the single file's",
              len(parts) == 3 and sid == artifact_id,
              f"{len(parts)} parts ({', '.join(f'{p.name} {p.stat().st_size / 2**30:.2f} GiB' for p in parts)}); "
              f"set id {sid[:16]}…, file id {artifact_id[:16]}…")
    names = {p.name for p in parts}
    with LabRoute(lab, parts[0], split, placement=["h1", "h2"], slices=False, max_sessions=4, ctx_per_session=CTX,
                  extra_args=PARITY_ARGS) as lr:
        (r,), mode = _asyncio.run(_generate(lr.endpoints, ptoks, n=N_PREDICT, tls=lr.tls))
        io = {p.host.name: _files_and_io(p.worker.pid, names) for p in lr.placed}
    ctx.results["split_set"].update({"route_tokens": r.tokens, "mode": mode, "io": io})
    ctx.check("a 2-host route loading its ranges from the split set reproduces the whole model's greedy tokens",
              r.error is None and r.tokens == whole_tokens and len(r.tokens) == N_PREDICT,
              f"{mode}; {sum(a == b for a, b in zip(r.tokens, whole_tokens))}/{N_PREDICT} identical")
    # after the run: a part that holds none of a host's tensors keeps at most the one partial page
    # llama_mmap::unmap_fragment rounds away, never touched; a part it needs is resident
    n_layer = split[-1][1]
    page = os.sysconf("SC_PAGE_SIZE")
    verdict = {}
    for (host, v), (a, b) in zip(io.items(), split):
        need = _parts_of_range(parts, a, b, n_layer)
        res, mp = v.get("mapped_model_files", {}), v.get("mapped_bytes", {})
        verdict[host] = {"range": f"{a}:{b}", "needs": sorted(need),
                         "ok": "error" not in v and all(res.get(n, 0) > 0 for n in need)
                         and all(mp.get(n, 0) <= page and res.get(n, 0) == 0 for n in names - need)}
    ctx.results["split_set"]["parts_per_host"] = verdict
    order = {p.name: i + 1 for i, p in enumerate(parts)}
    ctx.check("each host of the split-set route maps and touches only the parts that hold its range's tensors",
              len(verdict) == len(split) and all(x["ok"] for x in verdict.values()),
              "; ".join(f"{h} [{x['range']}) needs parts {[order[n] for n in x['needs']]}: resident "
                        f"{ {order[n]: round(b / 2**20, 1) for n, b in io[h].get('mapped_model_files', {}).items()} } MiB"
                        for h, x in verdict.items()))
