"""DGR-014: the GGUF-versus-safetensors release gate, judged against the locked DGR-001 contract.

Refuses to judge when the committed contract changed after the baseline it was written from
(git). Then :func:`dgr.bench.gate.run_gate` measures, on one scenario, the distributed
safetensors route (transformers shard workers) and the distributed GGUF F32/Q8_0/Q4_1 routes
(dgr-workers), plus each GGUF recipe's whole model; every GGUF route's results are written in the
format `dgr bench check` reads and checked by that command against
``evidence/DGR-001/performance-contract.json`` as committed. The README separates
runtime/transport gains from quantization gains and ends with one recommendation, which is the
story's verdict (PROMOTE, OPTIMIZE or STOP); whether the gate's run held is reported apart.

The speed section runs three times (``DGR_GATE_REPEATS`` to change it), every route beside its
whole model in each repeat, in alternating order; thresholds are judged on each metric's median,
and every repeat's paired ratios are reported with it.

``DGR_GATE_CONTRACT_DIR=DIR`` judges against the contract DGR-001 wrote for another model into
DIR (``dgr accept DGR-001 --model M --out ...``), committed; the gate refuses a contract written
for a different model.

``DGR_GATE_QUICK=1``: a smoke run (short prompts/outputs, one repeat); the evidence says so.
"""

from __future__ import annotations

import json
import os
import sys

from ... import paths
from ..evidence import StoryContext, story


def _f(v, fmt: str = ".2f") -> str:
    return "n/a" if v is None else format(v, fmt)


def _gain_line(g: dict) -> str:
    keys = (("decode", "decode_tokens_per_second"), ("prefill", "prefill_tokens_per_second"),
            ("c4", "throughput_c4_tokens_per_second"), ("c8", "throughput_c8_tokens_per_second"),
            ("TTFT", "ttft_seconds"), ("p95", "token_latency_p95_seconds"),
            ("largest shard RSS", "max_shard_peak_rss_bytes"), ("route RSS", "peak_rss_bytes"),
            ("size", "artifact_bytes"), ("perplexity", "perplexity"))
    return ", ".join(f"{label} x{_f(g.get(k))}" for label, k in keys)


def _contract_paths(repo) -> tuple[str, str]:
    """The contract and baseline judged against, relative to the repository: DGR-001's own, or
    those in ``DGR_GATE_CONTRACT_DIR`` (a committed folder DGR-001 wrote for another model)."""
    from ...bench import gate_judge
    from ...errors import DgrError

    folder = os.environ.get("DGR_GATE_CONTRACT_DIR")
    if not folder:
        return gate_judge.CONTRACT, gate_judge.BASELINE
    d = (repo / folder).resolve()
    if not d.is_relative_to(repo.resolve()):
        raise DgrError(f"DGR_GATE_CONTRACT_DIR={folder} is outside the repository: the gate judges a committed contract")
    rel = d.relative_to(repo.resolve()).as_posix()
    for name in ("performance-contract.json", "baseline.json"):
        if not (d / name).is_file():
            raise DgrError(f"DGR_GATE_CONTRACT_DIR={folder} has no {name} (DGR-001 writes both)")
    return f"{rel}/performance-contract.json", f"{rel}/baseline.json"


@story("DGR-014", "GGUF-versus-safetensors release gate against the DGR-001 contract", lane="local-real",
       needs_model=True, measures=True)
def run(ctx: StoryContext) -> None:
    from ...bench import gate, gate_judge
    from ...bench.contract import load_contract

    repo = paths.repo_root()
    rel_contract, rel_baseline = _contract_paths(repo)
    contract_path = repo / rel_contract
    contract = load_contract(contract_path)
    baseline = json.loads((repo / rel_baseline).read_text())
    lock = gate_judge.contract_lock(repo, contract, baseline, contract_path=rel_contract, baseline_path=rel_baseline)
    ctx.results["contract_lock"] = {**lock, "contract": rel_contract}
    ctx.check(f"the DGR-001 contract ({rel_contract}) is judged as committed: unchanged since the baseline commit, "
              "thresholds equal to those its baseline yields",
              lock["ok"], f"baseline and contract commit {str(lock['baseline_commit'])[:12]}; "
                          f"{len(contract['thresholds'])} thresholds" if lock["ok"] else "; ".join(lock["reasons"]))
    if not lock["ok"]:
        ctx.limitation("The gate refused to judge: the contract changed after its baseline (see the first criterion).")
        return
    from ...digest import sha256_file

    want = ((baseline.get("model") or {}).get("source") or {}).get("sha256")
    have = sha256_file(ctx.model)
    if not ctx.check("the contract was written for this model (its baseline's source GGUF is the gate's)",
                     want == have, f"contract source {str(want)[:16]}…, gate source {have[:16]}… ({ctx.model.name})"):
        ctx.limitation("The gate refused to judge: a contract holds only for the model its baseline measured. "
                       "Write one for this model first: `dgr accept DGR-001 --model M --out DIR`, commit it, and "
                       "name DIR in DGR_GATE_CONTRACT_DIR.")
        return
    from ...gguf.synth import synthetic_description

    synthetic = synthetic_description(ctx.model)
    if synthetic:
        ctx.limitation(f"SYNTHETIC weights ({synthetic}): the speeds and the split's cost hold for this shape; the "
                       "quality figures compare outputs of random weights, so they certify no recipe.")

    quick = os.environ.get("DGR_GATE_QUICK") == "1"
    from ._common import env_count

    cfg = gate.GateConfig.make(threads=env_count("DGR_BENCH_THREADS", 1, 256), quick=quick,
                               repeats=env_count("DGR_GATE_REPEATS", 1, gate.MAX_REPEATS))
    if quick:
        ctx.limitation("DGR_GATE_QUICK=1: a smoke run with short prompts and outputs, not the gate's scenario.")
    ctx.record_command(f"dgr.bench.gate.run_gate({ctx.model}, {cfg})")
    doc = gate.run_gate(ctx.model, cfg)
    for e in doc.get("commands", []):
        ctx.commands.append(f"$ {e['command']}\n# exit {e['exit']}, {e['wall_seconds']:.1f}s")
    ctx.attach("gate.json", json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n")
    from ...bench.baseline import BaselineConfig, hardware

    hw = hardware(BaselineConfig.make(threads=cfg.threads))
    results = {n: gate_judge.results_for(doc, n, hw) for n in gate.GGUF_ROUTES}

    # 1. same scenario for every route
    runs = {n: r["timing"] for n, r in doc["routes"].items()}
    failures = {n: sum(len(v["failures"]) for v in t.values()) for n, t in runs.items()}
    same = all(sorted(t) == sorted(str(c) for c in cfg.concurrency) for t in runs.values())
    ctx.check("the distributed safetensors route and the distributed GGUF F32/Q8_0/Q4_1 routes ran the same scenario: "
              "split, token ids, lengths, greedy sampling, concurrency 1/4/8, threads, host",
              same and not any(failures.values()) and len(runs) == 4,
              f"split {', '.join(doc['config']['split'])}, prompt {cfg.n_prompt} tok, decode {cfg.n_gen} tok, "
              f"concurrency {list(cfg.concurrency)}, {cfg.threads} thread(s) per shard, {doc['config']['prompts']} fixed "
              f"prompts x {cfg.quality_tokens} greedy tokens, {doc['config']['score_tokens']} scored text tokens; "
              f"failed sessions {failures}")

    # 2. the safetensors route is the Transformers model
    st = doc["routes"][gate.SAFETENSORS]
    agree = gate_judge.greedy_agreement(st["greedy"], doc["transformers_whole"]["greedy"])
    ctx.check("the safetensors route (transformers shard workers over Shard protocol v1) reproduces the whole "
              "Transformers model: identical greedy tokens on every fixed prompt",
              st["greedy"] == doc["transformers_whole"]["greedy"], f"greedy agreement {agree:.3f}")

    # 3. every reported figure present, per route
    need = ("decode_tokens_per_second", "prefill_tokens_per_second", "ttft_seconds", "token_latency_p95_seconds",
            "throughput_c4_tokens_per_second", "throughput_c8_tokens_per_second", "max_shard_peak_rss_bytes",
            "seam_bytes_per_token_per_seam", "perplexity", "top1_agreement_vs_transformers_fp32", "kv_cells_peak")
    blocks = {n: gate_judge.route_block(doc, n) for n in doc["routes"]}
    missing = {n: [k for k in need if b.get(k) is None] for n, b in blocks.items()}
    missing = {n: v for n, v in missing.items() if v}
    cleanup = {n: (b["sessions_left_after"], b["kv_cells_left_after"]) for n, b in blocks.items()}
    ctx.check("quality, TTFT, prefill/decode, aggregate throughput at 4 and 8, p95 token latency, seam cost, memory, "
              "KV pressure, failures and cleanup reported per route",
              not missing and all(v == (0, 0) for v in cleanup.values()),
              ("missing: " + json.dumps(missing) + "; ") * bool(missing)
              + "; ".join(f"{n}: decode {_f(b['decode_tokens_per_second'], '.1f')} tok/s, c4 "
                          f"{_f(b['throughput_c4_tokens_per_second'], '.1f')}, c8 {_f(b['throughput_c8_tokens_per_second'], '.1f')}, "
                          f"TTFT {_f((b['ttft_seconds'] or 0) * 1e3, '.0f')} ms, p95 {_f((b['token_latency_p95_seconds'] or 0) * 1e3, '.1f')} ms, "
                          f"ppl {_f(b['perplexity'])}, KV peak {b['kv_cells_peak']}/{b['kv_cells_total']} cells, "
                          f"left after runs {cleanup[n]}" for n, b in blocks.items()))

    # 4. per-hop seam latency, every hop measured
    hops = {n: b.get("hop_decode_rtt_seconds") or [] for n, b in blocks.items()}
    ctx.check("every hop of every route has a measured (non-zero) decode round trip; chained GGUF routes: each "
              "worker times its own downstream hop",
              all(len(h) == len(doc["config"]["split"]) and all(x > 0 for x in h) for h in hops.values()),
              "; ".join(f"{n} ({blocks[n]['mode']}): " + ", ".join(f"{x * 1e3:.2f}" for x in h) + " ms"
                        for n, h in hops.items()))

    # 4b. paired repeats, judged on medians
    paired = gate_judge.paired_repeats(contract, doc)
    n_rep = len(doc.get("repeats") or [])
    complete = all(len(v["repeats"]) == cfg.repeats and None not in v["repeats"]
                   for per in paired.values() for v in per.values())
    ctx.check(f"speed judged on medians of paired repeats: {cfg.repeats} repeat(s) of the speed section, each "
              "measuring every route and its whole model side by side (order reversed every repeat), every "
              "repeat's ratio recorded",
              n_rep == cfg.repeats and bool(paired) and all(paired.values()) and complete,
              "; ".join(f"{n}: " + ", ".join(
                  f"{tid.removeprefix('route_')} {_f(v['judged'], '.3f')} judged ["
                  + "/".join(_f(x, ".3f") for x in v["repeats"]) + f"], {v['repeats_met']}/{len(v['repeats'])} "
                  f"repeats met {v['op']} {v['bound']:g}" for tid, v in per.items()) for n, per in paired.items()))

    # 5. judged by `dgr bench check` against the committed contract
    checks = {}
    for n, res in results.items():
        f = ctx.tmp / f"results-{n}.json"
        f.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
        ctx.attach(f"results-{n}.json", f.read_text())
        p = ctx.command([sys.executable, "-m", "dgr.main", "bench", "check", str(f), "--contract", str(contract_path)],
                        timeout=120)
        last = (p.stdout.strip().splitlines() or [p.stderr.strip()])[-1]
        checks[n] = {"exit": p.returncode, "summary": last}
    judged = gate_judge.judge(contract, results)
    ctx.check("each GGUF route judged by `dgr bench check` against evidence/DGR-001/performance-contract.json as "
              "committed (thresholds not moved)",
              all(c["exit"] in (0, 1) for c in checks.values()),
              "; ".join(f"{n}: exit {c['exit']} ({c['summary']})" for n, c in checks.items()))

    # 6. gains kept apart
    g = gate_judge.gains(doc)
    ctx.check("runtime/transport gains (GGUF F32 route vs safetensors fp32 route, same weights and precision) "
              "reported apart from quantization gains (GGUF Q8_0/Q4_1 route vs GGUF F32 route)",
              g["runtime_transport"]["decode_tokens_per_second"] is not None
              and all(g["quantization"][q]["decode_tokens_per_second"] is not None for q in g["quantization"]),
              f"runtime/transport: {_gain_line(g['runtime_transport'])}; "
              + "; ".join(f"quantization {q}: {_gain_line(v)}" for q, v in g["quantization"].items()))

    # 6b. the fair baseline: batched Transformers beside the unbatched current route
    vb = (g.get("runtime_vs_batched_transformers") or {}).get("by_sessions") or {}
    levels = list(vb)
    ctx.check("the gain is reported against both baselines: the unbatched safetensors route (the contract's "
              "\"current route\" lane, one session step at a time) and batched Transformers (whole model, static "
              "batching at 1/4/8 sessions; continuous batching where the installed transformers has it)",
              len(levels) == len(cfg.concurrency)
              and all(vb[k]["decode_vs_static"] is not None and vb[k]["end_to_end_vs_static"] is not None
                      for k in levels),
              "gguf-f32 route / unbatched route: " + ", ".join(
                  f"c{c} x{_f(g['runtime_transport'].get(m))}" for c, m in (
                      (1, "decode_tokens_per_second"), (4, "throughput_c4_tokens_per_second"),
                      (8, "throughput_c8_tokens_per_second")))
              + "; gguf-f32 route / batched Transformers: " + "; ".join(
                  f"c{k} decode x{_f(vb[k]['decode_vs_static'])} ({_f(vb[k]['route_decode_tok_s'], '.1f')} vs "
                  f"{_f(vb[k]['static_decode_tok_s'], '.1f')} tok/s), end-to-end x{_f(vb[k]['end_to_end_vs_static'])} "
                  f"static, continuous: " + (f"x{_f(vb[k]['end_to_end_vs_continuous'])}"
                                             if vb[k]["end_to_end_vs_continuous"] is not None else vb[k]["continuous"])
                  for k in levels))

    # 7. one recommendation
    rec = gate_judge.recommend(judged, doc)
    if ctx.check("one ship recommendation: promote GGUF, optimize a named measured bottleneck, or stop",
                 rec["decision"] in ("promote", "optimize", "stop"), f"{rec['decision'].upper()}: {rec['text']}"):
        ctx.decide(rec["decision"], "the gate's decision against the locked DGR-001 contract")

    ctx.results.update({"config": doc["config"], "routes": blocks, "gains": g, "judged": judged,
                        "bench_check": checks, "recommendation": rec, "paired_repeats": paired,
                        "whole_model": {n: r["whole_model"] for n, r in results.items()},
                        "safetensors_route_greedy_agreement_vs_transformers": agree,
                        "files": ["gate.json", *(f"results-{n}.json" for n in results)]})
    for n, j in judged.items():
        failed = [v for v in j["verdicts"] if v["status"] == "fail"]
        ctx.limitation(f"{n} route against the contract: "
                       + ("every threshold met" if not failed else
                          "missed " + "; ".join(f"{v['id']} ({v['detail']})" for v in failed))
                       + f"; stop condition: {j['stop_condition']['detail']}.")
    load = ctx.load_at_start[0] if ctx.load_at_start else float("nan")
    ctx.limitation(f"One host ({os.cpu_count()} CPUs; 1-minute load average {load:.2f} when the gate started): "
                   "every shard of every route runs here over loopback, not on separate machines; absolute tok/s "
                   "are noisy, the ratios were measured side by side in one run (routes interleaved per "
                   f"concurrency), {cfg.repeats} repeat(s) of the speed section judged on each metric's median. "
                   "Quality and memory figures come from one measurement; the batched Transformers lanes (reported, not judged) ran in the first repeat only.")
    ctx.limitation("The batched Transformers lanes run the whole model in one process (no split, no transport): "
                   "they bound what a batched Transformers deployment would reach on this host, and the route's gain "
                   "against them is the fair one. The prompts have equal lengths, so static batching pads nothing.")
    ctx.limitation("The safetensors route is driven stepwise (its workers neither forward along the chain nor "
                   "generate server-side, and compute one session step at a time without batching); the GGUF routes "
                   "run chained with one token per answer. That difference is part of the runtime/transport gain.")
    ctx.limitation("Perplexity and top-1 agreement are measured through the protocol, teacher-forced, from the tail's "
                   f"top-{cfg.top_logprobs} logprobs: a text token outside them is scored at the last one, so the "
                   "perplexity is a lower bound, computed identically for every route and whole model (clipped "
                   "shares: " + ", ".join(f"{n} {_f(r['score'].get('clipped_share'), '.3f')}"
                                         for n, r in doc["routes"].items()) + ").")
    ctx.limitation("The route's largest-shard RSS is its peak resident set (VmHWM), including the runtime itself "
                   "(libllama, or torch for the transformers workers); CPU only, so VRAM is not measured.")
