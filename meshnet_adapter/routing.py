"""Route formation for the Tracker: from a Coverage Map of registered Shards, form only
complete, contiguous, compatible routes, and explain why a model has none.

A route is an ordered chain of Shards ``[0, a), [a, b), …, [z, n_layer)`` of one artifact whose
registrations all carry the same compatibility fingerprint, a certified recipe and free
session capacity. Dark (uncertified) recipes are never routable.

Ranking: when every Shard of every candidate chain reports what it measured for its range
(:class:`~meshnet_adapter.registration.ShardMeasurement`) and the model's shape is known, the
candidates are ordered by the planner's predicted aggregate decode for the stated workload
(:func:`dgr.route.planner.predict`, the cost model ``dgr plan`` uses), so a chain that gives a
slow host fewer layers can rank above one with fewer seams. Otherwise they are ordered as
before measurements existed: fewest Shards, then most free sessions. The two are never mixed;
:attr:`Routes.notes` says which was used and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from dgr.errors import DgrError
from dgr.route.capabilities import MAX_MEMORY_BYTES, HostCapability, Link
from dgr.route.planner import ModelShape, Overheads, Prediction, Workload, predict

from .registration import ShardRegistration

# chains enumerated per recipe fingerprint for the cost model to choose among (the search walks
# long hops first, so a better chain with more seams may lie past the first ``limit``)
MAX_CANDIDATES = 64
RANKED_BY_PREDICTION = "predicted aggregate decode"
RANKED_BY_SHAPE = "fewest shards, then most free sessions"


@dataclass(frozen=True)
class Route:
    shards: tuple[ShardRegistration, ...]
    # the cost model's figures for this chain (None when the routes were not ranked by it)
    prediction: Prediction | None = field(default=None, compare=False, hash=False)

    @property
    def fingerprint(self) -> str:
        return self.shards[0].fingerprint

    @property
    def split(self) -> str:
        return ",".join(f"{s.start}:{s.end}" for s in self.shards)

    @property
    def free_sessions(self) -> int:
        return min(s.capacity.free_sessions for s in self.shards)

    @property
    def predicted_tok_s(self) -> float | None:
        """Predicted aggregate decode (tokens/s, every session of the workload together)."""
        return None if self.prediction is None else self.prediction.aggregate_tok_s


class Routes(list[Route]):
    """The routes formed, best first (a plain list to callers that index or iterate it), with how
    they were ranked (``ranked_by``: :data:`RANKED_BY_PREDICTION` or :data:`RANKED_BY_SHAPE`) and
    ``notes`` that say why, so a fallback to the shape order is never silent."""

    def __init__(self, routes: Iterable[Route], *, ranked_by: str, notes: Sequence[str] = ()) -> None:
        super().__init__(routes)
        self.ranked_by = ranked_by
        self.notes: tuple[str, ...] = tuple(notes)


@dataclass(frozen=True)
class NoRoute:
    """Why an artifact has no route: one line per reason."""
    artifact_id: str
    reasons: tuple[str, ...]


def _chains(shards: list[ShardRegistration], n_layer: int, limit: int) -> list[tuple[ShardRegistration, ...]]:
    """Up to ``limit`` complete chains in search order (long hops first, then more free
    capacity): a larger ``limit`` only appends chains, so its first ones are a smaller limit's."""
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
    return out


def _shape_key(c: Sequence[ShardRegistration]) -> tuple[int, int]:
    return len(c), -min(s.capacity.free_sessions for s in c)


def _names(shards: Iterable[ShardRegistration], most: int = 8) -> str:
    seen = list(dict.fromkeys(f"{s.node_id}[{s.start}:{s.end}]" for s in shards))
    return ", ".join(seen[:most]) + (f" and {len(seen) - most} more" if len(seen) > most else "")


def _probe_of(s: ShardRegistration) -> dict[str, Any]:
    """A registration's measurement in the shape of the worker probe's JSON, which
    :func:`dgr.route.probe.capability_from_probe` turns into the planner's per-layer figures."""
    m = s.measured
    assert m is not None
    return {"tail": s.is_tail, "head": s.is_head, "error": "", "layer_start": s.start, "layer_end": s.end,
            "n_layer": s.n_layer, "decode_s": {str(b): t for b, t in m.decode_s.items()},
            "decode_no_output_s": {str(b): t for b, t in m.decode_no_output_s.items()},
            "prompt_s_per_token": m.prompt_s_per_token,
            "prompt_no_output_s_per_token": m.prompt_no_output_s_per_token,
            "duty": m.duty, "threads": m.threads, "backend": m.backend, "skipped": [], "fake": False}


def _capabilities(chain: Sequence[ShardRegistration], model: ModelShape) -> list[HostCapability]:
    """Each Shard's measurement over the model's shape as a planner host (named by its node).
    The range's step is divided over its layers' weight, so the cost model gives back exactly
    the measured step for that range. A Shard that is not a tail measured no output matrix: it
    takes the chain's tail's output-to-layer ratio (as ``dgr plan --worker`` does); the cost
    model never charges it there, since its range does not end the model. A Shard that reports
    no memory budget is not bounded here: it already holds its range."""
    from dgr.route.probe import capability_from_probe, capability_of, output_ratio_of

    def memory(s: ShardRegistration) -> int:
        return s.measured.memory_bytes or MAX_MEMORY_BYTES   # type: ignore[union-attr]

    tail = chain[-1]
    tail_entry = capability_from_probe(_probe_of(tail), model, name=tail.node_id or "tail", memory_bytes=memory(tail))
    ratio = output_ratio_of(tail_entry)
    caps = []
    for s in chain:
        entry = tail_entry if s is tail else capability_from_probe(
            _probe_of(s), model, name=s.node_id or f"{s.start}:{s.end}", memory_bytes=memory(s), output_ratio=ratio)
        caps.append(capability_of(entry))
    return caps


def _predict(chains: list[tuple[ShardRegistration, ...]], n_layer: int, model: ModelShape | None,
             workload: Workload, link: Link, overheads: Overheads) -> tuple[list[Prediction] | None, str]:
    """The cost model's prediction for every chain, or None and the reason they cannot all be
    predicted (never an exception: odd measurements only keep the cost model out)."""
    shards = [s for c in chains for s in c]
    unmeasured = [s for s in shards if s.measured is None]
    if unmeasured:
        return None, f"{len(set(map(id, unmeasured)))} shard(s) report no measured cost: {_names(unmeasured)}"
    if model is None:
        return None, "every shard is measured, but no model shape was given to predict with"
    if model.n_layer != n_layer:
        return None, f"the model shape {model.name} has {model.n_layer} layers, the registrations {n_layer}"
    # checked again here, not only at registration: a registration may have been built around
    # make_registration, and the conversion below clamps figures (a NaN would read as 1 ns)
    for s in {id(s): s for s in shards}.values():
        try:
            s.measured.validate(tail=s.is_tail)   # type: ignore[union-attr]
        except DgrError as exc:
            return None, f"the measured cost of {_names([s])} is refused: {exc.one_line()}"
    out = []
    for c in chains:
        try:
            p = predict(model, _capabilities(c, model), [(s.start, s.end) for s in c], link, workload,
                        groups=len(c), overheads=overheads)
        except (DgrError, ArithmeticError, ValueError, TypeError, KeyError, AttributeError) as exc:
            msg = exc.one_line() if isinstance(exc, DgrError) else f"{type(exc).__name__}: {exc}"
            return None, f"the measured cost of {_names(c)} cannot be used: {msg}"
        if not (math.isfinite(p.aggregate_tok_s) and p.aggregate_tok_s > 0):
            return None, f"the prediction for {_names(c)} is not a finite rate ({p.aggregate_tok_s!r})"
        out.append(p)
    return out, ""


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


def form_routes(coverage: Iterable[ShardRegistration], artifact_id: str, *, limit: int = 8,
                model: ModelShape | None = None, workload: Workload | None = None, link: Link | None = None,
                overheads: Overheads | None = None) -> Routes | NoRoute:
    """All (up to ``limit``) complete compatible routes for ``artifact_id``, best first, or a
    :class:`NoRoute` that names every reason (gap, mismatch, dark recipe, capacity).

    Best first: by the cost model's predicted aggregate decode when every Shard of every
    candidate (up to :data:`MAX_CANDIDATES` per recipe) reports its measured cost and ``model``
    (the artifact's shape, :func:`dgr.route.planner.model_shape`) is given; ties, and every
    other case, by fewest Shards then most free sessions. ``workload`` (default 8 sessions of
    512-token prompts) is the load predicted for; ``link`` (default 0.5 ms RTT, 1 Gbit/s) is
    every hop's; the pipeline groups are one per Shard, as a chained head uses by default.
    The result's ``notes`` say which order was used and, for a fallback, why."""
    if limit < 1:
        raise DgrError(f"limit {limit} must be at least 1")
    regs = [r for r in coverage if r.artifact_id == artifact_id]
    if not regs:
        return NoRoute(artifact_id, ("no shard of this artifact is registered",))
    n_layers = {r.n_layer for r in regs}
    if len(n_layers) != 1:
        return NoRoute(artifact_id, (f"registrations disagree on n_layer: {sorted(n_layers)}",))
    n_layer = n_layers.pop()
    candidates: list[tuple[ShardRegistration, ...]] = []   # search order, per fingerprint
    shortlist: list[tuple[ShardRegistration, ...]] = []    # the first `limit` of each (the shape order's set)
    reasons: list[str] = []
    groups: dict[str, list[ShardRegistration]] = {}
    for r in regs:
        groups.setdefault(r.fingerprint, []).append(r)
    for fp, members in sorted(groups.items()):
        usable = [m for m in members if m.certified and m.capacity.free_sessions > 0]
        found = _chains(usable, n_layer, max(limit, MAX_CANDIDATES))
        candidates += found
        shortlist += found[:limit]
        if found:
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
    if not candidates:
        if len(groups) > 1:
            reasons.append(f"{len(groups)} incompatible recipe fingerprints are registered; shards of different "
                           "fingerprints never combine in one route")
        return NoRoute(artifact_id, tuple(reasons))
    workload = workload or Workload()
    link = link or Link()
    overheads = overheads or Overheads()
    if model is not None:   # the caller's settings, not measured data: refused when out of bounds
        workload.validate()
        link.validate()
        overheads.validate()
    predictions, why = _predict(candidates, n_layer, model, workload, link, overheads)
    if predictions is None:
        shortlist.sort(key=_shape_key)
        return Routes((Route(c) for c in shortlist[:limit]), ranked_by=RANKED_BY_SHAPE,
                      notes=(f"ranked by {RANKED_BY_SHAPE}, not by the cost model: {why}",))
    ranked = sorted(zip(candidates, predictions),
                    key=lambda cp: (-round(cp[1].aggregate_tok_s, 9), *_shape_key(cp[0])))
    return Routes((Route(c, p) for c, p in ranked[:limit]), ranked_by=RANKED_BY_PREDICTION,
                  notes=(f"ranked by {RANKED_BY_PREDICTION} over {len(candidates)} candidate route(s), for "
                         f"{workload.sessions} session(s) of {workload.prompt_tokens}-token prompts, one pipeline "
                         f"group per shard",))
