"""What a GGUF Shard node tells the Tracker: the registration payload.

A registration binds one served layer range of one exact Model Artifact to an exact, validated
runtime recipe (and its compatibility fingerprint), the endpoint that serves it, the backend,
and its concurrency/KV capacity. Route formation (:mod:`meshnet_adapter.routing`) only ever
combines registrations whose fingerprints are equal and whose recipe is certified.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from dgr.errors import DgrError
from dgr.gguf.recipe import Registry, RuntimeRecipe

REGISTRATION_SCHEMA = 1


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
    certified: bool                # routable recipe (certified in the registry for this backend)
    capacity: Capacity
    schema: int = REGISTRATION_SCHEMA
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def is_head(self) -> bool:
        return self.start == 0

    @property
    def is_tail(self) -> bool:
        return self.end == self.n_layer

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["recipe"]["weight_types"] = [list(t) for t in self.recipe.weight_types]
        return d

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


def make_registration(*, node_id: str, endpoint: str, recipe: RuntimeRecipe, architecture: str,
                      n_layer: int, start: int, end: int, capacity: Capacity,
                      registry: Registry) -> ShardRegistration:
    """Validate and build a registration. The fingerprint is computed here, never taken from
    the caller, and the certified flag comes from the recipe registry."""
    if not (0 <= start < end <= n_layer):
        raise DgrError(f"invalid served range [{start}, {end}) for a {n_layer}-layer model")
    if capacity.max_sessions <= 0:
        raise DgrError("a shard must accept at least one session (max_sessions > 0)")
    return ShardRegistration(
        node_id=node_id, endpoint=endpoint, artifact_id=recipe.artifact_id, architecture=architecture,
        n_layer=n_layer, start=start, end=end, recipe=recipe, fingerprint=recipe.fingerprint(),
        certified=registry.routable(recipe), capacity=capacity,
    )
