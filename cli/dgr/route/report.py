"""What one ``dgr route run`` / ``dgr demo`` produced (:class:`RouteRun`) and its plain-text
summary table (the commands print it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .llama_whole import WholeLlama
from .parity import Isolation, Parity
from .sessions import RunReport


@dataclass
class RouteRun:
    route: RunReport                     # the sessions, concurrently, through the route
    whole: RunReport | None              # the same, concurrently, on one whole-model worker
    parity: Parity | None                # route vs whole, one session at a time: exact
    split: list[tuple[int, int]]
    model: str
    isolation: Isolation | None = None   # concurrent route sessions vs their sequential runs
    route_sequential: RunReport | None = None
    whole_sequential: RunReport | None = None
    # stock whole-model llama.cpp (llama-batched-bench at the pin), measured after the runs above
    llama: WholeLlama | None = None
    llama_error: str | None = None       # why it was asked for but not measured
    backends: list[str] = field(default_factory=list)   # per Shard, route order
    whole_backend: str = "cpu"

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "split": [f"{a}:{b}" for a, b in self.split],
                "route": self.route.to_json(), "whole": self.whole.to_json() if self.whole else None,
                "parity": self.parity.to_json() if self.parity else None,
                "isolation": self.isolation.to_json() if self.isolation else None,
                "route_sequential": self.route_sequential.to_json() if self.route_sequential else None,
                "whole_sequential": self.whole_sequential.to_json() if self.whole_sequential else None,
                "llama": self.llama.to_json() if self.llama else None, "llama_error": self.llama_error,
                "backends": self.backends, "whole_backend": self.whole_backend}


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


WHOLE_WORKER = "whole model on 1 dgr-worker"
TABLE_WIDTH = 100


def _llama_note(run: RouteRun) -> list[str]:
    """The footnote under the llama.cpp rows, or the line saying why there are none."""
    import textwrap

    if run.llama is not None and run.llama.tool == "llama-server":
        args = dict(zip(run.llama.command, run.llama.command[1:]))
        text = (f"llama.cpp rows: stock llama-server at the pin, whole model, -t {args.get('-t', '?')}, "
                f"-np {args.get('-np', '?')}, answering the same chat prompts through its OpenAI API (greedy, "
                f"streamed, no prompt cache, stopping at end-of-generation): 1 session = each prompt alone, "
                f"then all at once. TTFT is request to first streamed token.")
    elif run.llama is not None:
        args = dict(zip(run.llama.command, run.llama.command[1:]))
        text = (f"llama.cpp rows: stock llama-batched-bench at the pin, whole model, -t {args.get('-t', '?')}, "
                f"{args.get('-npp', '?')}-token prompts (the route's mean prompt length), {args.get('-ntg', '?')} "
                f"tokens generated. It decodes the B sequences in lockstep from equal-length prompts of "
                f"synthetic tokens, so its figures are the yardstick, not a run of the same prompts.")
    elif run.llama_error is not None:
        reason = " ".join(run.llama_error.split())
        text = f"llama.cpp baseline: not measured ({reason[:297] + '...' if len(reason) > 300 else reason})"
    else:
        return []
    return textwrap.wrap(text, TABLE_WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def summary_table(run: RouteRun) -> str:
    rows = [("", "TTFT ms", "prefill tok/s", "decode tok/s")]
    for s in run.route.sessions:
        rows.append((f"route  session {s.index}", f"{s.ttft_s * 1e3:.0f}", f"{s.prefill_tok_s:.0f}",
                     f"{s.decode_tok_s:.1f}" if s.error is None else "FAILED"))
    rows.append(("route  aggregate", f"{run.route.mean_ttft_s * 1e3:.0f}", f"{run.route.aggregate_prefill_tok_s:.0f}",
                 f"{run.route.aggregate_decode_tok_s:.1f}"))
    if run.whole:
        for s in run.whole.sessions:
            rows.append((f"{WHOLE_WORKER}  session {s.index}", f"{s.ttft_s * 1e3:.0f}", f"{s.prefill_tok_s:.0f}",
                         f"{s.decode_tok_s:.1f}" if s.error is None else "FAILED"))
        rows.append((f"{WHOLE_WORKER}  aggregate", f"{run.whole.mean_ttft_s * 1e3:.0f}",
                     f"{run.whole.aggregate_prefill_tok_s:.0f}", f"{run.whole.aggregate_decode_tok_s:.1f}"))
    if run.llama:
        llama_label = f"llama.cpp ({run.llama.tool})"
        for r in run.llama.rows:
            if r.sessions == 1:
                rows.append((f"{llama_label} 1 session", f"{r.ttft_s * 1e3:.0f}", f"{r.prefill_tok_s:.0f}",
                             f"{r.decode_tok_s:.1f}"))
                continue
            # each of the B sequences: the prompt phase holds all B prompts, so per-session
            # prefill is the aggregate / B (comparable to the route's "session i" rows)
            rows.append((f"{llama_label} per session ({r.sessions})", f"{r.ttft_s * 1e3:.0f}",
                         f"{r.prefill_tok_s / r.sessions:.0f}", f"{r.per_session_decode_tok_s:.1f}"))
            rows.append((f"{llama_label} aggregate ({r.sessions})", f"{r.ttft_s * 1e3:.0f}",
                         f"{r.prefill_tok_s:.0f}", f"{r.decode_tok_s:.1f}"))
    w0 = max(len(r[0]) for r in rows)
    lines = ["  ".join([r[0].ljust(w0), *(c.rjust(13) for c in r[1:])]) for r in rows]
    lines += _llama_note(run)
    if run.backends and set(run.backends) != {"cpu"}:
        lines.append(f"backends: route {','.join(run.backends)}"
                     + (f"; whole model {run.whole_backend}" if run.whole else ""))
    lines.append("")
    lines.append(f"seam bytes per decode token (per seam, protobuf frame): {run.route.seam_bytes_per_decode_token:.0f}"
                 f" ({run.route.mode} route)")
    hops = run.route.hop_decode_rtt_s
    if hops:
        who = "driver -> head, then each worker -> its next shard" if run.route.mode == "chained" else "driver -> each shard"
        lines.append("decode round trip per hop, ms (" + who + "): " + ", ".join(f"{h * 1e3:.2f}" for h in hops))
    wrows = [("worker", "RSS", "KV peak", "KV cells peak/total", "mean batch rows", "mean queue ms")]
    devices = []
    for label, rep in (("route", run.route), ("whole 1 dgr-worker", run.whole)):
        if rep is None:
            continue
        for w in rep.workers:
            wrows.append((f"{label} [{w.range})", _mb(w.rss_peak_bytes), _mb(w.kv_peak_bytes),
                          f"{w.kv_cells_peak}/{w.kv_cells_total}", f"{w.mean_batch_rows:.2f}",
                          f"{w.mean_queue_wait_s * 1e3:.2f}"))
            # the device each computes on and, on an accelerator, the memory admission predicted
            # its range needs there (VRAM; on the CPU that use is the RSS above)
            devices.append(f"[{w.range}) {w.device_class or '?'}"
                           + (f" {_mb(w.device_memory_bytes)} VRAM" if w.device_memory_bytes else ""))
    if run.llama and run.llama.rows:
        # peak RSS of the llama.cpp process; KV its sequences held at the largest B
        top = max(run.llama.rows, key=lambda r: r.sessions)
        wrows.append((f"{run.llama.tool} ({top.sessions})", _mb(run.llama.peak_rss_bytes), _mb(top.kv_bytes),
                      "-", "-", "-"))
    widths = [max(len(r[k]) for r in wrows) for k in range(len(wrows[0]))]
    lines += ["  ".join([r[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(r[1:], widths[1:]))]) for r in wrows]
    if devices:
        import textwrap

        lines += textwrap.wrap("devices: " + ", ".join(devices), TABLE_WIDTH, subsequent_indent="  ")
    if run.parity:
        p = run.parity
        lines.append("")
        lines.append(f"greedy parity vs whole model: {'OK' if p.ok else 'MISMATCH'} — {p.matched_sessions}/{p.sessions} "
                     f"sessions identical one at a time, {p.agreeing_tokens}/{p.compared_tokens} tokens agree, "
                     f"max |d logprob| {p.max_logprob_diff:.3g}")
    if run.isolation:
        i = run.isolation
        lines.append(f"concurrent isolation: {'OK' if i.ok else 'FAILED'} — {i.identical}/{i.sessions} sessions identical "
                     f"to their sequential runs, {i.near_tie_divergences} diverge at a near-tie (batched numerics, "
                     f"noise <= {i.max_noise_nats:.2f} nats)" + ("; " + "; ".join(i.violations) if i.violations else ""))
    return "\n".join(lines)
