"""Generation telemetry: the attribution a billing system needs for one route session —
request/work ids, status (completed, cancelled, failed), token counts and per-node timing."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

STATUSES = ("running", "completed", "cancelled", "failed")


@dataclass
class NodeTiming:
    node: str                 # endpoint[start:end)
    busy_s: float             # time the driver waited on this node (send -> response)
    steps: int                # steps the node executed for the session
    seam_bytes_in: int = 0    # boundary payload bytes the node received
    decode_busy_s: float = 0.0          # busy_s of decode steps only
    decode_steps: int = 0
    frame_bytes_in: int = 0             # serialized request frames sent to the node
    frame_bytes_out: int = 0            # serialized responses received from it
    decode_frame_bytes_in: int = 0      # request frame bytes of decode steps

    @property
    def decode_step_s(self) -> float:
        """Mean round trip of one decode step to this node, as the driver saw it."""
        return self.decode_busy_s / self.decode_steps if self.decode_steps else 0.0

    @property
    def decode_frame_bytes_per_token(self) -> float:
        return self.decode_frame_bytes_in / self.decode_steps if self.decode_steps else 0.0


@dataclass
class GenerationTelemetry:
    request_id: str
    session_id: str
    route_epoch: int
    route: list[str]
    prompt_tokens: int
    completion_tokens: int = 0
    status: str = "running"
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    error: str | None = None
    nodes: list[NodeTiming] = field(default_factory=list)
    # failover (dgr/route/failover.py): the session's work record over every attempt, on the
    # telemetry of its last attempt (completed / cancelled / failed / restarted / unverified)
    work: dict[str, Any] | None = None

    @property
    def decode_tok_s(self) -> float:
        n = max(0, self.completion_tokens - 1)  # the first token comes from prefill
        return n / self.decode_s if self.decode_s > 0 and n else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["decode_tok_s"] = self.decode_tok_s
        d["prefill_tok_s"] = self.prefill_tok_s
        for nd, n in zip(d["nodes"], self.nodes):
            nd["decode_step_s"] = n.decode_step_s
            nd["decode_frame_bytes_per_token"] = n.decode_frame_bytes_per_token
        return d
