"""Admission: may this Shard serve this hop of a route? (docs/identity.md)

:func:`admit` compares a Shard's advertised capability with a route's request and returns every
reason to reject, not just the first, so an operator sees the whole mismatch at once. The data
model is plain dataclasses; mapping to and from the protobuf messages lives elsewhere.

A Shard on a device class the registry entry does not hold for (an uncertified GPU, or a device
its worker does not report) is refused as ``backend_not_certified``, the message naming the
``dgr certify`` command that certifies that device on its machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..gguf.slice import ADAPTERS
from ..gguf.recipe import RecipeError, Registry, RuntimeRecipe, plan_backends


class Reason(str, Enum):
    ARTIFACT_MISMATCH = "artifact_mismatch"
    TOKENIZER_MISMATCH = "tokenizer_mismatch"
    ARCHITECTURE_UNSUPPORTED = "architecture_unsupported"
    ARCHITECTURE_MISMATCH = "architecture_mismatch"
    RANGE_NOT_SERVED = "range_not_served"
    BOUNDARY_SCHEMA_MISMATCH = "boundary_schema_mismatch"
    ACTIVATION_RECIPE_MISMATCH = "activation_recipe_mismatch"
    CACHE_LAYOUT_MISMATCH = "cache_layout_mismatch"
    RUNTIME_MISMATCH = "runtime_mismatch"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    RECIPE_UNREGISTERED = "recipe_unregistered"
    RECIPE_DARK = "recipe_dark"
    BACKEND_NOT_CERTIFIED = "backend_not_certified"


@dataclass(frozen=True)
class Rejection:
    reason: Reason
    detail: str

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}"


@dataclass(frozen=True)
class ShardCapability:
    """What a Shard serves: its recipe and its layer range [layer_start, layer_end) of n_layer.
    ``fingerprint`` is the value the Shard advertises (checked against its recipe when set)."""
    recipe: RuntimeRecipe
    layer_start: int
    layer_end: int
    n_layer: int
    fingerprint: str = ""


@dataclass(frozen=True)
class RouteRequest:
    """One hop of a route: the route's recipe and the layers [layer_start, layer_end) wanted
    from this Shard (a sub-range of what it serves: the effective start may be later)."""
    recipe: RuntimeRecipe
    layer_start: int
    layer_end: int
    n_layer: int
    fingerprint: str = ""


@dataclass(frozen=True)
class AdmissionDecision:
    rejections: tuple[Rejection, ...]

    @property
    def admitted(self) -> bool:
        return not self.rejections

    @property
    def reasons(self) -> frozenset[Reason]:
        return frozenset(r.reason for r in self.rejections)

    def summary(self) -> str:
        return "admitted" if self.admitted else "rejected: " + "; ".join(str(r) for r in self.rejections)


def _short(v: object) -> str:
    s = str(v)
    return s[:16] + "…" if len(s) > 20 else s


def admit(cap: ShardCapability, req: RouteRequest, registry: Registry | None = None) -> AdmissionDecision:
    """Every reason this Shard must not serve this hop; admitted when there is none.

    ``registry`` defaults to the packaged recipe registry (cli/dgr/gguf/recipes.toml).
    """
    if registry is None:
        from ..gguf.recipe import load_registry

        registry = load_registry()
    out: list[Rejection] = []
    have, want = cap.recipe, req.recipe

    def differ(reason: Reason, what: str, field: str) -> None:
        a, b = getattr(have, field), getattr(want, field)
        if a != b:
            out.append(Rejection(reason, f"{what}: shard has {_short(a)}, route wants {_short(b)}"))

    # Architecture: unknown adapters fail closed, on either side.
    for side, r in (("shard", have), ("route", want)):
        adapter = ADAPTERS.get(r.arch_adapter)
        if adapter is None:
            out.append(Rejection(Reason.ARCHITECTURE_UNSUPPORTED,
                                 f"{side} architecture {r.arch_adapter!r} has no adapter in this runtime"))
        elif adapter.version != r.arch_adapter_version:
            out.append(Rejection(Reason.ARCHITECTURE_UNSUPPORTED,
                                 f"{side} wants {r.arch_adapter} adapter v{r.arch_adapter_version}, "
                                 f"this runtime has v{adapter.version}"))
    if (have.arch_adapter, have.arch_adapter_version) != (want.arch_adapter, want.arch_adapter_version):
        out.append(Rejection(Reason.ARCHITECTURE_MISMATCH,
                             f"shard runs {have.arch_adapter} v{have.arch_adapter_version}, "
                             f"route wants {want.arch_adapter} v{want.arch_adapter_version}"))
    differ(Reason.ARTIFACT_MISMATCH, "artifact id", "artifact_id")
    differ(Reason.TOKENIZER_MISMATCH, "tokenizer digest", "tokenizer_digest")

    # Range: the wanted hop must lie inside what the Shard serves, within one model.
    if cap.n_layer != req.n_layer:
        out.append(Rejection(Reason.RANGE_NOT_SERVED,
                             f"shard's model has {cap.n_layer} layers, route's has {req.n_layer}"))
    elif not (0 <= req.layer_start < req.layer_end <= req.n_layer):
        out.append(Rejection(Reason.RANGE_NOT_SERVED,
                             f"requested layers {req.layer_start}:{req.layer_end} are not a range of "
                             f"[0, {req.n_layer})"))
    elif not (cap.layer_start <= req.layer_start and req.layer_end <= cap.layer_end):
        out.append(Rejection(Reason.RANGE_NOT_SERVED,
                             f"shard serves {cap.layer_start}:{cap.layer_end}, "
                             f"route wants {req.layer_start}:{req.layer_end}"))

    differ(Reason.BOUNDARY_SCHEMA_MISMATCH, "boundary schema version", "boundary_schema_version")
    differ(Reason.ACTIVATION_RECIPE_MISMATCH, "activation dtype on the wire", "activation_dtype")
    differ(Reason.CACHE_LAYOUT_MISMATCH, "KV cache dtype", "kv_dtype")
    differ(Reason.CACHE_LAYOUT_MISMATCH, "KV cache layout", "kv_layout")
    differ(Reason.RUNTIME_MISMATCH, "llama.cpp pin", "pin_commit")
    differ(Reason.RUNTIME_MISMATCH, "patch-series digest", "patch_digest")

    # Fingerprints: advertised values must be the ones the recipes hash to, and equal.
    try:
        fp_have, fp_want = have.fingerprint(), want.fingerprint()
    except RecipeError as exc:  # a non-canonical value: the recipe cannot be trusted at all
        out.append(Rejection(Reason.FINGERPRINT_MISMATCH, f"recipe is not canonical: {exc}"))
        fp_have = fp_want = ""
    for side, claimed, actual in (("shard", cap.fingerprint, fp_have), ("route", req.fingerprint, fp_want)):
        if claimed and actual and claimed != actual:
            out.append(Rejection(Reason.FINGERPRINT_MISMATCH,
                                 f"{side} advertises fingerprint {_short(claimed)} but its recipe hashes "
                                 f"to {_short(actual)}"))
    if fp_have and fp_want and fp_have != fp_want and not out:
        out.append(Rejection(Reason.FINGERPRINT_MISMATCH, "recipe fingerprints differ"))

    # Registry: the route's recipe class must be certified for the route's backend plan, this
    # Shard's backend must be part of that plan, and its device class certified. (If the
    # Shard's own recipe differs, the specific mismatches above already say how.)
    entry = registry.lookup(want)
    if entry is None:
        out.append(Rejection(Reason.RECIPE_UNREGISTERED,
                             f"recipe ({want.arch_adapter} v{want.arch_adapter_version}, wire "
                             f"{want.activation_dtype}, KV {want.kv_dtype}/{want.kv_layout}, boundary "
                             f"v{want.boundary_schema_version}) is not in the registry"))
    elif entry.status != "certified":
        why = f": {entry.note}" if entry.note else ""
        out.append(Rejection(Reason.RECIPE_DARK, f"recipe {entry.name} is registered but dark (not certified, "
                                                 f"not routable){why}"))
    elif want.plan not in entry.backends:
        out.append(Rejection(Reason.BACKEND_NOT_CERTIFIED,
                             f"recipe {entry.name} is certified for the backend plans {', '.join(entry.backends)}, "
                             f"not {want.plan}"))
    elif have.backend not in plan_backends(want.plan):
        out.append(Rejection(Reason.BACKEND_NOT_CERTIFIED,
                             f"shard runs on {have.backend}, which is not part of the route's backend plan {want.plan}"))
    else:
        # ... and the entry must hold for the device this Shard computes on (its device class:
        # evidence recorded on llvmpipe says nothing about a GPU); `dgr certify` extends it
        why = registry.device_refusal(entry, want.with_(backends=want.plan, backend=have.backend,
                                                         device_class=have.device_class))
        if why:
            out.append(Rejection(Reason.BACKEND_NOT_CERTIFIED, why))
    return AdmissionDecision(_dedupe(out))


def _dedupe(rs: list[Rejection]) -> tuple[Rejection, ...]:
    seen: set[tuple[Reason, str]] = set()
    out = []
    for r in rs:
        if (r.reason, r.detail) not in seen:
            seen.add((r.reason, r.detail))
            out.append(r)
    return tuple(out)
