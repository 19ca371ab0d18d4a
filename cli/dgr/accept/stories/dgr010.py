"""DGR-010: local real-model two-process acceptance (SmolLM2-135M, route 0:15 | 15:30).

Two dgr-worker processes serve disjoint ranges of the certified artifact, each from its own
slice file (it holds only its tensors), and the Python route driver runs Route Sessions across
them over gRPC on loopback. The yardstick is the whole model on one dgr-worker (llama.cpp at the
same pin, same threads): the certified tolerance is exact (docs/patches.md), so prefill top-k
log-probabilities and >= 32 greedy tokens must be identical.
"""

from __future__ import annotations

import asyncio
import os
import re
import time

from ..evidence import StoryContext, story

SPLIT = [(0, 15), (15, 30)]
N_PREDICT = 32
PARITY_PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
                 "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
                 "produce books far faster than any scribe. Within a few decades printing shops had spread to "
                 "most of the major cities of Europe, and the cost of books fell sharply. Historians still argue "
                 "about the consequences, but most agree that")
_BUF = re.compile(r"(CPU_Mapped|CPU) model buffer size\s*=\s*([\d.]+) MiB")
_KV = re.compile(r"llama_kv_cache.*size\s*=\s*([\d.]+) MiB")


def _stderr_figures(lines: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for ln in lines:
        m = _BUF.search(ln)
        if m:
            out["model_buffer_mib"] = out.get("model_buffer_mib", 0.0) + float(m.group(2))
        m = _KV.search(ln)
        if m:
            out["kv_cache_mib"] = float(m.group(1))
    return out


def _slice_owns(path, start: int, end: int, n_layer: int) -> dict:
    """Which tensors a slice file holds: exactly blocks [start, end) plus its endpoint tensors."""
    from ...gguf.inspect import layer_of, open_gguf

    with open_gguf(path) as gf:
        names = [t.name for t in gf.tensors]
    blocks = sorted({b for b in (layer_of(n) for n in names) if b is not None})
    endpoint = sorted(n for n in names if layer_of(n) is None)
    allowed = set()
    if start == 0:
        allowed.add("token_embd.weight")
    if end == n_layer:
        allowed |= {"output_norm.weight", "output.weight", "token_embd.weight"}
    ok = blocks == list(range(start, end)) and set(endpoint) <= allowed
    return {"range": f"{start}:{end}", "blocks": f"{blocks[0]}..{blocks[-1]}" if blocks else "none",
            "endpoint_tensors": endpoint, "ok": ok}


async def _generate(endpoints, prompts_tokens, *, n, top=0, ignore_eog=True):
    from ...route.driver import RouteDriver, Sampling

    d = await RouteDriver(endpoints, timeout=120).connect()
    try:
        return await asyncio.gather(*(d.generate(p, max_tokens=n, sampling=Sampling(top_logprobs=top,
                                                                                    ignore_eog=ignore_eog),
                                                 stop_on_eog=not ignore_eog) for p in prompts_tokens))
    finally:
        await d.close()


async def _tokenize(endpoint, texts, chat):
    from ...route.driver import RouteDriver

    from ...route.sessions import prompt_tokens

    d = await RouteDriver([endpoint]).connect(validate=False)
    try:
        return await prompt_tokens(d, texts, chat=chat)
    finally:
        await d.close()


async def _kill_during(endpoints, prompts_tokens, victim, *, after_tokens=8, bound_s=20.0):
    from ...route.driver import RouteDriver, Sampling

    d = await RouteDriver(endpoints, timeout=bound_s).connect()
    try:
        seen = asyncio.Event()
        count = {"n": 0}

        def tick(_t):
            count["n"] += 1
            if count["n"] >= after_tokens:
                seen.set()

        tasks = [asyncio.create_task(d.generate(p, max_tokens=10_000, sampling=Sampling(ignore_eog=True),
                                                stop_on_eog=False, on_token=tick)) for p in prompts_tokens]
        await asyncio.wait_for(seen.wait(), 120)
        t0 = time.monotonic()
        victim.proc.kill()
        res = await asyncio.wait_for(asyncio.gather(*tasks), bound_s + 10)
        return res, time.monotonic() - t0
    finally:
        await d.close()


@story("DGR-010", "Local real-model two-process acceptance (route 0:15 | 15:30)", lane="local-real",
       needs_model=True, measures=True)
def run(ctx: StoryContext) -> None:
    from ...protocol.client import WorkerClient

    from ...gguf.recipe import load_registry, recipe_for
    from ...route.driver import Sampling

    from ...route.run import _sequential
    from ...route.sessions import DEFAULT_PROMPTS, run_sessions
    from ...route.local import LocalRoute, ensure_worker
    from ...route.parity import compare, isolation

    assert ctx.model is not None
    model = ctx.model
    threads = os.cpu_count() or 1
    ensure_worker(ctx.backend)
    recipe = recipe_for(model, backend=ctx.backend, progress=False)
    entry = load_registry().lookup(recipe)
    ctx.results["recipe_fingerprint"] = recipe.fingerprint()
    ctx.results["artifact_id"] = recipe.artifact_id
    ctx.results["threads"] = threads

    route = LocalRoute(model, SPLIT, slices=True, threads=threads, max_sessions=8, slice_dir=ctx.tmp / "slices")
    whole = LocalRoute(model, [(0, 30)], threads=threads, max_sessions=8)
    ctx.record_command(f"dgr.route.local.LocalRoute({model.name}, split 0:15,15:30, slices=True, threads={threads}) "
                       f"-> dgr-worker serve --model <slice> --layers A:B --fingerprint … --artifact-id …")
    ctx.record_command(f"dgr.route.local.LocalRoute({model.name}, [0:30), threads={threads}) (whole-model yardstick)")
    with route, whole:
        eps, weps = route.endpoints, whole.endpoints
        caps = []
        for ep in eps:
            with WorkerClient(ep) as c:
                caps.append(c.capability())
        ids = [c.identity for c in caps]
        ranges = [(i.range.start, i.range.end) for i in ids]
        ctx.results["workers"] = [{"endpoint": ep, "pid": w.pid, "range": f"{a}:{b}", "file": str(f.name)}
                                  for ep, w, (a, b), f in zip(eps, route.workers, ranges, route.files)]
        ctx.results["recipe_class"] = {"name": entry.name, "status": entry.status} if entry else None
        ctx.check("two local worker processes open disjoint ranges of the artifact, one registered recipe",
                  ranges == SPLIT and len({w.pid for w in route.workers}) == 2 and entry is not None
                  and all(i.artifact_id == recipe.artifact_id and i.compatibility_fingerprint == recipe.fingerprint()
                          for i in ids),
                  f"ranges {ranges}, pids {[w.pid for w in route.workers]}, artifact {recipe.artifact_id[:16]}…, "
                  f"recipe class {entry.name if entry else 'NONE'} ({entry.status if entry else 'unregistered'}) in "
                  f"cli/dgr/gguf/recipes.toml; this run is the real distributed forward that certifies it")

        # -- parity: prefill (top-5 logprobs of the first token) + 32 greedy tokens, exact ------
        ptoks = asyncio.run(_tokenize(eps[0], [PARITY_PROMPT], chat=False))
        (r_route,) = asyncio.run(_generate(eps, ptoks, n=N_PREDICT, top=5))
        (r_whole,) = asyncio.run(_generate(weps, ptoks, n=N_PREDICT, top=5))
        diffs = [abs(a[1] - b[1]) for ra, rb in zip(r_route.top_logprobs, r_whole.top_logprobs)
                 for a, b in zip(ra, rb)]
        same_ids = all([t for t, _ in ra] == [t for t, _ in rb]
                       for ra, rb in zip(r_route.top_logprobs, r_whole.top_logprobs))
        ctx.results["parity"] = {"prompt_tokens": len(ptoks[0]), "route_tokens": r_route.tokens,
                                 "whole_tokens": r_whole.tokens, "max_abs_logprob_diff_top5": max(diffs or [0.0]),
                                 "top5_ids_identical": same_ids}
        ctx.check(f"prefill and {N_PREDICT} greedy decode tokens match whole-model llama.cpp (certified tolerance: exact)",
                  r_route.error is None and r_whole.error is None and len(r_route.tokens) == N_PREDICT
                  and r_route.tokens == r_whole.tokens and same_ids and max(diffs or [1.0]) == 0.0
                  and len(r_route.top_logprobs) == len(r_whole.top_logprobs) > 0,
                  f"{len(ptoks[0])}-token prompt; {sum(a == b for a, b in zip(r_route.tokens, r_whole.tokens))}/"
                  f"{N_PREDICT} tokens identical; max |Δ logprob| over top-5 at every step {max(diffs or [0.0]):.3g}")

        # -- 4 concurrent sessions: isolation and cleanup ---------------------------------------
        # Concurrent sessions share llama.cpp batches; batch composition moves logits by noise, so
        # isolation is judged against each session's own sequential run (dgr.route.isolation):
        # identical, or diverging only at a near-tie. Exact parity is one session at a time.
        prompts = list(DEFAULT_PROMPTS)
        chat = asyncio.run(_tokenize(eps[0], prompts, chat=True))
        samp = Sampling(top_logprobs=5)
        seq = asyncio.run(_sequential(eps, prompts, "route (sequential)", max_tokens=N_PREDICT, sampling=samp))
        wseq = asyncio.run(_sequential(weps, prompts, "whole (sequential)", max_tokens=N_PREDICT, sampling=samp))
        conc = asyncio.run(run_sessions(eps, prompts, token_prompts=chat, max_tokens=N_PREDICT, sampling=samp,
                                        stats=route.stats(), pids=[w.pid for w in route.workers],
                                        label="route 0:15,15:30"))
        wconc = asyncio.run(run_sessions(weps, prompts, token_prompts=chat, max_tokens=N_PREDICT, sampling=samp,
                                         stats=whole.stats(), pids=[w.pid for w in whole.workers],
                                         label="whole model 0:30"))
        par = compare(seq, wseq)
        iso = isolation(conc, seq)
        ctx.results["concurrent"] = {"route": conc.to_json(), "whole": wconc.to_json(), "parity_sequential": par.to_json(),
                                     "isolation": iso.to_json()}
        clean = len(conc.workers) == 2 and all(w.sessions_left == 0 and w.kv_cells_left == 0 for w in conc.workers)
        four = len(prompts) == len(conc.sessions) == len(seq.sessions) == 4   # isolation() zips the two
        ctx.check("four concurrent Route Sessions pass isolation (vs their own sequential runs) and cleanup "
                  "(no session or KV cell left on either worker)", four and conc.ok and iso.ok and clean and par.ok,
                  f"{iso.identical}/4 identical to their sequential runs, {iso.near_tie_divergences} diverge at a "
                  f"near-tie (noise <= {iso.max_noise_nats:.2f} nats){'; ' + '; '.join(iso.violations) if iso.violations else ''}; "
                  f"one at a time {par.matched_sessions}/4 identical to the whole model; left after release: "
                  + ", ".join(f"[{w.range}) {w.sessions_left} sessions/{w.kv_cells_left} cells" for w in conc.workers))

        # -- each worker holds only its own tensors and Hot KV State ----------------------------
        figs = [_stderr_figures(w.stderr_lines) for w in route.workers]
        wfig = _stderr_figures(whole.workers[0].stderr_lines)
        file_bytes = [f.stat().st_size for f in route.files]
        ctx.results["memory"] = {"route_stderr": figs, "whole_stderr": wfig, "slice_file_bytes": file_bytes,
                                 "model_file_bytes": model.stat().st_size,
                                 "route_rss_peak_bytes": [w.rss_peak_bytes for w in conc.workers],
                                 "whole_rss_peak_bytes": [w.rss_peak_bytes for w in wconc.workers],
                                 "route_kv_cells_peak": [w.kv_cells_peak for w in conc.workers],
                                 "route_kv_peak_bytes": [w.kv_peak_bytes for w in conc.workers],
                                 "whole_kv_peak_bytes": [w.kv_peak_bytes for w in wconc.workers]}
        bufs = [f.get("model_buffer_mib", 0.0) for f in figs]
        kvs = [f.get("kv_cache_mib", 0.0) for f in figs]
        wbuf, wkv = wfig.get("model_buffer_mib", 0.0), wfig.get("kv_cache_mib", 0.0)
        owned = [_slice_owns(f, a, b, 30) for f, (a, b) in zip(route.files, SPLIT)]
        ctx.results["memory"]["slice_tensors"] = owned
        only_own = (all(o["ok"] for o in owned) and all(0 < b < wbuf for b in bufs)
                    and abs(sum(kvs) - wkv) <= 0.01 * max(wkv, 1) and all(0 < k < wkv for k in kvs))
        ctx.check("each worker retains only its own tensors and Hot KV State", only_own,
                  "; ".join(f"[{o['range']}) file holds blocks {o['blocks']} + {o['endpoint_tensors']}" for o in owned)
                  + f"; model buffers {bufs} MiB vs whole {wbuf} MiB (each slice carries the tied token embedding: "
                  f"head for input, tail as LM head); KV caches {kvs} MiB (sum = whole {wkv} MiB); "
                  f"peak RSS {[round(w.rss_peak_bytes / 1e6) for w in conc.workers]} MB vs whole "
                  f"{round(wconc.workers[0].rss_peak_bytes / 1e6)} MB")

        # -- the report ---------------------------------------------------------------------------
        s = conc.sessions
        report = {
            "ttft_s": [x.ttft_s for x in s], "prefill_tok_s": [x.prefill_tok_s for x in s],
            "decode_tok_s": [x.decode_tok_s for x in s], "aggregate_decode_tok_s": conc.aggregate_decode_tok_s,
            "whole_aggregate_decode_tok_s": wconc.aggregate_decode_tok_s,
            "seam_bytes_per_decode_token": conc.seam_bytes_per_decode_token,
            "seam_bytes_limit": 2 * int(caps[0].identity.n_embd) * 4 + 256,
            "hop_decode_rtt_s": [x.hop_decode_rtt_s for x in s],
            "worker_step_latency_s": [w.step_latency_s / w.step_count if w.step_count else 0 for w in conc.workers],
            "worker_rss_peak_bytes": [w.rss_peak_bytes for w in conc.workers],
            "worker_vram_bytes": "n/a (cpu backend)",
            "kv_peak_bytes": [w.kv_peak_bytes for w in conc.workers],
            "mean_batch_rows": [w.mean_batch_rows for w in conc.workers],
            "mean_queue_wait_s": [w.mean_queue_wait_s for w in conc.workers],
        }
        ctx.results["report"] = report
        complete = all(v not in (None, [], 0) and (not isinstance(v, list) or None not in v)
                       for k, v in report.items() if k != "worker_vram_bytes")
        ctx.check("TTFT, prefill/decode throughput, seam bytes/latency, worker RSS, KV memory, batch size and "
                  "queue time are reported", complete and 0 < report["seam_bytes_per_decode_token"] <= report["seam_bytes_limit"],
                  f"TTFT {sum(report['ttft_s']) / 4 * 1e3:.0f} ms mean, aggregate decode {report['aggregate_decode_tok_s']:.1f} "
                  f"tok/s (whole {report['whole_aggregate_decode_tok_s']:.1f}), seam {report['seam_bytes_per_decode_token']:.0f} "
                  f"B/token (limit {report['seam_bytes_limit']}), hop RTT "
                  f"{[round(x * 1e3, 2) for x in s[0].hop_decode_rtt_s]} ms, mean batch rows "
                  f"{[round(x, 2) for x in report['mean_batch_rows']]}, queue "
                  f"{[round(x * 1e3, 3) for x in report['mean_queue_wait_s']]} ms")

        # -- killing one worker: bounded structured failure ---------------------------------------
        res, dt = asyncio.run(_kill_during(eps, chat[:2], route.workers[1]))
        named = all(r.error is not None and r.error.shard_range == (15, 30) and r.telemetry.status == "failed"
                    for r in res)
        with WorkerClient(eps[0]) as c:
            end = time.monotonic() + 10
            while c.load().active_sessions and time.monotonic() < end:
                time.sleep(0.05)
            head_left = c.load().active_sessions
        ctx.results["kill"] = {"failed_in_s": dt, "errors": [str(r.error) for r in res],
                               "tokens_before_failure": [len(r.tokens) for r in res], "head_sessions_left": head_left}
        ctx.check("killing one worker mid-generation gives a bounded structured failure naming the shard (no hang)",
                  named and dt < 30 and head_left == 0,
                  f"2 sessions failed {dt:.2f}s after SIGKILL of the tail: {res[0].error}; head released them "
                  f"({head_left} left)")
    # -- route benchmark (informative here; targets from issue 6, reported PASS/MISS) -------------
    from ...bench.route import TARGET_RATIOS, RouteBenchConfig, run_route_bench, summary

    ctx.record_command("dgr.bench.route.run_route_bench(model, RouteBenchConfig(repeats=2)) "
                       "(= dgr bench route --repeats 2)")
    try:
        bench = run_route_bench(model, RouteBenchConfig(repeats=2, threads=threads))
        ctx.results["route_bench"] = bench
        for line in summary(bench).splitlines():
            ctx.commands.append(f"# bench: {line}")
        pr = bench["ratios"]["paired_median"]
        from ...bench.route import profile_lines

        ctx.limitation(
            f"Where the route time goes (dgr bench route, same run; the route is {bench['route']['1']['mode']}: the "
            "driver streams to the head only, the workers forward the boundary and feed tokens back themselves): "
            f"route/whole-worker decode {pr['route_decode_vs_whole_worker']:.2f}, whole worker/llama-bench "
            f"{bench['ratios']['whole_worker_decode_vs_llama_bench_tg']:.2f}; "
            + "; ".join(profile_lines(bench)[:2])
            + ". Both shards share this host's 2 cores, so a route step costs both halves' compute one after the "
            "other, plus the hand-offs."
            + (" The seam floor (the same generation without gRPC) tells the two apart: two processes over a "
               f"socketpair / the whole model in one process {pr['floor_two_process_vs_whole_1']:.2f}, head+tail "
               f"in one process / whole {pr['floor_in_process_vs_whole_1']:.2f}, the route / the two-process floor "
               f"{pr['route_decode_vs_floor_two_process_1']:.2f} (1 session; single floor samples are noisy on "
               "a shared host)." if "floor_two_process_vs_whole_1" in pr else ""))
        for k, ok in bench["targets"].items():
            if not ok:
                reps = bench["ratios"].get("paired_per_repeat", {}).get(TARGET_RATIOS.get(k, ("",))[0], [])
                ctx.limitation(f"route benchmark target missed: {k}"
                               + (f" (repeats {' / '.join(f'{x:.2f}' for x in reps)})" if reps else "")
                               + " (paired per-repeat ratios, medians: "
                               + ", ".join(f"{n} {v:.2f}" for n, v in bench["ratios"]["paired_median"].items()) + ")")
    except Exception as exc:  # the benchmark is informative; its failure is recorded, not fatal
        ctx.limitation(f"route benchmark did not complete: {exc}")
    ctx.limitation("Prefill parity across the two processes compares the top-5 log-probabilities after the last "
                   "prompt position (what a route returns), not every prompt position; DGR-006 compares every "
                   "position, with the shards chained in one process.")
    from ...route.parity import NEAR_TIE_NATS

    ctx.limitation("Isolation tolerates a concurrent session that diverges from its own sequential run at a near-tie "
                   f"(top-1/top-2 gap <= {NEAR_TIE_NATS} nats, dgr.route.parity.NEAR_TIE_NATS); such a session is "
                   "counted in the detail, not failed. Exact parity with the whole model is checked one session at "
                   "a time.")
    ctx.limitation("Both workers and the driver share one host (loopback gRPC); network effects are DGR-011.")
    ctx.limitation("CPU backend: no VRAM figures.")
