"""`dgr bench route --hosts N`: the targets (issue: 2 hosts x 1 core) judged from a results
document of bench.py, and its text summary. Pure functions of the document: they run on a stored
JSON as well as at the end of a run."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def _med(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else 0.0


# ---- targets (issue: 2 hosts x 1 core) -------------------------------------------------------

def _pair(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b) if y]


def _host_mean(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per repeat, the mean over the hosts of each one-host figure (llama-bench: pp_tok_s,
    pp_long_tok_s, tg_tok_s; llama-batched-bench: by_batch[B].tg_tok_s)."""
    out: list[dict[str, Any]] = []
    for reps in zip(*runs):
        if "by_batch" in reps[0]:
            out.append({"by_batch": {b: {"tg_tok_s": statistics.fmean(r["by_batch"][b]["tg_tok_s"] for r in reps)}
                                     for b in reps[0]["by_batch"] if all(b in r["by_batch"] for r in reps)}})
        else:
            out.append({k: statistics.fmean(r[k] for r in reps) if all(r.get(k) for r in reps) else None
                        for k in ("pp_tok_s", "pp_long_tok_s", "tg_tok_s")})
    return out


def baseline(doc: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """The one-host yardstick per repeat (llama-bench, llama-batched-bench) and what it is: the
    mean over the lab's hosts when they were all measured, else h1's."""
    lb, bb = doc["one_host"]["llama_bench"], doc["one_host"]["batched_bench"]
    others = doc.get("other_hosts") or {}
    if not others or any(len(r["llama_bench"]) != len(lb) for r in others.values()):
        return lb, bb, "h1"
    names = ["h1", *others]
    lb = _host_mean([lb, *[r["llama_bench"] for r in others.values()]])
    if bb and all(len(r["batched_bench"]) == len(bb) for r in others.values()):
        bb = _host_mean([bb, *[r["batched_bench"] for r in others.values()]])
    return lb, bb, "mean of " + ", ".join(names)


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target: the ratio per repeat (paired in time), its median, the least passing value,
    met or missed. One host is the mean of the lab's hosts per repeat (``baseline``); each
    target against h1 alone is kept in ``per_repeat_vs_h1``."""
    lb, bb, name = baseline(doc)
    out = _targets(doc, lb, bb)
    if name != "h1":
        for t, h1 in zip(out, _targets(doc, doc["one_host"]["llama_bench"], doc["one_host"]["batched_bench"])):
            t["per_repeat_vs_h1"] = h1["per_repeat"]
    return out


def _targets(doc: dict[str, Any], lb: list[dict[str, Any]], bb: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    r0 = doc["by_rtt"].get("0")
    r10 = doc["by_rtt"].get("10")

    def add(name: str, per_repeat: list[float], least: float, note: str = "") -> None:
        if not per_repeat:   # a run without that lane (--sessions, --rtt-ms): not judged
            note = (note + "; " if note else "") + "not measured in this run"
        out.append({"target": name, "per_repeat": per_repeat, "median": _med(per_repeat), "least": least,
                    "met": (_med(per_repeat) >= least) if per_repeat else None, "note": note})

    def dec(res: dict[str, Any], c: int, kind: str = "route") -> list[float]:
        return [r["decode_tok_s"] for r in res[kind].get(str(c), [])]

    def bbv(c: int, runs: list[dict[str, Any]] = bb) -> list[float]:
        return [b["by_batch"].get(str(c), {}).get("tg_tok_s", 0.0) for b in runs]

    if r0:
        add("8 sessions, no added latency: route aggregate decode >= 1.6x llama-batched-bench B=8 on one host",
            _pair(dec(r0, 8), bbv(8)), 1.6)
        add("4 sessions, no added latency: route aggregate decode >= 1.4x llama-batched-bench B=4 on one host",
            _pair(dec(r0, 4), bbv(4)), 1.4)
        add("1 session, no added latency: route decode >= 0.97x llama-bench tg on one host",
            _pair(dec(r0, 1), [x["tg_tok_s"] for x in lb]), 0.97)
        add(f"prefill of a {doc['long_prompt']}-token prompt on {doc['hosts']} hosts >= 1.5x one host (llama-bench pp)",
            _pair([r["prefill_tok_s"] for r in r0["route_long_prefill"]], [x["pp_long_tok_s"] for x in lb]), 1.5)
    if r0:
        for c in (8, 16):
            rep = [r["decode_tok_s"] for r in r0.get("replicas", {}).get(str(c), [])]
            if rep:   # (runs before the replica lane have none: not judged)
                add(f"{c} sessions against replicas, no added latency: route aggregate decode >= 0.92x the replica ceiling "
                    f"(the whole model on each of the {doc['hosts']} hosts at once, the sessions spread over them)",
                    _pair(dec(r0, c), rep), 0.92)
    if r10:
        bound = [1.0 / (1.0 / x["tg_tok_s"] + 0.010) for x in lb]
        add("10 ms RTT: 1-session decode >= 0.9x 1/(t_compute + RTT)", _pair(dec(r10, 1), bound), 0.9,
            "t_compute = 1 / llama-bench tg on one host")
        add("10 ms RTT: 8-session aggregate decode >= 1.3x one host (llama-batched-bench B=8)",
            _pair(dec(r10, 8), bbv(8)), 1.3)
    for key, res in (("0", r0), ("10", r10)):
        if not res or not res["rpc"]:
            continue
        rpc_bb = [x["batched_bench"] for x in res["rpc"]]
        rpc_tg = [x["llama_bench"]["tg_tok_s"] for x in res["rpc"]]
        add(f"{key} ms added RTT: 8 sessions >= 1.5x llama.cpp RPC aggregate (llama-batched-bench --rpc B=8)",
            _pair(dec(res, 8), bbv(8, rpc_bb)), 1.5)
        add(f"{key} ms added RTT: 1 session >= {'0.97' if key == '0' else '1.0'}x llama.cpp RPC (llama-bench --rpc tg)",
            _pair(dec(res, 1), rpc_tg), 0.97 if key == "0" else 1.0)
    if r0:
        # from the fewest sessions measured (1 unless --sessions left it out): bytes per token per hop
        counts = sorted(int(c) for c, runs in r0["route"].items() if runs)
        seam = [r["seam_bytes_per_decode_token"] for r in r0["route"][str(counts[0])]] if counts else []
        out.append({"target": "seam bytes per decode token per hop <= 2*n_embd*4 + 256", "per_repeat": seam,
                    "median": _med(seam), "least": None, "limit": doc["seam_bytes_limit"],
                    "met": all(0 < s <= doc["seam_bytes_limit"] for s in seam) if seam else None,
                    "note": f"{counts[0]} session(s)" if counts else "not measured in this run"})
    return out


def summary(doc: dict[str, Any]) -> str:
    lines = [f"model {Path(doc['model']).name}, {doc['hosts']} hosts x 1 core/1 thread, split {','.join(doc['split'])}, "
             f"pp{doc['n_prompt']} tg{doc['n_gen']}, {doc['repeats']} repeats (medians; every repeat in the JSON)"]
    hosts = {"h1": doc["one_host"], **(doc.get("other_hosts") or {})}
    for h, runs in hosts.items():
        lb, bb = runs["llama_bench"], runs["batched_bench"]
        if lb:
            lines.append(f"one host ({h}): llama-bench pp{doc['n_prompt']} {_med([x['pp_tok_s'] for x in lb]):.1f}, "
                         f"pp{doc['long_prompt']} {_med([x['pp_long_tok_s'] for x in lb]):.1f}, "
                         f"tg{doc['n_gen']} {_med([x['tg_tok_s'] for x in lb]):.1f} tok/s; llama-batched-bench "
                         + ", ".join(f"B={k} {_med([b['by_batch'][k]['tg_tok_s'] for b in bb]):.1f}"
                                     for k in (bb[0]["by_batch"] if bb else ())))
    lines.append(f"one-host yardstick of the targets: {baseline(doc)[2]} (per repeat)")
    for key, res in doc["by_rtt"].items():
        lines.append(f"added RTT {key} ms ({res['lab']['shaping']['delay_mechanism']}):")
        for kind in ("route", "whole_worker"):
            parts = []
            for c, runs in res[kind].items():
                parts.append(f"{c}s {_med([r['decode_tok_s'] for r in runs]):.1f}")
            lines.append(f"  {kind.replace('_', ' ')} decode tok/s: " + ", ".join(parts))
        reps = {c: runs for c, runs in res.get("replicas", {}).items() if runs}
        if reps:
            lines.append(f"  replica ceiling ({doc['hosts']} whole models at once) decode tok/s: "
                         + ", ".join(f"{c}s {_med([r['decode_tok_s'] for r in runs]):.1f}" for c, runs in reps.items()))
        for c, runs in res["route"].items():
            ws = [r["where"] for r in runs]
            if not ws or not ws[0]["stages"]:
                continue
            n = len(ws[0]["stages"])
            handoffs = [w["handoff_ms_per_step"] for w in ws if w.get("handoff_ms_per_step") is not None]
            shares = "/".join(f"{_med([w['stages'][i].get('decode_busy_share', 0.0) for w in ws]):.2f}"
                              for i in range(n))
            lines.append(f"  route {c} session(s): busy share " + "/".join(
                f"{_med([w['stages'][i]['busy_share'] for w in ws]):.2f}" for i in range(n))
                + f", decode busy share {shares}, step {_med([w['step_ms'] for w in ws]):.2f} ms, compute "
                + " + ".join(f"{_med([w['stages'][i]['decode_compute_ms_per_batch'] for w in ws]):.2f}" for i in range(n))
                + " ms per batch"
                + (f" + hand-offs {_med(handoffs):.2f} ms" if len(handoffs) == len(ws)
                   else " (stages overlap: no hand-off time)")
                + ", rows per batch " + "/".join(
                    f"{_med([w['stages'][i]['rows_per_batch'] for w in ws]):.2f}" for i in range(n))
                + ", queue " + "/".join(f"{_med([w['stages'][i]['mean_queue_wait_ms'] for w in ws]):.2f}"
                                        for i in range(n)) + " ms")
        lines.append(f"  {doc['long_prompt']}-token prefill tok/s: route "
                     f"{_med([r['prefill_tok_s'] for r in res['route_long_prefill']]):.1f}, whole worker "
                     f"{_med([r['prefill_tok_s'] for r in res['whole_long_prefill']]):.1f}")
        if res["rpc"]:
            lines.append("  llama.cpp RPC: tg " + f"{_med([x['llama_bench']['tg_tok_s'] for x in res['rpc']]):.1f}, "
                         + ", ".join(f"B={k} {_med([x['batched_bench']['by_batch'][k]['tg_tok_s'] for x in res['rpc']]):.1f}"
                                     for k in res["rpc"][0]["batched_bench"]["by_batch"]))
    if doc.get("rpc_skipped"):
        lines.append(f"llama.cpp RPC: not measured ({doc['rpc_skipped']})")
    for t in doc["targets"]:
        if t["met"] is None:
            lines.append(f"N/A  {t['target']}: not measured in this run")
            continue
        lines.append(f"{'MET ' if t['met'] else 'MISS'} {t['target']}: median {t['median']:.2f} (repeats "
                     + " / ".join(f"{x:.2f}" for x in t["per_repeat"]) + ")")
    return "\n".join(lines)
