"""Route formation for the Tracker: from a Coverage Map of registered Shards, form only
complete, contiguous, compatible routes, and explain why a model has none.

A route is an ordered chain of Shards ``[0, a), [a, b), …, [z, n_layer)`` of one artifact whose
registrations all carry the same compatibility fingerprint, a certified recipe and free
session capacity. Dark (uncertified) recipes are never routable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .registration import ShardRegistration


@dataclass(frozen=True)
class Route:
    shards: tuple[ShardRegistration, ...]

    @property
    def fingerprint(self) -> str:
        return self.shards[0].fingerprint

    @property
    def split(self) -> str:
        return ",".join(f"{s.start}:{s.end}" for s in self.shards)

    @property
    def free_sessions(self) -> int:
        return min(s.capacity.free_sessions for s in self.shards)


@dataclass(frozen=True)
class NoRoute:
    """Why an artifact has no route: one line per reason."""
    artifact_id: str
    reasons: tuple[str, ...]


def _chains(shards: list[ShardRegistration], n_layer: int, limit: int) -> list[tuple[ShardRegistration, ...]]:
    by_start: dict[int, list[ShardRegistration]] = {}
    for s in shards:
        by_start.setdefault(s.start, []).append(s)
    for lst in by_start.values():  # prefer long hops (fewer seams), then more free capacity
        lst.sort(key=lambda s: (-(s.end - s.start), -s.capacity.free_sessions, s.node_id))
    out: list[tuple[ShardRegistration, ...]] = []

    def walk(pos: int, acc: tuple[ShardRegistration, ...]) -> None:
        if len(out) >= limit:
            return
        if pos == n_layer:
            out.append(acc)
            return
        for s in by_start.get(pos, []):
            walk(s.end, acc + (s,))

    walk(0, ())
    out.sort(key=lambda c: (len(c), -min(s.capacity.free_sessions for s in c)))
    return out


def _gaps(shards: Iterable[ShardRegistration], n_layer: int) -> list[tuple[int, int]]:
    covered = [False] * n_layer
    for s in shards:
        for i in range(s.start, s.end):
            covered[i] = True
    gaps, i = [], 0
    while i < n_layer:
        if not covered[i]:
            j = i
            while j < n_layer and not covered[j]:
                j += 1
            gaps.append((i, j))
            i = j
        else:
            i += 1
    return gaps


def form_routes(coverage: Iterable[ShardRegistration], artifact_id: str, *,
                limit: int = 8) -> list[Route] | NoRoute:
    """All (up to ``limit``) complete compatible routes for ``artifact_id``, best first, or a
    :class:`NoRoute` that names every reason (gap, mismatch, dark recipe, capacity)."""
    regs = [r for r in coverage if r.artifact_id == artifact_id]
    if not regs:
        return NoRoute(artifact_id, ("no shard of this artifact is registered",))
    n_layers = {r.n_layer for r in regs}
    if len(n_layers) != 1:
        return NoRoute(artifact_id, (f"registrations disagree on n_layer: {sorted(n_layers)}",))
    n_layer = n_layers.pop()
    routes: list[Route] = []
    reasons: list[str] = []
    groups: dict[str, list[ShardRegistration]] = {}
    for r in regs:
        groups.setdefault(r.fingerprint, []).append(r)
    for fp, members in sorted(groups.items()):
        usable = [m for m in members if m.certified and m.capacity.free_sessions > 0]
        for c in _chains(usable, n_layer, limit):
            routes.append(Route(c))
        if any(_chains(usable, n_layer, 1)):
            continue
        tag = f"recipe {fp[:12]}"
        dark = [m for m in members if not m.certified]
        full = [m for m in members if m.certified and m.capacity.free_sessions == 0]
        if dark:
            reasons.append(f"{tag}: {len(dark)} shard(s) have a dark (uncertified) recipe and are never routable: "
                           + ", ".join(f"{m.node_id}[{m.start}:{m.end}]" for m in dark))
        if full:
            reasons.append(f"{tag}: {len(full)} shard(s) have no free session capacity: "
                           + ", ".join(f"{m.node_id}[{m.start}:{m.end}]" for m in full))
        gaps = _gaps(usable, n_layer)
        if gaps:
            reasons.append(f"{tag}: layers not covered by usable shards: "
                           + ", ".join(f"[{a}:{b})" for a, b in gaps))
        elif usable:
            reasons.append(f"{tag}: usable shards cover every layer but do not chain contiguously "
                           "(overlapping ranges with no common boundary)")
    if len(groups) > 1 and not routes:
        reasons.append(f"{len(groups)} incompatible recipe fingerprints are registered; shards of different "
                       "fingerprints never combine in one route")
    if routes:
        routes.sort(key=lambda r: (len(r.shards), -r.free_sessions))
        return routes[:limit]
    return NoRoute(artifact_id, tuple(reasons))
