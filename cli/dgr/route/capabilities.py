"""A host's capability for route planning and the link between hosts: what ``dgr plan`` reads
(schema dgr.capabilities.v1, docs/multi-host.md "Choosing a split") and what ``dgr worker probe``
writes (cli/dgr/route/probe.py). The cost model and the search are in planner.py."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DgrError

CAPABILITY_SCHEMA = "dgr.capabilities.v1"
MAX_SECONDS = 1e4       # a measured cost above ~3 hours is a typo, and sums of them must stay finite
MAX_MEMORY_BYTES = 1 << 50
MAX_HOSTS = 8   # the search's cost grows with hosts x layers^2 x group counts (seconds at 8 x 80)


@dataclass(frozen=True)
class HostCapability:
    """What one host measured for one model (its backend and thread count), in seconds.

    ``layer_decode_s``: one mean layer's decode step at each batch size (rows) measured;
    ``layer_prefill_s``: one mean layer per prompt token; ``output_decode_s`` / ``output_prefill_s``:
    the output matrix (and final norm) per step / per prompt token (sampling counts per row);
    ``embed_s``: the head's embedding lookup per step; ``memory_bytes``: what the host lets a
    Shard use (weights, KV cache, compute buffers)."""
    name: str
    layer_decode_s: dict[int, float]
    layer_prefill_s: float
    output_decode_s: dict[int, float]
    output_prefill_s: float
    memory_bytes: int
    embed_s: float = 0.0
    endpoint: str = ""
    # the share of the wall time the host can compute when kept busy (a CPU quota, a burstable
    # VM): the figures above are bursts at full speed (dgr worker probe measures both)
    duty: float = 1.0
    # hosts with the same non-empty label share their cores (co-located Shards, VMs on one
    # machine): their stages' compute adds up on it
    core: str = ""

    def validate(self) -> None:
        where = f"host {self.name!r}"
        if not (_positive(self.duty) and self.duty <= 1.0):
            raise DgrError(f"{where}: duty = {self.duty!r} is not a share in (0, 1]")
        if not self.name:
            raise DgrError("a host capability needs a name")
        for what, table in (("layer_decode_s", self.layer_decode_s), ("output_decode_s", self.output_decode_s)):
            if not table:
                raise DgrError(f"{where}: {what} is empty (give at least the batch size 1)")
            for b, s in table.items():
                if not isinstance(b, int) or b < 1:
                    raise DgrError(f"{where}: {what} batch size {b!r} is not a positive integer")
                if not _seconds(s):
                    raise DgrError(f"{where}: {what}[{b}] = {s!r} is not a number of seconds in (0, {MAX_SECONDS:g}]")
        for what, s in (("layer_prefill_s", self.layer_prefill_s), ("output_prefill_s", self.output_prefill_s)):
            if not _seconds(s):
                raise DgrError(f"{where}: {what} = {s!r} is not a number of seconds in (0, {MAX_SECONDS:g}]")
        if not (self.embed_s == 0 or _seconds(self.embed_s)):
            raise DgrError(f"{where}: embed_s = {self.embed_s!r} is not a number of seconds in [0, {MAX_SECONDS:g}]")
        if not isinstance(self.memory_bytes, int) or isinstance(self.memory_bytes, bool) or \
                not 0 < self.memory_bytes <= MAX_MEMORY_BYTES:
            raise DgrError(f"{where}: memory_bytes = {self.memory_bytes!r} is not an integer in 1..2**50")

    def layer_at(self, rows: int) -> float:
        return _interpolate(self.layer_decode_s, rows)

    def output_at(self, rows: int) -> float:
        return _interpolate(self.output_decode_s, rows)


@dataclass(frozen=True)
class Link:
    """The link between consecutive hosts: round trip and bandwidth (both directions alike)."""
    rtt_s: float = 0.0005
    bandwidth_bytes_s: float = 125e6   # 1 Gbit/s

    def validate(self) -> None:
        if not (isinstance(self.rtt_s, (int, float)) and math.isfinite(self.rtt_s) and 0 <= self.rtt_s <= 10):
            raise DgrError(f"link round trip {self.rtt_s!r} s is not within 0..10 s")
        if not (_positive(self.bandwidth_bytes_s) and 125 <= self.bandwidth_bytes_s <= 1.25e12):
            raise DgrError(f"link bandwidth {self.bandwidth_bytes_s!r} B/s is not within 1 kbit/s..10 Tbit/s")

    def hop_s(self, nbytes: float) -> float:
        return self.rtt_s / 2 + nbytes / self.bandwidth_bytes_s


def _seconds(x: Any) -> bool:
    """A measured time: positive, finite, and not absurd (sums of them must stay finite)."""
    return _positive(x) and x <= MAX_SECONDS


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _interpolate(table: dict[int, float], rows: int) -> float:
    """Linear in the rows between the measured batch sizes; beyond the largest, the last
    segment's per-row slope (never below the largest's time); below the smallest, its time."""
    pts = sorted(table.items())
    if rows <= pts[0][0]:
        return pts[0][1]
    for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
        if rows <= b1:
            return s0 + (s1 - s0) * (rows - b0) / (b1 - b0)
    if len(pts) == 1:
        return pts[0][1] * rows
    (b0, s0), (b1, s1) = pts[-2], pts[-1]
    return max(s1, s1 + max(0.0, (s1 - s0) / (b1 - b0)) * (rows - b1))


def load_capabilities(path: Path) -> tuple[list[HostCapability], Link | None]:
    """A capabilities file: ``{"schema": "dgr.capabilities.v1", "hosts": [...], "link": {...}}``,
    each host ``{"name", "layer_decode_s": {"1": s, "4": s, ...}, "layer_prefill_s",
    "output_decode_s": {...}, "output_prefill_s", "embed_s", "memory_bytes"}``; ``link`` (optional)
    ``{"rtt_ms", "bandwidth_mbit"}``. DgrError naming the first bad field."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise DgrError(f"cannot read {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DgrError(f"{path} is not JSON: {exc}") from None
    return parse_capabilities(doc, str(path))


def parse_capabilities(doc: Any, where: str = "capabilities") -> tuple[list[HostCapability], Link | None]:
    if not isinstance(doc, dict):
        raise DgrError(f"{where}: expected an object with 'hosts'")
    if doc.get("schema", CAPABILITY_SCHEMA) != CAPABILITY_SCHEMA:
        raise DgrError(f"{where}: schema {doc.get('schema')!r} is not {CAPABILITY_SCHEMA!r}")
    raw = doc.get("hosts")
    if not isinstance(raw, list) or not raw:
        raise DgrError(f"{where}: 'hosts' must be a non-empty list")
    if len(raw) > MAX_HOSTS:
        raise DgrError(f"{where}: {len(raw)} hosts; the planner takes at most {MAX_HOSTS}")
    hosts = []
    for i, h in enumerate(raw):
        if not isinstance(h, dict):
            raise DgrError(f"{where}: hosts[{i}] is not an object")
        try:
            cap = HostCapability(
                name=str(h.get("name") or f"host{i}"),
                layer_decode_s=_batch_table(h.get("layer_decode_s"), f"hosts[{i}].layer_decode_s"),
                layer_prefill_s=h.get("layer_prefill_s"),
                output_decode_s=_batch_table(h.get("output_decode_s"), f"hosts[{i}].output_decode_s"),
                output_prefill_s=h.get("output_prefill_s"),
                memory_bytes=h.get("memory_bytes"),
                embed_s=h.get("embed_s", 0.0),
                endpoint=str(h.get("endpoint", "")),
                duty=h.get("duty", 1.0),
                core=str(h.get("core") or ""))
        except TypeError as exc:
            raise DgrError(f"{where}: hosts[{i}]: {exc}") from None
        cap.validate()
        hosts.append(cap)
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise DgrError(f"{where}: host names must be distinct ({', '.join(names)})")
    link = None
    if "link" in doc:
        ln = doc["link"]
        if not isinstance(ln, dict):
            raise DgrError(f"{where}: 'link' is not an object")
        rtt, bw = ln.get("rtt_ms", 0.5), ln.get("bandwidth_mbit", 1000)
        if not (_positive(rtt) or (rtt == 0 and not isinstance(rtt, bool))) or not (_positive(bw) and 0.001 <= bw <= 1e7):
            raise DgrError(f"{where}: link rtt_ms {rtt!r} / bandwidth_mbit {bw!r} are not numbers > 0")
        link = Link(rtt_s=float(rtt) / 1e3, bandwidth_bytes_s=float(bw) * 1e6 / 8)
        link.validate()
    return hosts, link


def _batch_table(v: Any, where: str) -> dict[int, float]:
    if not isinstance(v, dict) or not v:
        raise DgrError(f"{where}: expected an object of batch size -> seconds")
    out = {}
    for k, s in v.items():
        try:
            b = int(k)
        except (TypeError, ValueError):
            raise DgrError(f"{where}: batch size {k!r} is not an integer") from None
        if not 1 <= b <= 4096:
            raise DgrError(f"{where}: batch size {b} is not within 1..4096")
        if not _seconds(s):
            raise DgrError(f"{where}[{k}] = {s!r} is not a number of seconds in (0, {MAX_SECONDS:g}]")
        out[b] = float(s)
    return out
