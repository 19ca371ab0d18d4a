"""What a GGUF Shard node tells the Tracker: the registration payload.

A registration binds one served layer range of one exact Model Artifact to an exact, validated
runtime recipe (and its compatibility fingerprint), the endpoint that serves it, the backend,
the device class it computes on (``recipe.device_class``, from ``GetCapability.device``; left
out of the payload when the worker reports none, so such a payload reads as before) and its
concurrency/KV capacity. Route formation (:mod:`meshnet_adapter.routing`) only ever
combines registrations whose fingerprints are equal and whose recipe is certified.

A registration may also carry what the worker measured for its own range at start-up
(:class:`ShardMeasurement`, from ``GetCapability.measured``); route formation ranks candidate
routes with the planner's cost model when every Shard of them carries one. The field is optional
and left out of the payload when absent, so a registration without it reads exactly as before
(schema 1 either way).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from dgr.errors import DgrError
from dgr.gguf.recipe import RecipeError, Registry, RuntimeRecipe, device_class_backend
from dgr.route.capabilities import MAX_MEMORY_BYTES, MAX_SECONDS

# 1: the measured cost (``measured``) is an optional field that is left out when absent, so payloads
# of unmeasured Shards are unchanged and a reader that ignores unknown fields still reads them
REGISTRATION_SCHEMA = 1
MAX_BATCH_ROWS = 4096   # the capabilities file's bound on a measured batch size
MAX_THREADS = 4096


@dataclass(frozen=True)
class Capacity:
    max_sessions: int
    active_sessions: int = 0
    kv_cells_total: int = 0
    kv_cells_used: int = 0
    max_batch_tokens: int = 0

    @property
    def free_sessions(self) -> int:
        return max(0, self.max_sessions - self.active_sessions)


@dataclass(frozen=True)
class ShardMeasurement:
    """What a worker measured for its own served range (``GetCapability.measured``), as it said it.

    Kept per range rather than per layer: turning a range's step into the planner's per-layer
    figures needs the model's shape (its layers' weights), which the Tracker has when it ranks
    routes, not necessarily where a node registers. ``decode_s``: one decode step of the whole
    range at each batch size (rows; a tail's with the logits); ``decode_no_output_s``: a tail's
    same step without logits (the difference is the output matrix); ``prompt_*``: per prompt
    token (0: not measured); ``duty``: the share of the wall time the host computes when kept
    busy; ``memory_bytes``: the worker's memory budget (0: not reported)."""

    decode_s: dict[int, float]
    decode_no_output_s: dict[int, float] = field(default_factory=dict)
    prompt_s_per_token: float = 0.0
    prompt_no_output_s_per_token: float = 0.0
    duty: float = 1.0
    threads: int = 0
    memory_bytes: int = 0
    backend: str = ""

    def validate(self, *, tail: bool) -> None:
        """DgrError naming the first figure that is not a plausible measurement (negative, zero,
        NaN, infinite, above ``MAX_SECONDS``, a non-integer batch size): the cost model sums these
        figures, and one absurd Shard would otherwise decide every ranking it takes part in. A
        tail must also give its step without logits at a measured batch size (else its output
        matrix cannot be told from its layers)."""
        for what, table in (("decode_s", self.decode_s), ("decode_no_output_s", self.decode_no_output_s)):
            if not isinstance(table, Mapping):
                raise DgrError(f"measured {what} is not a table of batch size -> seconds")
            for b, sec in table.items():
                if not _int(b) or not 1 <= b <= MAX_BATCH_ROWS:
                    raise DgrError(f"measured {what}: batch size {b!r} is not an integer in 1..{MAX_BATCH_ROWS}")
                if not _seconds(sec):
                    raise DgrError(f"measured {what}[{b}] = {sec!r} is not a number of seconds in "
                                   f"(0, {MAX_SECONDS:g}]")
        if not self.decode_s:
            raise DgrError("measured decode_s is empty (the worker measured no decode step)")
        if tail and not set(self.decode_s) & set(self.decode_no_output_s):
            raise DgrError("a tail's measurement needs its decode step without logits (decode_no_output_s) "
                           "at one of its measured batch sizes")
        for what, sec in (("prompt_s_per_token", self.prompt_s_per_token),
                          ("prompt_no_output_s_per_token", self.prompt_no_output_s_per_token)):
            if not (_number(sec) and (sec == 0 or _seconds(sec))):
                raise DgrError(f"measured {what} = {sec!r} is not 0 (not measured) or a number of seconds in "
                               f"(0, {MAX_SECONDS:g}]")
        if not (_number(self.duty) and 0 < self.duty <= 1):
            raise DgrError(f"measured duty = {self.duty!r} is not a share in (0, 1]")
        if not (_int(self.threads) and 0 <= self.threads <= MAX_THREADS):
            raise DgrError(f"measured threads = {self.threads!r} is not an integer in 0..{MAX_THREADS}")
        if not (_int(self.memory_bytes) and 0 <= self.memory_bytes <= MAX_MEMORY_BYTES):
            raise DgrError(f"measured memory_bytes = {self.memory_bytes!r} is not an integer in 0..2**50")
        if not isinstance(self.backend, str):
            raise DgrError(f"measured backend = {self.backend!r} is not a string")

    def to_json(self) -> dict[str, Any]:
        """JSON keys are strings: batch sizes become ``"1"``, ``"8"``, … (as in capabilities files)."""
        d = asdict(self)
        for k in ("decode_s", "decode_no_output_s"):
            d[k] = {str(b): sec for b, sec in sorted(getattr(self, k).items())}
        return d

    @classmethod
    def from_json(cls, doc: Any) -> "ShardMeasurement":
        """The inverse of :meth:`to_json`; DgrError on a malformed document (the figures
        themselves are checked by :meth:`validate`, which :func:`make_registration` runs)."""
        if not isinstance(doc, Mapping):
            raise DgrError("measured is not an object")
        unknown = set(doc) - {f.name for f in fields(cls)}
        if unknown:
            raise DgrError(f"measured has unknown fields: {', '.join(sorted(map(str, unknown)))}")
        kw: dict[str, Any] = dict(doc)
        for k in ("decode_s", "decode_no_output_s"):
            table = kw.get(k, {})
            if not isinstance(table, Mapping):
                raise DgrError(f"measured {k} is not an object of batch size -> seconds")
            try:
                kw[k] = {int(b): sec for b, sec in table.items()}
            except (TypeError, ValueError):
                raise DgrError(f"measured {k}: a batch size is not an integer ({', '.join(map(str, table))})") from None
        if "decode_s" not in doc:
            raise DgrError("measured has no decode_s")
        return cls(**kw)


def measurement_of_capability(cap: Any) -> ShardMeasurement | None:
    """The measured block of a worker's ``GetCapabilityResponse`` (present when the worker was
    started with ``--probe-budget-s``), or None when it measured nothing. Not validated here:
    :func:`make_registration` refuses absurd figures with the reason."""
    if not cap.HasField("measured") or not cap.measured.decode:
        return None
    m = cap.measured
    return ShardMeasurement(
        decode_s={int(b.rows): float(b.step_seconds) for b in m.decode},
        decode_no_output_s={int(b.rows): float(b.step_no_output_seconds) for b in m.decode
                            if b.step_no_output_seconds != 0},
        prompt_s_per_token=float(m.prompt_seconds_per_token),
        prompt_no_output_s_per_token=float(m.prompt_no_output_seconds_per_token),
        duty=float(m.duty) if m.duty != 0 else 1.0,   # 0: an older worker that measured no duty
        threads=int(m.threads), memory_bytes=int(cap.capacity.memory_budget_bytes),
        backend=str(cap.runtime.backend))


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _seconds(x: Any) -> bool:
    return _number(x) and 0 < x <= MAX_SECONDS


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class ShardRegistration:
    """One Shard as the Tracker's Coverage Map sees it."""

    node_id: str
    endpoint: str                  # host:port of the worker's gRPC service
    artifact_id: str
    architecture: str
    n_layer: int
    start: int
    end: int
    recipe: RuntimeRecipe
    fingerprint: str
    certified: bool                # routable recipe (certified in the registry for this backend and device class)
    capacity: Capacity
    schema: int = REGISTRATION_SCHEMA
    labels: dict[str, str] = field(default_factory=dict)
    measured: ShardMeasurement | None = None   # the worker's own measurement of its range

    @property
    def is_head(self) -> bool:
        return self.start == 0

    @property
    def is_tail(self) -> bool:
        return self.end == self.n_layer

    @property
    def device_class(self) -> str:
        """The device class the Shard computes on ("" when its worker reports none)."""
        return self.recipe.device_class

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["recipe"]["weight_types"] = [list(t) for t in self.recipe.weight_types]
        if not self.recipe.device_class:   # absent, not "": a payload without a device reads as before
            del d["recipe"]["device_class"]
        if self.measured is None:   # absent, not null: an unmeasured Shard's payload is as before
            del d["measured"]
        else:
            d["measured"] = self.measured.to_json()
        return d

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


def make_registration(*, node_id: str, endpoint: str, recipe: RuntimeRecipe, architecture: str,
                      n_layer: int, start: int, end: int, capacity: Capacity,
                      registry: Registry, measured: ShardMeasurement | None = None,
                      labels: Mapping[str, str] | None = None) -> ShardRegistration:
    """Validate and build a registration. The fingerprint is computed here, never taken from
    the caller, and the certified flag comes from the recipe registry, for the recipe's device
    class (a Shard on an unknown device, an uncertified one, or one of another backend than its
    recipe's is not certified). A device class that is not one is refused; so is a
    measurement with an absurd figure (DgrError naming it) rather than carried to route ranking."""
    if not (0 <= start < end <= n_layer):
        raise DgrError(f"invalid served range [{start}, {end}) for a {n_layer}-layer model")
    if capacity.max_sessions <= 0:
        raise DgrError("a shard must accept at least one session (max_sessions > 0)")
    if recipe.device_class:
        try:
            device_class_backend(recipe.device_class)
        except RecipeError as exc:
            raise DgrError(f"node {node_id}: device class {exc}") from None
    if measured is not None:
        try:
            measured.validate(tail=end == n_layer)
        except DgrError as exc:
            raise DgrError(f"node {node_id} [{start}:{end}]: refusing its measured cost: {exc}") from None
    return ShardRegistration(
        node_id=node_id, endpoint=endpoint, artifact_id=recipe.artifact_id, architecture=architecture,
        n_layer=n_layer, start=start, end=end, recipe=recipe, fingerprint=recipe.fingerprint(),
        certified=registry.routable(recipe), capacity=capacity, labels=dict(labels or {}), measured=measured,
    )


def registration_from_json(doc: Any, *, registry: Registry) -> ShardRegistration:
    """A registration payload (:meth:`ShardRegistration.to_json`) read back, as the Tracker receives
    it: rebuilt through :func:`make_registration`, so the range, capacity and measurement are
    checked again, the certified flag comes from *this* registry (not the sender's claim), and a
    fingerprint that does not match the recipe it came with is refused. DgrError on anything
    malformed."""
    if not isinstance(doc, Mapping):
        raise DgrError("a registration is a JSON object")
    if doc.get("schema") != REGISTRATION_SCHEMA:
        raise DgrError(f"registration schema {doc.get('schema')!r} is not {REGISTRATION_SCHEMA}")
    try:
        rd = dict(doc["recipe"])
        rd["weight_types"] = tuple((str(n), int(c)) for n, c in rd.get("weight_types", ()))
        recipe = RuntimeRecipe(**rd)
        capacity = Capacity(**doc["capacity"])
        labels = doc.get("labels") or {}
        if not isinstance(labels, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in labels.items()):
            raise DgrError("labels must map strings to strings")
        measured = ShardMeasurement.from_json(doc["measured"]) if doc.get("measured") is not None else None
        reg = make_registration(
            node_id=str(doc["node_id"]), endpoint=str(doc["endpoint"]), recipe=recipe,
            architecture=str(doc["architecture"]), n_layer=int(doc["n_layer"]), start=int(doc["start"]),
            end=int(doc["end"]), capacity=capacity, registry=registry, measured=measured, labels=labels)
    except (KeyError, TypeError, ValueError, RecipeError) as exc:
        raise DgrError(f"not a registration payload: {type(exc).__name__}: {exc}") from None
    if doc.get("fingerprint") != reg.fingerprint:
        raise DgrError(f"registration of {reg.node_id}: fingerprint {str(doc.get('fingerprint'))[:12]} does not "
                       f"match its recipe's {reg.fingerprint[:12]}")
    if doc.get("artifact_id", reg.artifact_id) != reg.artifact_id:
        raise DgrError(f"registration of {reg.node_id}: artifact_id does not match its recipe's")
    return reg
