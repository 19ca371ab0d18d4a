"""Work records: what a route session cost, per attempt and per Shard, and how it ended.

A Route Session that survives a failed Shard runs as several **attempts**: the first on the
original route, each later one restarted from token zero on a new route (the prompt plus the
tokens already delivered prefilled again). A billing system needs to tell apart the work that
produced the answer from the work that was lost, so every record carries one status:

- ``completed``: the attempt (or the Shard's part of it) produced tokens the client received,
  and the session ended normally;
- ``cancelled``: the client (or the driver on its behalf) cancelled the session;
- ``failed``: the Shard that failed, or a session that ended without an answer;
- ``restarted``: an attempt whose route lost a Shard; its delivered tokens stand (the client has
  them), the session moved to a new route. On the surviving Shards of that attempt the work up
  to the last delivered token is verified;
- ``unverified``: the failed Shard of an attempt whose failure was **silent** (deadline or
  keepalive: the process froze or its link went dark; ``Reason.silent``). Whatever it computed after its last
  answer is unknown; it is neither billed as verified nor ever imported (KV is recomputed on
  the new route, never copied).

Tokens and compute attributed per Shard: ``prefill_tokens`` (positions the Shard prefilled in
that attempt: the prompt, plus on a restart the re-prefilled delivered tokens, counted apart as
``recomputed_tokens``), ``decode_tokens`` (tokens delivered through that attempt: every Shard of
the route computed each of them once) and ``busy_s`` (time the driver waited on it; chained mode:
the head's figure). A session record sums them: ``delivered_tokens`` (what the client received,
once each), ``recomputed_tokens`` (the cost of the restarts).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

WORK_STATUSES = ("completed", "cancelled", "failed", "restarted", "unverified")


@dataclass
class ShardWork:
    shard: str                  # endpoint[start:end)
    status: str
    prefill_tokens: int = 0
    recomputed_tokens: int = 0
    decode_tokens: int = 0
    busy_s: float = 0.0


@dataclass
class AttemptRecord:
    attempt: int                # 0: the original route
    session_id: str             # the worker-side session id of this attempt
    epoch: int
    route: list[str]
    status: str
    prompt_tokens: int          # positions prefilled (prompt + re-prefilled delivered tokens)
    recomputed_tokens: int      # of those, tokens already delivered by earlier attempts
    delivered_tokens: int       # new tokens the client received from this attempt
    ttft_s: float = 0.0         # from the attempt's start to its first token
    total_s: float = 0.0
    error: str | None = None
    failed_shard: str | None = None
    shards: list[ShardWork] = field(default_factory=list)


@dataclass
class SessionWorkRecord:
    session_id: str
    request_id: str
    status: str                 # completed / cancelled / failed (the session as the client saw it)
    prompt_tokens: int
    delivered_tokens: int = 0
    recomputed_tokens: int = 0
    restarts: int = 0
    error: str | None = None
    attempts: list[AttemptRecord] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def shard_totals(self) -> dict[str, dict[str, Any]]:
        """Per Shard, over every attempt: tokens and busy time by status."""
        out: dict[str, dict[str, Any]] = {}
        for a in self.attempts:
            for w in a.shards:
                t = out.setdefault(w.shard, {s: 0 for s in WORK_STATUSES} | {
                    "prefill_tokens": 0, "recomputed_tokens": 0, "decode_tokens": 0, "busy_s": 0.0})
                t[w.status] += 1
                t["prefill_tokens"] += w.prefill_tokens
                t["recomputed_tokens"] += w.recomputed_tokens
                t["decode_tokens"] += w.decode_tokens
                t["busy_s"] += w.busy_s
        return out


def summarize(records: list[SessionWorkRecord]) -> dict[str, Any]:
    """Totals over sessions (the route report's and the drill's ``work`` block)."""
    by_status = {s: 0 for s in ("completed", "cancelled", "failed")}
    shards: dict[str, dict[str, Any]] = {}
    for r in records:
        by_status[r.status] = by_status.get(r.status, 0) + 1
        for shard, t in r.shard_totals().items():
            acc = shards.setdefault(shard, {k: 0 for k in t})
            for k, v in t.items():
                acc[k] += v
    return {
        "sessions": by_status,
        "restarts": sum(r.restarts for r in records),
        "delivered_tokens": sum(r.delivered_tokens for r in records),
        "recomputed_tokens": sum(r.recomputed_tokens for r in records),
        "shards": shards,
    }
