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
    seam_bytes_in: int = 0    # boundary bytes the node received


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
        return d
