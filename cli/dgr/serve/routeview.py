"""The live route view the console shows (``GET /api/route``), from every shard's GetMetrics.

Per shard: endpoint, host, layer range, role, device class and predicted VRAM, active sessions
/ slots, queued steps, KV cells used / total, batch occupancy (mean rows per batch since the previous snapshot) and tok/s
(decode rows per second since the previous snapshot). Rates need two snapshots: the first one
reports 0.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from dgr.protocol.errors import WorkerError
from dgr.shard.v1 import shard_runtime_pb2 as pb

COUNTERS = ("dgr_decode_tokens_total", "dgr_prefill_tokens_total", "dgr_batches_total", "dgr_batch_rows_total")


def _counters(resp: pb.GetMetricsResponse) -> dict[str, float]:
    out = dict.fromkeys(COUNTERS, 0.0)
    for s in resp.samples:
        if s.name in out:
            out[s.name] += s.value
    return out


class RouteView:
    """The view of one gateway route (``engine``: its :class:`~dgr.serve.engine.Engine`; the
    route it runs on is read at each snapshot, so that a failover shows)."""

    def __init__(self, engine: Any, timeout: float = 2.0) -> None:
        self.engine = engine
        self.timeout = timeout
        self._last: dict[str, tuple[float, dict[str, float]]] = {}

    @property
    def driver(self) -> Any:
        return self.engine.driver

    async def _one(self, sh: Any) -> dict[str, Any]:
        cap = sh.capability
        row: dict[str, Any] = {
            "endpoint": sh.endpoint, "host": sh.endpoint.rsplit(":", 1)[0],
            "range": [sh.start, sh.end], "head": cap.identity.head, "tail": cap.identity.tail,
            "slots": cap.capacity.max_sessions, "ok": False,
            # the device it computes on; VRAM: what admission predicted its range needs there
            "device": cap.device.device_class or ("cpu" if cap.runtime.backend == "cpu" else ""),
            "vram_bytes": int(cap.device.memory_predicted_bytes),
        }
        try:
            r = await sh.client.metrics(timeout=self.timeout)
        except Exception as exc:   # noqa: BLE001 - shown in the view, never raised
            details = exc.details if isinstance(exc, WorkerError) else None
            row["error"] = details or str(exc) or type(exc).__name__
            return row
        now, cur = time.monotonic(), _counters(r)
        prev = self._last.get(sh.endpoint)
        self._last[sh.endpoint] = (now, cur)
        d = {k: cur[k] - prev[1][k] for k in COUNTERS} if prev else dict.fromkeys(COUNTERS, 0.0)
        dt = now - prev[0] if prev else 0.0
        row.update(ok=True, active_sessions=r.load.active_sessions, queued_steps=r.load.queued_steps,
                   kv_cells_used=r.load.kv_cells_used, kv_cells_total=r.load.kv_cells_total,
                   batch_rows_mean=d["dgr_batch_rows_total"] / d["dgr_batches_total"] if d["dgr_batches_total"] else 0.0,
                   decode_tok_s=d["dgr_decode_tokens_total"] / dt if dt > 0 else 0.0,
                   prefill_tok_s=d["dgr_prefill_tokens_total"] / dt if dt > 0 else 0.0,
                   decode_tokens_total=cur["dgr_decode_tokens_total"])
        return row

    async def snapshot(self, engine: Any) -> dict[str, Any]:
        shards = await asyncio.gather(*(self._one(s) for s in self.driver.shards))
        return {"model": engine.model_id, "mode": self.driver.mode, "shards": list(shards),
                "gateway": {"running": engine.admission.running, "queued": engine.admission.waiting,
                            "slots": engine.admission.slots}}
