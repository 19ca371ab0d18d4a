"""`dgr bench route`, the results: what the measured runs of :mod:`dgr.bench.route` come to (medians,
ratios of medians, ratios paired per repeat, the seam floor and RPC summaries, the targets) and
the text summary printed after a run. Pure functions of the runs (no process, no clock).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Sequence

Runs = dict[int, list[dict[str, Any]]]

# each ratio target (issue 6): the paired ratio it is judged on and the least passing value
TARGET_RATIOS = {
    "decode_ge_90pct_llama_bench": ("route_decode_vs_llama_bench_tg", 0.90),
    "prefill_ge_95pct_llama_bench": ("route_prefill_vs_llama_bench_pp", 0.95),
    "aggregate_decode_B4_ge_90pct_batched_bench": ("route_aggregate_decode_vs_batched_bench_B4", 0.90),
}


def _median_profile(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ps = [r["profile"] for r in runs if r.get("profile")]
    if not ps:
        return {}
    nw = len(ps[0]["workers"])
    return {"step_ms": statistics.median(p["step_ms"] for p in ps),
            "compute_ms_per_step": statistics.median(p["compute_ms_per_step"] for p in ps),
            "handoff_ms_per_step": statistics.median(p["handoff_ms_per_step"] for p in ps),
            "worker_compute_ms_per_batch": [statistics.median(p["workers"][i]["compute_ms_per_batch"] for p in ps)
                                            for i in range(nw)],
            "worker_rows_per_batch": [statistics.median(p["workers"][i]["rows_per_batch"] for p in ps)
                                      for i in range(nw)]}


def profile_lines(doc: dict[str, Any]) -> list[str]:
    """One line per measured configuration: step time = each shard's compute + hand-offs."""
    out = []
    for label, key in (("route", "route"), ("route stepwise", "route_stepwise"), ("whole worker", "whole_worker")):
        for c, v in sorted((doc.get(key) or {}).items(), key=lambda kv: int(kv[0])):
            p = v.get("profile") or {}
            if not p.get("step_ms"):
                continue
            parts = " + ".join(f"{x:.2f}" for x in p["worker_compute_ms_per_batch"])
            out.append(f"profile {label}, {c} session(s): step {p['step_ms']:.2f} ms = compute {parts} ms "
                       f"+ hand-offs {p['handoff_ms_per_step']:.2f} ms; rows per batch "
                       + "/".join(f"{x:.2f}" for x in p["worker_rows_per_batch"]))
    return out


def steal_lines(doc: dict[str, Any]) -> list[str]:
    """The hypervisor's steal during the chained route samples and their yardsticks, when any."""
    out = []
    for c, v in sorted(doc.get("route", {}).items(), key=lambda kv: int(kv[0])):
        route = [r.get("host_steal_fraction") for r in v.get("runs", [])]
        yard = [y.get("host_steal_fraction") for b in doc.get("yardstick_brackets", {}).get(c, [])
                for y in (b["before"], b["after"])]
        if any(x for x in route + yard):
            fmt = lambda xs: "/".join("?" if x is None else f"{100 * x:.0f}%" for x in xs)  # noqa: E731
            out.append(f"host steal (CPU time taken by the hypervisor), {c} session(s): route runs {fmt(route)}, "
                       f"yardsticks before/after {fmt(yard)}")
    return out


def floor_lines(doc: dict[str, Any]) -> list[str]:
    """The seam floor next to the route: decode tok/s without any transport."""
    f = doc.get("seam_floor") or {}
    if f.get("skipped", True):
        return []
    out = []
    for c, v in sorted(f["by_sessions"].items(), key=lambda kv: int(kv[0])):
        route = doc["route"].get(c, {}).get("decode_tok_s", 0.0)
        out.append(f"seam floor, {c} session(s), decode tok/s: whole model in one process {v['whole_decode_tok_s']:.1f}, "
                   f"head+tail in one process {v['in_process_decode_tok_s']:.1f}, head and tail in two processes "
                   f"over a socketpair {v['two_process_decode_tok_s']:.1f}; the route {route:.1f}"
                   + ("" if v["same_tokens"] else " (the three ways sampled different ids)"))
    return out


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _floor_summary(floor_runs: dict[int, list[dict[str, Any]]], route_runs: dict[int, list[dict[str, Any]]],
                   lb_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the seam floor per concurrency, and ratios paired per repeat: what two
    processes cost without any transport, and what the route costs on top of that floor."""
    out: dict[str, Any] = {"skipped": False, "by_sessions": {}, "paired_median": {}}
    keys = ("whole_decode_tok_s", "in_process_decode_tok_s", "two_process_decode_tok_s")
    for c, runs in floor_runs.items():
        if not runs:
            continue
        out["by_sessions"][str(c)] = {**{k: statistics.median(r[k] for r in runs) for k in keys},
                                      "same_tokens": all(r["same_tokens"] for r in runs),
                                      "command": runs[0]["command"], "runs": runs}
        pm = out["paired_median"]
        pm[f"floor_in_process_vs_whole_{c}"] = statistics.median(
            r["in_process_decode_tok_s"] / r["whole_decode_tok_s"] for r in runs)
        pm[f"floor_two_process_vs_whole_{c}"] = statistics.median(
            r["two_process_decode_tok_s"] / r["whole_decode_tok_s"] for r in runs)
        pm[f"route_decode_vs_floor_two_process_{c}"] = statistics.median(
            x["decode_tok_s"] / r["two_process_decode_tok_s"] for x, r in zip(route_runs[c], runs))
        if c == 1:
            pm["floor_whole_vs_llama_bench_tg"] = statistics.median(
                r["whole_decode_tok_s"] / lb["tg_tok_s"] for r, lb in zip(runs, lb_runs))
            pm["floor_two_process_vs_llama_bench_tg"] = statistics.median(
                r["two_process_decode_tok_s"] / lb["tg_tok_s"] for r, lb in zip(runs, lb_runs))
    return out


def _rpc_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """llama.cpp's own RPC split (two local rpc-servers, dgr.bench.rpc), median over the repeats."""
    ok = [r for r in runs if not r.get("skipped")]
    if not ok:
        return {"skipped": True, "reason": runs[0].get("reason", "not measured") if runs else "not measured"}
    return {"skipped": False, "command": ok[0]["command"], "tensor_split": ok[0].get("tensor_split"),
            "per_server": ok[0].get("per_server"), "warnings": sorted({w for r in ok for w in r.get("warnings", [])}),
            "pp_tok_s": statistics.median(r["pp_tok_s"] for r in ok),
            "tg_tok_s": statistics.median(r["tg_tok_s"] for r in ok), "runs": runs}


def by_sessions(runs: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per concurrency of one measured configuration, with its runs."""
    return {str(c): {"prefill_tok_s": _median(v, "prefill_tok_s"), "decode_tok_s": _median(v, "decode_tok_s"),
                     "ttft_s": _median(v, "ttft_s"),
                     "seam_bytes_per_decode_token": _median(v, "seam_bytes_per_decode_token"),
                     "mode": v[0]["mode"], "profile": _median_profile(v), "runs": v} for c, v in runs.items()}


def derive(concurrency: Sequence[int], *, route_runs: Runs, step_runs: Runs, whole_runs: Runs, brackets: Runs,
           lb_runs: list[dict[str, Any]], bb_runs: list[dict[str, Any]], floor_runs: Runs,
           rpc_runs: list[dict[str, Any]], n_shards: int, rpc_on: bool, n_embd: int,
           server_runs: Runs | None = None) -> dict[str, Any]:
    """The results JSON's derived part from the measured runs: medians per configuration, the
    ratios (of medians, and paired per repeat then the median), the seam floor and RPC
    summaries, and the targets."""
    lb = {"command": lb_runs[0]["command"], "runs": lb_runs,
          "pp_tok_s": statistics.median(r["pp_tok_s"] for r in lb_runs),
          "tg_tok_s": statistics.median(r["tg_tok_s"] for r in lb_runs)}
    bb = {"command": bb_runs[0]["command"], "runs": bb_runs,
          "by_batch": {k: {m: statistics.median(r["by_batch"][k][m] for r in bb_runs) for m in ("pp_tok_s", "tg_tok_s")}
                       for k in bb_runs[0]["by_batch"]}}
    route, stepwise, whole = by_sessions(route_runs), by_sessions(step_runs), by_sessions(whole_runs)
    one = str(min(concurrency))
    ratios: dict[str, Any] = {
        "route_decode_vs_llama_bench_tg": route[one]["decode_tok_s"] / lb["tg_tok_s"],
        "route_prefill_vs_llama_bench_pp": route[one]["prefill_tok_s"] / lb["pp_tok_s"],
        "route_decode_vs_whole_worker": route[one]["decode_tok_s"] / whole[one]["decode_tok_s"],
        "route_prefill_vs_whole_worker": route[one]["prefill_tok_s"] / whole[one]["prefill_tok_s"],
        "whole_worker_decode_vs_llama_bench_tg": whole[one]["decode_tok_s"] / lb["tg_tok_s"],
        "route_stepwise_decode_vs_llama_bench_tg": stepwise[one]["decode_tok_s"] / lb["tg_tok_s"],
        "route_stepwise_decode_vs_whole_worker": stepwise[one]["decode_tok_s"] / whole[one]["decode_tok_s"],
        "route_decode_vs_route_stepwise": route[one]["decode_tok_s"] / stepwise[one]["decode_tok_s"],
    }
    # paired per repeat (same minute of machine load), then the median: robust on a shared host
    c1 = min(concurrency)
    per_repeat = {
        "route_decode_vs_llama_bench_tg": [r["decode_tok_s"] / l["tg_tok_s"] for r, l in zip(route_runs[c1], lb_runs)],
        "route_prefill_vs_llama_bench_pp": [r["prefill_tok_s"] / l["pp_tok_s"] for r, l in zip(route_runs[c1], lb_runs)],
    }
    if 4 in concurrency:
        per_repeat["route_aggregate_decode_vs_batched_bench_B4"] = [
            r["decode_tok_s"] / b["tg_tok_s"] for r, b in zip(route_runs[4], brackets[4])]
    paired = {k: statistics.median(v) for k, v in per_repeat.items()}
    paired.update({
        "route_decode_vs_whole_worker": statistics.median(
            r["decode_tok_s"] / w["decode_tok_s"] for r, w in zip(route_runs[c1], whole_runs[c1])),
        "route_prefill_vs_whole_worker": statistics.median(
            r["prefill_tok_s"] / w["prefill_tok_s"] for r, w in zip(route_runs[c1], whole_runs[c1])),
        "route_stepwise_decode_vs_llama_bench_tg": statistics.median(
            r["decode_tok_s"] / l["tg_tok_s"] for r, l in zip(step_runs[c1], lb_runs)),
        "route_stepwise_decode_vs_whole_worker": statistics.median(
            r["decode_tok_s"] / w["decode_tok_s"] for r, w in zip(step_runs[c1], whole_runs[c1])),
    })
    if 4 in concurrency:
        paired["route_aggregate_decode_vs_whole_worker_4"] = statistics.median(
            r["decode_tok_s"] / w["decode_tok_s"] for r, w in zip(route_runs[4], whole_runs[4]))
        paired["route_stepwise_aggregate_decode_vs_batched_bench_B4"] = statistics.median(
            r["decode_tok_s"] / b["by_batch"]["4"]["tg_tok_s"] for r, b in zip(step_runs[4], bb_runs))
    floor = _floor_summary(floor_runs, route_runs, lb_runs) if n_shards == 2 else \
        {"skipped": True, "reason": "the seam floor is measured for 2-shard splits"}
    if not floor.get("skipped"):
        paired.update(floor["paired_median"])
    rpc = _rpc_summary(rpc_runs) if rpc_on else {"skipped": True, "reason": "--no-rpc"}
    if not rpc["skipped"]:
        pairs = [(r, x) for r, x in zip(route_runs[c1], rpc_runs) if not x.get("skipped")]
        paired["route_decode_vs_llama_rpc_tg"] = statistics.median(r["decode_tok_s"] / x["tg_tok_s"] for r, x in pairs)
        paired["route_prefill_vs_llama_rpc_pp"] = statistics.median(r["prefill_tok_s"] / x["pp_tok_s"] for r, x in pairs)
        paired["llama_rpc_tg_vs_llama_bench_tg"] = statistics.median(
            x["tg_tok_s"] / l["tg_tok_s"] for x, l in zip(rpc_runs, lb_runs) if not x.get("skipped"))
    ratios["paired_median"] = paired
    # the per-repeat values behind the target ratios: how far one repeat moves on this host
    ratios["paired_per_repeat"] = per_repeat
    for c in concurrency:
        b = bb["by_batch"].get(str(c))
        if b and c > 1:
            ratios[f"route_aggregate_decode_vs_batched_bench_B{c}"] = route[str(c)]["decode_tok_s"] / b["tg_tok_s"]
            ratios[f"route_stepwise_aggregate_decode_vs_batched_bench_B{c}"] = \
                stepwise[str(c)]["decode_tok_s"] / b["tg_tok_s"]
            ratios[f"whole_worker_aggregate_decode_vs_batched_bench_B{c}"] = whole[str(c)]["decode_tok_s"] / b["tg_tok_s"]
    seam_limit = 2 * n_embd * 4 + 256
    seam = route[one]["seam_bytes_per_decode_token"]
    targets = {t: paired[k] >= least for t, (k, least) in TARGET_RATIOS.items() if k in paired}
    targets["seam_bytes_per_decode_token_le_limit"] = 0 < seam <= seam_limit
    cad = {str(c): {"route": cadence_of(route_runs[c]), "whole_worker": cadence_of(whole_runs[c]),
                    "llama_server": cadence_of(server_runs[c], merge_s=0.0) if server_runs else None}
           for c in concurrency}
    return {"route_mode": route[one]["mode"], "route": route, "route_stepwise": stepwise, "whole_worker": whole,
            "whole_worker_mode": whole[one]["mode"], "llama_bench": lb, "llama_batched_bench": bb, "llama_rpc": rpc,
            "seam_floor": floor, "seam_bytes_limit": seam_limit, "ratios": ratios, "targets": targets,
            "cadence": cad, "llama_server": by_sessions_server(server_runs) if server_runs else
            {"skipped": True, "reason": "--no-llama-server"}}


# a route driver hands over the tokens of one answer microseconds apart: one chunk
DRIVER_CHUNK_MERGE_S = 1e-4


def cadence_of(runs: list[dict[str, Any]], merge_s: float = DRIVER_CHUNK_MERGE_S) -> dict[str, Any]:
    """Chunks per token and inter-token latency (stats.cadence) over every session of ``runs``
    (their ``chunk_times_s`` and ``tokens``): for a route or a whole-model worker, when each
    token reached the driver; for llama-server, when each streamed event reached the client."""
    from .stats import cadence

    return cadence([ts for r in runs for ts in r.get("chunk_times_s", [])],
                   [n for r in runs for n in r.get("tokens", [])], merge_s=merge_s)


def by_sessions_server(runs: Runs) -> dict[str, Any]:
    """llama-server's medians per concurrency (aggregate decode, mean TTFT), with its runs."""
    return {str(c): {"decode_tok_s": _median(v, "decode_tok_s"), "ttft_s": _median(v, "ttft_s"), "runs": v}
            for c, v in runs.items() if v}


def cadence_lines(doc: dict[str, Any]) -> list[str]:
    """Per concurrency: chunks per token and ITL of the route, the whole model and llama-server."""
    cad = doc.get("cadence")
    if not cad:
        return []
    from .stats import cadence_cells

    lines = [f"streaming cadence {'':14}{'chunks/tok':>10} {'ITL p50':>8} {'p90':>7} {'p99':>7} {'max gap':>8}  (ms)"]
    for c, lanes in cad.items():
        for lane, v in lanes.items():
            if v is not None:
                lines.append(f"{c:>3} sessions, {lane:<14}" + cadence_cells(v))
    return lines


def repeat_lines(doc: dict[str, Any]) -> list[str]:
    """The per-repeat values behind each target ratio (the targets use their median), so a reader
    sees how far single repeats move on this host."""
    return [f"  {k}: median {statistics.median(v):.2f} of the repeats " + " / ".join(f"{x:.2f}" for x in v)
            for k, v in doc["ratios"].get("paired_per_repeat", {}).items() if v]


def summary(doc: dict[str, Any]) -> str:
    r, lb = doc["ratios"], doc["llama_bench"]
    one = str(min(doc["concurrency"]))
    route, whole = doc["route"][one], doc["whole_worker"][one]
    stepwise = doc.get("route_stepwise", {}).get(one)
    n = len(doc["split"])
    lines = [
        f"model {Path(doc['model']).name}, split {','.join(doc['split'])}, {doc['threads']} threads, "
        f"pp{doc['n_prompt']} tg{doc['n_gen']}, median of {doc['repeats']}",
        f"{'':28}{'prefill tok/s':>14}{'decode tok/s':>14}",
        f"{'route (' + str(n) + ' workers, ' + doc.get('route_mode', 'stepwise') + ')':28}"
        f"{route['prefill_tok_s']:>14.1f}{route['decode_tok_s']:>14.1f}",
        *([f"{'route (' + str(n) + ' workers, stepwise)':28}{stepwise['prefill_tok_s']:>14.1f}"
           f"{stepwise['decode_tok_s']:>14.1f}"] if stepwise else []),
        f"{'whole model, 1 dgr-worker':28}{whole['prefill_tok_s']:>14.1f}{whole['decode_tok_s']:>14.1f}",
        f"{'llama-bench':28}{lb['pp_tok_s']:>14.1f}{lb['tg_tok_s']:>14.1f}",
    ]
    for c in doc["concurrency"]:
        if c == 1:
            continue
        b = doc["llama_batched_bench"]["by_batch"].get(str(c), {})
        sw = doc.get("route_stepwise", {}).get(str(c))
        lines.append(f"aggregate decode at {c} sessions: route {doc['route'][str(c)]['decode_tok_s']:.1f}, "
                     + (f"route stepwise {sw['decode_tok_s']:.1f}, " if sw else "")
                     + f"whole worker {doc['whole_worker'][str(c)]['decode_tok_s']:.1f}, "
                     f"llama-batched-bench B={c} {b.get('tg_tok_s', 0):.1f} tok/s")
    lines.append("ratios of medians: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()
                                           if k not in ("paired_median", "paired_per_repeat")))
    lines.append("paired per-repeat ratios (median; the targets use these): "
                 + ", ".join(f"{k} {v:.2f}" for k, v in r["paired_median"].items()))
    lines += cadence_lines(doc)
    lines.append(f"seam bytes per decode token per seam: {route['seam_bytes_per_decode_token']:.0f} "
                 + (f"(stepwise {stepwise['seam_bytes_per_decode_token']:.0f}) " if stepwise else "")
                 + f"(limit {doc['seam_bytes_limit']})")
    if doc.get("driver_overhead"):
        o = doc["driver_overhead"]
        lines.append(f"driver (fake workers, stepwise): {o['driver_cpu_per_hop_s'] * 1e3:.3f} ms CPU per hop per token, "
                     f"{o['wall_per_token_s'] * 1e3:.3f} ms per token over 2 hops")
        if o.get("chained"):
            ch = o["chained"]
            lines.append(f"driver (fake workers, {ch['mode']}): {ch['driver_cpu_per_token_s'] * 1e3:.3f} ms CPU per token, "
                         f"{ch['wall_per_token_s'] * 1e3:.3f} ms per token over 2 hops")
    lines.extend(profile_lines(doc))
    lines.extend(floor_lines(doc))
    lines.extend(steal_lines(doc))
    rpc = doc["llama_rpc"]
    if rpc.get("skipped"):
        lines.append(f"llama.cpp RPC split: not measured ({rpc.get('reason')})")
    else:
        lines.append(f"llama.cpp RPC split over 2 local rpc-servers (-ts {rpc.get('tensor_split')}): prefill "
                     f"{rpc['pp_tok_s']:.1f}, decode {rpc['tg_tok_s']:.1f} tok/s")
    lines.append("targets: " + ", ".join(f"{k} {'PASS' if v else 'MISS'}" for k, v in doc["targets"].items()))
    lines.extend(repeat_lines(doc))
    return "\n".join(lines)
