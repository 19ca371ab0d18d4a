"""Runtime recipe and its compatibility fingerprint (docs/identity.md).

Over 500 lines on purpose, for now: the recipe, its fingerprint, the registry and the local
certifications it merges; the local store should move to a module of its own.

A :class:`RuntimeRecipe` records everything that decides the numbers a Shard produces. The
**compatibility fingerprint** is the sha256 of a canonical text over the subset of fields that
must be equal on every Shard of one Inference Route (``FINGERPRINT_FIELDS``). The C++ worker
computes the same value (worker/src/common/fingerprint.cpp); both check the shared vectors in
tests/vectors/fingerprint/, written by ``python -m dgr.gguf.recipe write-vectors``.

In the fingerprint (v2): ``backends``, the route's **backend plan** (``backend_plan``: the
backends of its Shards in route order, consecutive repeats collapsed, joined by ``+``: ``cpu``,
``vulkan``, ``cpu+vulkan`` for a CPU head and Vulkan tail). Kernels of different backends do not
produce the same numbers, so a Vulkan Shard never silently joins a CPU route; a mixed route is
an explicit plan every Shard of it is started with, and the registry says which plans are
certified (cli/dgr/gguf/recipes.toml). The Shard's own ``backend`` is recorded beside it.

Not in the fingerprint, deliberately: ``compute_dtype`` (a property of the backend's kernels, certified with it), ``dgr_version``
(a release label; wire compatibility is the boundary schema version), the weight
quantization (already fixed by the artifact id) and ``device_class``, the device the Shard
computes on ("cpu", "vulkan:llvmpipe", "cuda:sm_90"): Shards on different devices of one backend
may form a route, but the registry certifies a recipe class per device class (``devices``), and
an operator extends that to their own device with ``dgr certify`` (local evidence, below).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import stat
import sys
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..errors import DgrError

FINGERPRINT_HEADER = "dgr-recipe-fingerprint/v2"
BOUNDARY_SCHEMA_VERSION = 1
DEFAULT_ACTIVATION_DTYPE = "f32"
DEFAULT_COMPUTE_DTYPE = "f32"
DEFAULT_KV_DTYPE = "f16"
DEFAULT_KV_LAYOUT = "llama-unified-layer-filtered"
ACTIVATION_DTYPES = ("f32", "f16", "bf16", "q8_0")
KV_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
BACKENDS = ("cpu", "vulkan", "cuda", "hip", "metal")

# Fields that must match along a route, in canonical (sorted) order.
FINGERPRINT_FIELDS = (
    "activation_dtype", "arch_adapter", "arch_adapter_version", "artifact_id", "backends",
    "boundary_schema_version", "kv_dtype", "kv_layout", "patch_digest", "pin_commit",
    "tokenizer_digest",
)
_VALUE = re.compile(r"[A-Za-z0-9._:/+-]{1,128}")

VECTORS_DIR = Path("tests") / "vectors" / "fingerprint"

_log = logging.getLogger(__name__)

# A device class: "cpu" (the CPU backend has one), or "<backend>:<kind>" for an accelerator
# ("vulkan:llvmpipe", "vulkan:nvidia", "cuda:sm_90"). Never normalised: anything else is refused.
# The worker writes classes of at most 64 characters of [a-z0-9:_.-] (worker/src/worker/device_class.h).
_DEVICE_KIND = re.compile(r"[a-z0-9][a-z0-9._-]*")
DEVICE_CLASS_MAX = 64


class RecipeError(DgrError):
    """A recipe value that cannot be put in canonical form."""


@dataclass(frozen=True)
class RuntimeRecipe:
    """Everything that must be known to say whether two Shards compute compatible numbers."""
    artifact_id: str
    tokenizer_digest: str
    arch_adapter: str
    arch_adapter_version: int
    weight_types_digest: str = ""                 # per-tensor ggml types, as one digest
    weight_types: tuple[tuple[str, int], ...] = ()  # summary: (type name, tensor count)
    activation_dtype: str = DEFAULT_ACTIVATION_DTYPE  # on the wire, at a seam
    compute_dtype: str = DEFAULT_COMPUTE_DTYPE
    kv_dtype: str = DEFAULT_KV_DTYPE
    kv_layout: str = DEFAULT_KV_LAYOUT
    backend: str = "cpu"                          # this Shard's backend
    backends: str = ""                            # the route's backend plan ("" = backend alone)
    dgr_version: str = ""
    pin_commit: str = ""
    patch_digest: str = ""
    boundary_schema_version: int = BOUNDARY_SCHEMA_VERSION
    device_class: str = ""                        # this Shard's device ("" = cpu on cpu, else unknown)

    @property
    def effective_device_class(self) -> str:
        """The Shard's device class: the one it names, else "cpu" for a CPU Shard (the CPU
        backend has one device class; workers that predate device reporting are CPU only), else
        "" (unknown: never routable)."""
        return self.device_class or ("cpu" if self.backend == "cpu" else "")

    @property
    def plan(self) -> str:
        """The route's backend plan this Shard is part of (its own backend when not set)."""
        return self.backends or self.backend

    def fingerprint_fields(self) -> dict[str, str]:
        return {name: _canon_value(name, self.plan if name == "backends" else getattr(self, name))
                for name in FINGERPRINT_FIELDS}

    def canonical(self) -> str:
        return canonical_text(self.fingerprint_fields())

    def fingerprint(self) -> str:
        return fingerprint_of(self.fingerprint_fields())

    def with_(self, **changes: Any) -> "RuntimeRecipe":
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["weight_types"] = dict(self.weight_types)
        d["backends"] = self.plan
        d["fingerprint"] = self.fingerprint()
        return d


def _canon_value(name: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RecipeError(f"recipe field {name} must be a string or integer, got {type(value).__name__}")
    text = str(value)
    if isinstance(value, int) and value < 0:
        raise RecipeError(f"recipe field {name} must not be negative")
    if not _VALUE.fullmatch(text):
        raise RecipeError(f"recipe field {name}={text!r} is not canonical",
                          hint="values are 1-128 characters of A-Z a-z 0-9 . _ : / + -")
    return text


def canonical_text(values: dict[str, str]) -> str:
    """``dgr-recipe-fingerprint/v2`` then one ``name=value`` line per field, in FINGERPRINT_FIELDS order."""
    missing = [f for f in FINGERPRINT_FIELDS if f not in values]
    extra = [k for k in values if k not in FINGERPRINT_FIELDS]
    if missing or extra:
        raise RecipeError(f"fingerprint fields: missing {missing}, unexpected {extra}")
    lines = [FINGERPRINT_HEADER] + [f"{k}={_canon_value(k, values[k])}" for k in FINGERPRINT_FIELDS]
    return "\n".join(lines) + "\n"


def fingerprint_of(values: dict[str, str]) -> str:
    return hashlib.sha256(canonical_text(values).encode("ascii")).hexdigest()


def backend_plan(backends: "list[str] | tuple[str, ...]") -> str:
    """The backend plan of a route whose Shards run on ``backends`` (route order): consecutive
    repeats collapsed, joined by ``+`` (["cpu", "cpu"] -> "cpu"; ["cpu", "vulkan"] -> "cpu+vulkan")."""
    out: list[str] = []
    for b in backends:
        if b not in BACKENDS:
            raise RecipeError(f"unknown backend {b!r}", hint=f"one of {', '.join(BACKENDS)}")
        if not out or out[-1] != b:
            out.append(b)
    if not out:
        raise RecipeError("a route needs at least one backend")
    return "+".join(out)


def plan_backends(plan: str) -> list[str]:
    return plan.split("+") if plan else []


def device_class_backend(device_class: str) -> str:
    """The backend of a device class ("cpu" -> cpu, "vulkan:nvidia" -> vulkan); RecipeError
    for anything that is not one (odd characters, an unknown backend, "cpu:x")."""
    if not isinstance(device_class, str):
        raise RecipeError(f"a device class is a string, not {type(device_class).__name__}")
    if device_class == "cpu":
        return "cpu"
    backend, sep, kind = device_class.partition(":")
    if (not sep or backend not in BACKENDS or backend == "cpu" or not _DEVICE_KIND.fullmatch(kind)
            or len(device_class) > DEVICE_CLASS_MAX):
        shown = device_class if len(device_class) <= 80 else device_class[:77] + "..."
        raise RecipeError(f"{shown!r} is not a device class",
                          hint="'cpu', or BACKEND:KIND such as vulkan:llvmpipe or cuda:sm_90: at most "
                               f"{DEVICE_CLASS_MAX} characters, KIND of a-z 0-9 . _ -")
    return backend


def device_class_of_capability(cap: Any) -> str:
    """The device class a worker's ``GetCapabilityResponse`` reports (``device.device_class``);
    "cpu" for a CPU worker that reports no device (one built before device reporting); "" when
    unknown (an accelerator worker that reports none). Not validated here."""
    device = getattr(cap, "device", None)
    reported = str(getattr(device, "device_class", "") or "") if device is not None else ""
    if reported:
        return reported
    if device is None:
        empty = True
    elif hasattr(device, "ByteSize"):
        empty = device.ByteSize() == 0
    else:
        empty = not any(vars(device).values())
    return "cpu" if empty and str(cap.runtime.backend) == "cpu" else ""


def certify_command(plan: str) -> str:
    """The command that certifies this machine's device for a backend plan."""
    return f"dgr certify --backend {','.join(plan_backends(plan)) or 'cpu'}"


# ---- building a recipe for a local artifact ----

def local_runtime() -> tuple[str, str, str]:
    """(dgr version, pin commit, patch-series digest) of this checkout."""
    from .. import __version__
    from ..upstream import patchstack, pin

    return __version__, pin.load_pin().commit, patchstack.default_stack().series_digest()


def recipe_for(path: str | Path, *, backend: str = "cpu", activation_dtype: str = DEFAULT_ACTIVATION_DTYPE,
               compute_dtype: str = DEFAULT_COMPUTE_DTYPE, kv_dtype: str = DEFAULT_KV_DTYPE,
               kv_layout: str = DEFAULT_KV_LAYOUT, runtime: tuple[str, str, str] | None = None,
               progress: bool = True, backends: str = "") -> RuntimeRecipe:
    """The recipe a Shard of this GGUF (a whole artifact or a slice) would serve on this runtime,
    on ``backend``, as part of a route with backend plan ``backends`` (default: ``backend``)."""
    from . import identity
    from .gguf_set import open_model
    from .slice import adapter_for, read_slice_info

    if backend not in BACKENDS:
        raise RecipeError(f"unknown backend {backend!r}", hint=f"one of {', '.join(BACKENDS)}")
    if backends and backend not in plan_backends(backend_plan(plan_backends(backends))):
        raise RecipeError(f"backend {backend} is not part of the route's backend plan {backends}")
    with open_model(path) as gf:   # a single file, or the split set any part names
        if gf.is_slice:
            info = read_slice_info(gf)
            artifact_id, tok, manifest = info.source_artifact_id, info.source_tokenizer_digest, info.source_manifest
        else:
            manifest = None
        arch = gf.architecture
    if manifest is None:
        ident = identity.identify(path, progress=progress)
        artifact_id, tok, manifest = ident.artifact_id, ident.tokenizer_digest, ident.manifest
    adapter = adapter_for(arch)
    dgr_version, pin_commit, patch_digest = runtime or local_runtime()
    return RuntimeRecipe(
        artifact_id=artifact_id, tokenizer_digest=tok, arch_adapter=adapter.name,
        arch_adapter_version=adapter.version,
        weight_types_digest=identity.weight_types_digest(manifest),
        weight_types=tuple(identity.weight_types_summary(manifest).items()),
        activation_dtype=activation_dtype, compute_dtype=compute_dtype, kv_dtype=kv_dtype,
        kv_layout=kv_layout, backend=backend, backends=backends, dgr_version=dgr_version, pin_commit=pin_commit,
        patch_digest=patch_digest, boundary_schema_version=BOUNDARY_SCHEMA_VERSION)


# ---- registry: certified vs registered-but-dark ----

REGISTRY_FILE = Path(__file__).resolve().parent / "recipes.toml"
STATUSES = ("certified", "dark")


@dataclass(frozen=True)
class LocalCertification:
    """A device class certified on this machine for an entry's backend plan (``dgr certify``),
    with the runtime (llama.cpp pin, patch series) it was measured with: it holds for Shards of
    that runtime only."""
    plan: str
    device_class: str
    pin_commit: str
    patch_digest: str
    path: str = ""
    date: str = ""


@dataclass(frozen=True)
class RegistryEntry:
    """A recipe class: the fields a certification run fixes (artifact and runtime are free)."""
    name: str
    status: str
    arch_adapter: str
    arch_adapter_version: int
    activation_dtype: str
    kv_dtype: str
    kv_layout: str
    boundary_schema_version: int
    backends: tuple[str, ...]          # the backend plans certified ("cpu", "vulkan", "cpu+vulkan", …)
    evidence: str = ""
    note: str = ""
    # What a certification of a plan that is not bit-exact against the CPU whole model allows
    # (mixed plans): e.g. {"tokens": 64, "top1_agreement_min": 0.95, "max_abs_dlogprob": 0.5}.
    tolerance: tuple[tuple[str, float], ...] = ()
    # The device classes the evidence was recorded on ("cpu", "vulkan:llvmpipe"); recipes.toml
    # states them for every certified entry (an entry built in code defaults to the CPU). Empty:
    # no device has evidence for the entry's plans in the repository, so a Shard is routable only
    # on a device class this machine certified (`dgr certify`, merged into ``local``).
    devices: tuple[str, ...] = ("cpu",)
    # Device classes certified on this machine (local evidence, merged by load_registry).
    local: tuple[LocalCertification, ...] = ()

    def matches(self, r: RuntimeRecipe) -> bool:
        return (self.arch_adapter, self.arch_adapter_version, self.activation_dtype, self.kv_dtype,
                self.kv_layout, self.boundary_schema_version) == (
            r.arch_adapter, r.arch_adapter_version, r.activation_dtype, r.kv_dtype, r.kv_layout,
            r.boundary_schema_version)

    def certified_devices(self, plan: str | None = None) -> tuple[str, ...]:
        """The device classes this entry holds for: its evidence's, then this machine's (for
        ``plan``, or any plan), in that order, without repeats."""
        out = list(self.devices)
        for c in self.local:
            if (plan is None or c.plan == plan) and c.device_class not in out:
                out.append(c.device_class)
        return tuple(out)

    def local_devices(self, plan: str | None = None) -> tuple[str, ...]:
        """The device classes only this machine's evidence adds (for ``plan``, or any plan)."""
        return tuple(d for d in self.certified_devices(plan) if d not in self.devices)


@dataclass(frozen=True)
class Registry:
    entries: tuple[RegistryEntry, ...]
    ignored: tuple[str, ...] = ()      # local evidence files not honoured, each "PATH: reason"
    store: str = ""                    # the local evidence folder that was read ("" none)

    def lookup(self, recipe: RuntimeRecipe) -> RegistryEntry | None:
        """The entry of this recipe's class that lists its backend plan; else the first entry of
        its class (which then does not certify the plan); None when the class is unknown."""
        cls = [e for e in self.entries if e.matches(recipe)]
        return next((e for e in cls if recipe.plan in e.backends), cls[0] if cls else None)

    def device_refusal(self, entry: RegistryEntry, recipe: RuntimeRecipe) -> str:
        """Why ``entry`` does not hold for the device ``recipe``'s Shard computes on (its
        ``effective_device_class``); "" when it does: a device class of the entry's evidence,
        or one certified on this machine for the recipe's plan and runtime."""
        plan, cls = recipe.plan, recipe.effective_device_class
        how = f"run `{certify_command(plan)}` on this machine"
        if not cls:
            return (f"the device class of this {recipe.backend} Shard is unknown (its worker reports no device; "
                    f"a dgr-worker built before device reporting): not routable on an uncertified device")
        try:
            backend = device_class_backend(cls)
        except RecipeError as exc:
            return f"{exc}: not routable"
        if backend != recipe.backend:
            return f"device class {cls} is not a {recipe.backend} device: not routable"
        if cls in entry.devices:
            return ""
        local = [c for c in entry.local if c.plan == plan and c.device_class == cls]
        if any((c.pin_commit, c.patch_digest) == (recipe.pin_commit, recipe.patch_digest) for c in local):
            return ""
        if local:
            c = local[0]
            return (f"recipe {entry.name} (plan {plan}) was certified on {cls} on this machine with llama.cpp "
                    f"{c.pin_commit[:12]} and patch series {c.patch_digest[-12:]}, this Shard runs "
                    f"{recipe.pin_commit[:12]} and {recipe.patch_digest[-12:]}: {how} again")
        where = ", ".join(entry.certified_devices(plan)) or "no device"
        return f"recipe {entry.name} (plan {plan}) is certified on {where}, not on device class {cls}: {how}"

    def refusal(self, recipe: RuntimeRecipe) -> str:
        """Why ``recipe`` is not routable, in one sentence; "" when it is."""
        e = self.lookup(recipe)
        if e is None:
            return (f"recipe class ({recipe.arch_adapter} v{recipe.arch_adapter_version}, wire "
                    f"{recipe.activation_dtype}, KV {recipe.kv_dtype}/{recipe.kv_layout}, boundary "
                    f"v{recipe.boundary_schema_version}) is not in the registry")
        if e.status != "certified":
            return f"recipe {e.name} is registered but dark (not certified)"
        if recipe.plan not in e.backends:
            return f"recipe {e.name} is certified for the backend plans {', '.join(e.backends)}, not {recipe.plan}"
        if recipe.backend not in plan_backends(recipe.plan):
            return f"the Shard runs on {recipe.backend}, which is not part of the backend plan {recipe.plan}"
        return self.device_refusal(e, recipe)

    def routable(self, recipe: RuntimeRecipe) -> bool:
        """Certified for this recipe's class and backend plan, with the Shard's own backend part
        of the plan, on a device class the entry holds for. Dark and unknown recipes, and
        Shards on an unknown or uncertified device, never route."""
        return not self.refusal(recipe)


def _check_devices(path: Path, e: RegistryEntry) -> None:
    for d in e.devices:
        try:
            backend = device_class_backend(d)
        except RecipeError as exc:
            raise DgrError(f"recipe registry {path}: {e.name} lists device {exc}") from None
        if not any(backend in plan_backends(p) for p in e.backends):
            raise DgrError(f"recipe registry {path}: {e.name} lists device {d}, a {backend} device, "
                           f"for the backend plans {', '.join(e.backends)}")


def load_registry(path: Path | None = None, *, local: bool | None = None, warn: bool = True) -> Registry:
    """The recipe registry (default: the packaged recipes.toml). ``local`` (default: only for the
    packaged registry) merges this machine's device evidence from :func:`local_store_dir`: an
    entry then also holds for the device classes ``dgr certify`` certified here; evidence that
    does not hold is ignored with the reason (``Registry.ignored``, and a warning once per
    process unless ``warn`` is false)."""
    use_local = path is None if local is None else local
    path = path or REGISTRY_FILE
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DgrError(f"recipe registry not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise DgrError(f"recipe registry {path} is not valid TOML: {exc}") from None
    entries = []
    names: set[str] = set()
    for i, raw in enumerate(data.get("recipe", [])):
        try:
            devices = raw.get("devices")
            e = RegistryEntry(
                name=str(raw["name"]), status=str(raw["status"]), arch_adapter=str(raw["arch_adapter"]),
                arch_adapter_version=int(raw["arch_adapter_version"]),
                activation_dtype=str(raw["activation_dtype"]), kv_dtype=str(raw["kv_dtype"]),
                kv_layout=str(raw["kv_layout"]), boundary_schema_version=int(raw["boundary_schema_version"]),
                backends=tuple(str(b) for b in raw["backends"]), evidence=str(raw.get("evidence", "")),
                note=str(raw.get("note", "")),
                tolerance=tuple((str(k), float(v)) for k, v in dict(raw.get("tolerance", {})).items()),
                devices=() if devices is None else tuple(str(d) for d in devices))
        except (KeyError, TypeError, ValueError) as exc:
            raise DgrError(f"recipe registry {path}: entry {i} is incomplete ({exc})") from None
        if e.status not in STATUSES:
            raise DgrError(f"recipe registry {path}: {e.name} has status {e.status!r}, want certified or dark")
        if e.status == "certified" and not e.evidence:
            raise DgrError(f"recipe registry {path}: {e.name} is certified without evidence",
                           hint="certification needs the evidence folder of a real distributed forward")
        for plan in e.backends:
            try:
                if backend_plan(plan_backends(plan)) != plan:
                    raise RecipeError(plan)
            except RecipeError:
                raise DgrError(f"recipe registry {path}: {e.name} lists {plan!r}, not a backend plan "
                               f"(backends of {', '.join(BACKENDS)} joined by '+')") from None
        if e.status == "certified" and any("+" in b for b in e.backends) and not e.tolerance:
            raise DgrError(f"recipe registry {path}: {e.name} certifies a mixed backend plan without a tolerance",
                           hint="a mixed plan is certified within a stated drift tolerance (tolerance = {…})")
        if e.status == "certified" and raw.get("devices") is None:
            raise DgrError(f"recipe registry {path}: {e.name} is certified without devices",
                           hint="devices = [...]: the device classes its evidence was recorded on, e.g. [\"cpu\"]; "
                                "devices = [] for a plan no device has evidence for in the repository (routable "
                                "only where `dgr certify` recorded local evidence)")
        _check_devices(Path(path), e)
        if e.name in names:
            raise DgrError(f"recipe registry {path}: duplicate entry {e.name}")
        names.add(e.name)
        entries.append(e)
    if not use_local:
        return Registry(tuple(entries))
    store = local_store_dir()
    found, ignored = read_local_evidence(store, entries)
    for why in ignored if warn else ():
        if why not in _WARNED:
            _WARNED.add(why)
            _log.warning("local device evidence ignored: %s", why)
    merged = tuple(replace(e, local=tuple(found.get(e.name, ()))) for e in entries)
    return Registry(merged, tuple(ignored), str(store))


def _figure(v: Any) -> float | None:
    """A measured figure as a float ("inf" reads infinity); None when it is not a number."""
    if v == "inf":
        return math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)


def tolerance_problems(figures: Any, tolerance: tuple[tuple[str, float], ...], what: str) -> list[str]:
    """Each bound of ``tolerance`` the measured ``figures`` (a drift record: tokens,
    top1_agreement, max_abs_dlogprob, …) break, or do not state, each naming ``what``."""
    if not isinstance(figures, dict):
        return [f"{what} has no drift figures"]
    out = []
    for key, bound in tolerance:
        name = key[:-4] if key.endswith("_min") else key
        v = _figure(figures.get(name))
        ok = v is not None and (v >= bound if key.endswith("_min") or key == "tokens" else v <= bound)
        if not ok:
            out.append(f"{what} measured {name} = {figures.get(name)}, tolerance {key} = {bound:g}")
    return out


def certification_problems(entry: RegistryEntry, root: Path) -> list[str]:
    """Why ``entry``'s certification does not follow from its evidence (empty: it does). A
    certified entry needs ``<root>/<evidence>/results.json`` with verdict pass; one with a
    tolerance needs, for each of its plans, a drift record there within that tolerance."""
    if entry.status != "certified":
        return []
    res = Path(root) / entry.evidence / "results.json"
    try:
        doc = json.loads(res.read_text())
    except (OSError, ValueError) as exc:
        return [f"{entry.name}: cannot read {res}: {exc}"]
    out = [] if doc.get("verdict") == "pass" else [f"{entry.name}: {entry.evidence} verdict is {doc.get('verdict')}"]
    if not entry.tolerance:
        return out
    drift = {d.get("plan"): d for d in doc.get("metrics", {}).get("drift", [])}
    for plan in entry.backends:
        d = drift.get(plan)
        if d is None:
            out.append(f"{entry.name}: {entry.evidence} has no drift measurement of plan {plan}")
            continue
        out += tolerance_problems(d, entry.tolerance, f"{entry.name}: plan {plan}")
    return out


# ---- local device evidence: `dgr certify` on this machine ----

EVIDENCE_KIND = "dgr-device-certification"
EVIDENCE_SCHEMA = 1
EVIDENCE_MAX_BYTES = 1 << 20
_WARNED: set[str] = set()


def local_store_dir() -> Path:
    """Where this machine's device evidence lives: ``$DGR_CERT_DIR``, else
    ``$XDG_DATA_HOME/dgr/certified``, else ``~/.local/share/dgr/certified``. Per machine, never in
    the repository: it certifies this machine's devices only."""
    env = os.environ.get("DGR_CERT_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "share"
    return base / "dgr" / "certified"


class _Ignored(Exception):
    """A local evidence document that does not hold (the message says why)."""


def _need(doc: dict, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    v = doc.get(key)
    if isinstance(v, bool) and kind is not bool or not isinstance(v, kind):
        raise _Ignored(f"{key} is missing or not {what}")
    return v


_RECIPE_TYPES = {f.name: f.type for f in fields(RuntimeRecipe)}


def _evidence_recipe(rd: Any) -> RuntimeRecipe:
    if not isinstance(rd, dict):
        raise _Ignored("recipe is missing or not an object")
    kw: dict[str, Any] = {}
    for name, typ in _RECIPE_TYPES.items():
        if name == "weight_types" or name not in rd:
            continue
        v = rd[name]
        want_int = typ in (int, "int")
        if isinstance(v, bool) or not isinstance(v, int if want_int else str):
            raise _Ignored(f"recipe field {name} is not {'an integer' if want_int else 'a string'}")
        kw[name] = v
    missing = [f for f in ("artifact_id", "tokenizer_digest", "arch_adapter", "arch_adapter_version") if f not in kw]
    if missing:
        raise _Ignored(f"recipe lacks {', '.join(missing)}")
    return RuntimeRecipe(**kw)


def check_evidence(doc: Any, entries: "tuple[RegistryEntry, ...] | list[RegistryEntry]", *,
                   allow_fake: bool = False) -> list[LocalCertification]:
    """The device certifications a local evidence document gives (one per device class of its
    plan); :class:`DgrError` saying why it gives none: not a certification, malformed, fake, for
    an entry that is not certified for its plan, a recipe of another class, a fingerprint that
    is not its recipe's (another artifact or runtime), or figures the entry's exact parity or
    current tolerance does not allow."""
    try:
        return _check_evidence(doc, tuple(entries), allow_fake)
    except _Ignored as exc:
        raise DgrError(str(exc)) from None


def _check_evidence(doc: Any, entries: tuple[RegistryEntry, ...], allow_fake: bool) -> list[LocalCertification]:
    if not isinstance(doc, dict):
        raise _Ignored("not a JSON object")
    if doc.get("kind") != EVIDENCE_KIND or doc.get("schema") != EVIDENCE_SCHEMA:
        raise _Ignored(f"not a dgr device certification (kind {str(doc.get('kind'))[:40]!r}, schema "
                       f"{str(doc.get('schema'))[:10]}; want {EVIDENCE_KIND} schema {EVIDENCE_SCHEMA})")
    fake = _need(doc, "fake", bool, "true or false")
    if fake and not allow_fake:
        raise _Ignored("recorded by fake-model workers (dgr certify --fake): certifies nothing")
    if doc.get("verdict") != "pass":
        raise _Ignored(f"verdict is {str(doc.get('verdict'))[:40]!r}, not pass")
    name = _need(doc, "entry", str, "a registry entry name")
    plan = _need(doc, "plan", str, "a backend plan")
    try:
        if backend_plan(plan_backends(plan)) != plan:
            raise RecipeError(plan)
    except RecipeError:
        raise _Ignored(f"plan {plan[:40]!r} is not a backend plan") from None
    classes = _need(doc, "device_classes", list, "a list of device classes")
    if not classes or not all(isinstance(c, str) for c in classes):
        raise _Ignored("device_classes is not a list of device classes")
    by_backend: dict[str, str] = {}
    for c in classes:
        try:
            b = device_class_backend(c)
        except RecipeError as exc:
            raise _Ignored(f"device_classes: {exc}") from None
        if b in by_backend:
            raise _Ignored(f"device_classes names two {b} devices ({by_backend[b]}, {c}): one per backend")
        by_backend[b] = c
    if set(by_backend) != set(plan_backends(plan)):
        raise _Ignored(f"device_classes {', '.join(classes)} are not one device per backend of the plan {plan}")
    entry = next((e for e in entries if e.name == name), None)
    if entry is None:
        raise _Ignored(f"names recipe class {name[:80]!r}, which the registry does not have")
    if entry.status != "certified" or plan not in entry.backends:
        raise _Ignored(f"recipe {name} is not certified for the backend plan {plan} (a device certification "
                       "extends a certified entry to another device, nothing else)")
    recipe = _evidence_recipe(doc.get("recipe"))
    try:
        fp = recipe.fingerprint()
    except RecipeError as exc:
        raise _Ignored(f"its recipe is not canonical: {exc}") from None
    if recipe.plan != plan:
        raise _Ignored(f"its recipe's backend plan {recipe.plan} is not {plan}")
    if doc.get("fingerprint") != fp:
        raise _Ignored(f"fingerprint {str(doc.get('fingerprint'))[:16]} is not its recipe's {fp[:16]} "
                       "(evidence for another artifact or runtime)")
    if doc.get("artifact_id") != recipe.artifact_id:
        raise _Ignored(f"artifact_id {str(doc.get('artifact_id'))[:16]} is not its recipe's {recipe.artifact_id[:16]}")
    if not entry.matches(recipe):
        raise _Ignored(f"its recipe ({recipe.arch_adapter} v{recipe.arch_adapter_version}, wire "
                       f"{recipe.activation_dtype}, KV {recipe.kv_dtype}/{recipe.kv_layout}) is not of class {name}")
    runs = _need(doc, "runs", list, "a list of runs")
    if not runs:
        raise _Ignored("runs is empty")
    for i, run in enumerate(runs):
        if not isinstance(run, dict):
            raise _Ignored(f"run {i} is not an object")
        if "+" in plan:
            bad = tolerance_problems(run.get("drift"), entry.tolerance, f"run {i}")
            if bad:
                raise _Ignored("outside the tolerance of " + name + ": " + "; ".join(bad))
        else:
            parity = run.get("parity")
            if not isinstance(parity, dict) or parity.get("identical") is not True:
                raise _Ignored(f"run {i} does not record exact greedy parity")
    date = doc.get("date") if isinstance(doc.get("date"), str) else ""
    return [LocalCertification(plan, c, recipe.pin_commit, recipe.patch_digest, "", date[:40]) for c in classes]


def read_local_evidence(store: Path, entries: "tuple[RegistryEntry, ...] | list[RegistryEntry]",
                        ) -> tuple[dict[str, list[LocalCertification]], list[str]]:
    """Every ``*.json`` in ``store`` read as local evidence: (entry name -> certifications,
    ["PATH: why it was ignored", …]). A missing folder is no evidence; nothing here raises."""
    found: dict[str, list[LocalCertification]] = {}
    ignored: list[str] = []
    try:
        names = sorted(p.name for p in Path(store).iterdir())
    except FileNotFoundError:
        return found, ignored
    except OSError as exc:
        return found, [f"{store}: cannot list it ({exc.strerror or exc})"]
    for fname in names:
        if not fname.endswith(".json") or fname.startswith("."):
            continue
        path = Path(store) / fname
        try:
            st = path.stat()
            if not stat.S_ISREG(st.st_mode):
                raise _Ignored("not a regular file")
            if st.st_size > EVIDENCE_MAX_BYTES:
                raise _Ignored(f"{st.st_size} bytes, more than {EVIDENCE_MAX_BYTES} (not evidence)")
            with open(path, "rb") as f:
                raw = f.read(EVIDENCE_MAX_BYTES + 1)
            try:
                doc = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as exc:
                raise _Ignored(f"not JSON ({exc})") from None
            certs = _check_evidence(doc, tuple(entries), False)
        except _Ignored as exc:
            ignored.append(f"{path}: {exc}")
            continue
        except OSError as exc:
            ignored.append(f"{path}: cannot read it ({exc.strerror or exc})")
            continue
        except RecursionError:
            ignored.append(f"{path}: nested too deeply (not evidence)")
            continue
        found.setdefault(doc["entry"], []).extend(replace(c, path=str(path)) for c in certs)
    return found, ignored


def evidence_file_name(doc: dict) -> str:
    """``<entry>.<plan>.<device classes>.json`` (":" written "_"): a later certification of the
    same entry, plan and devices replaces the earlier one."""
    raw = f"{doc['entry']}.{doc['plan']}.{'+'.join(doc['device_classes'])}"
    return re.sub(r"[^A-Za-z0-9._+-]", "_", raw)[:200] + ".json"


def write_local_evidence(doc: dict, store: Path | None = None, *, allow_fake: bool = False,
                         registry: "Registry | None" = None) -> Path:
    """Write ``doc`` (checked as :func:`read_local_evidence` will read it) into the local store,
    atomically; the path. Refused inside the repository checkout: the evidence holds for this
    machine only and must not be committed."""
    from .. import paths

    store = Path(store or local_store_dir()).expanduser()
    try:
        repo = paths.repo_root()
    except DgrError:
        repo = None
    if repo is not None and (store.resolve() == repo or repo in store.resolve().parents):
        raise DgrError(f"local device evidence would go to {store}, inside the repository {repo}",
                       hint="it holds for this machine only: set DGR_CERT_DIR to a folder outside the checkout")
    entries = (registry or load_registry(local=False)).entries
    check_evidence(doc, entries, allow_fake=allow_fake)
    try:
        store.mkdir(parents=True, exist_ok=True)
        path = store / evidence_file_name(doc)
        tmp = store / f".{path.name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise DgrError(f"cannot write local device evidence to {store}: {exc.strerror or exc}") from None
    return path


# ---- shared test vectors (C++ and Python) ----

def _vector_cases() -> list[tuple[str, dict[str, str] | None, dict[str, Any]]]:
    base = RuntimeRecipe(
        artifact_id="a3e57daae193ff32f1ffed53f899498f7bb1f4fb2986d4f4731e7c0263e8b857",
        tokenizer_digest=hashlib.sha256(b"tokenizer").hexdigest(),
        arch_adapter="llama", arch_adapter_version=1, dgr_version="0.1.0",
        pin_commit="0c1e57098bba43ac29e6e3b677cdceebdd22334f",
        patch_digest=hashlib.sha256(b"series").hexdigest())
    cases: list[tuple[str, dict[str, str] | None, dict[str, Any]]] = [
        ("baseline", None, {}),
        ("activation_f16", None, {"activation_dtype": "f16"}),
        ("kv_q8_0", None, {"kv_dtype": "q8_0"}),
        ("kv_layout_other", None, {"kv_layout": "llama-unified-v2"}),
        ("boundary_schema_2", None, {"boundary_schema_version": 2}),
        ("adapter_version_2", None, {"arch_adapter_version": 2}),
        ("other_artifact", None, {"artifact_id": hashlib.sha256(b"other").hexdigest()}),
        ("other_tokenizer", None, {"tokenizer_digest": hashlib.sha256(b"tok2").hexdigest()}),
        ("other_pin", None, {"pin_commit": "1" * 40}),
        ("other_patches", None, {"patch_digest": hashlib.sha256(b"series2").hexdigest()}),
        ("arch_qwen3", None, {"arch_adapter": "qwen3"}),
        ("backend_vulkan", None, {"backend": "vulkan"}),
        ("plan_cpu_vulkan", None, {"backends": "cpu+vulkan"}),
        ("plan_vulkan_cpu", None, {"backends": "vulkan+cpu"}),
        # Fields outside the fingerprint: same fingerprint as baseline.
        ("outside_fields_same_fp", None, {"compute_dtype": "f16", "dgr_version": "9.9.9"}),
    ]
    out = []
    for name, _, change in cases:
        r = base.with_(**change)
        out.append((name, r.fingerprint_fields(), {"fingerprint": r.fingerprint()}))
    # Invalid values: both sides must refuse them.
    bad = dict(base.fingerprint_fields())
    for name, field, value in (("error_space", "kv_layout", "llama unified"),
                               ("error_newline", "activation_dtype", "f32\nkv_dtype=f16"),
                               ("error_trailing_newline", "kv_dtype", "f16\n"),
                               ("error_non_ascii", "arch_adapter", "llam\u00e4"),
                               ("error_equals", "arch_adapter", "llama=1"),
                               ("error_empty", "pin_commit", ""),
                               ("error_too_long", "kv_layout", "x" * 129),
                               ("error_backends_space", "backends", "cpu vulkan")):
        out.append((name, {**bad, field: value}, {"expect": "error"}))
    return out


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def write_vectors(dest: Path) -> list[Path]:
    """Write tests/vectors/fingerprint/{recipes,sha256}.txt (generated; never edited by hand)."""
    dest.mkdir(parents=True, exist_ok=True)
    lines = ["# dgr recipe fingerprint vectors: generated by `python -m dgr.gguf.recipe write-vectors`; do not edit.",
             "# Blocks: 'case=NAME', one 'field=value' line per fingerprint field (values escape",
             "# backslash as \\\\ and newline as \\n), then 'fingerprint=HEX' or 'expect=error', then 'end'.",
             f"# Canonical text: '{FINGERPRINT_HEADER}' + one 'field=value' line per field, sorted, each ending in \\n."]
    for name, values, result in _vector_cases():
        assert values is not None
        lines.append(f"case={name}")
        lines += [f"{k}={_escape(values[k])}" for k in FINGERPRINT_FIELDS]
        if "fingerprint" in result:
            lines.append(f"fingerprint={result['fingerprint']}")
        else:
            lines.append("expect=error")
        lines.append("end")
    recipes = dest / "recipes.txt"
    recipes.write_text("\n".join(lines) + "\n", encoding="utf-8")
    # SHA-256 vectors over the padding boundaries: 'LEN HEX-DIGEST' of bytes (i * 7 + 3) & 0xff.
    sha = ["# sha256 vectors: generated by `python -m dgr.gguf.recipe write-vectors`; do not edit.",
           "# 'LEN DIGEST' where the message is LEN bytes, byte i = (i * 7 + 3) mod 256."]
    for n in (0, 1, 3, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129, 1000, 4096, 100003):
        msg = bytes((i * 7 + 3) & 0xFF for i in range(n))
        sha.append(f"{n} {hashlib.sha256(msg).hexdigest()}")
    sha256 = dest / "sha256.txt"
    sha256.write_text("\n".join(sha) + "\n", encoding="utf-8")
    return [recipes, sha256]


def read_vector_cases(path: Path) -> list[dict[str, str]]:
    """Parse recipes.txt into one dict per case (for tests)."""
    cases: list[dict[str, str]] = []
    cur: dict[str, str] | None = None
    for line in path.read_text(encoding="utf-8").split("\n"):
        if not line or line.startswith("#"):
            continue
        if line.startswith("case="):
            cur = {"case": line[5:]}
        elif line == "end":
            assert cur is not None
            cases.append(cur)
            cur = None
        else:
            k, _, v = line.partition("=")
            assert cur is not None
            cur[k] = v.replace("\\n", "\n").replace("\\\\", "\\")
    return cases


def main(argv: list[str]) -> int:
    if len(argv) >= 1 and argv[0] == "write-vectors":
        from .. import paths

        dest = Path(argv[1]) if len(argv) > 1 else paths.repo_root() / VECTORS_DIR
        for p in write_vectors(dest):
            print(p)
        return 0
    print("usage: python -m dgr.gguf.recipe write-vectors [DIR]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
