"""Certify this machine's device for a recipe class: ``dgr certify`` (docs/backends.md,
"Certification per device class").

The registry (cli/dgr/gguf/recipes.toml) certifies a recipe class per backend plan *and* per
device class: the Vulkan entries' evidence was recorded on Mesa's llvmpipe, which says nothing
about a GPU and its driver. An operator certifies their own device by running, on local
workers, the checks the packaged evidence ran:

* a one-backend plan (``cpu``, ``vulkan``, ``cuda``): the whole model and each split (default a
  2- and a 3-range split) on the device, one prompt at a time, greedy: every split's tokens must
  equal the whole model's (**exact greedy parity**);
* a mixed plan (``cpu+vulkan``, …): each split against the **CPU** whole model, free-running
  (greedy agreement and the first divergence) and teacher-forced (top-1 agreement, max
  |Δ logprob| of the reference token), within the ``tolerance`` the registry entry states.

The device class comes from each worker's ``GetCapability.device`` (a CPU worker that reports no
device is "cpu"; an accelerator worker that reports none cannot be certified). Every worker of
one backend must report the same class. A pass writes local evidence (JSON) into
:func:`dgr.gguf.recipe.local_store_dir`, which :func:`dgr.gguf.recipe.load_registry` merges:
on this machine the entry then also holds for that device class, for this runtime (llama.cpp pin
and patch series). A failure writes nothing. No Typer here.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import math
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

from ..errors import DgrError
from ..gguf.recipe import (EVIDENCE_KIND, EVIDENCE_SCHEMA, BACKENDS, RecipeError, Registry, RegistryEntry,
                           RuntimeRecipe, backend_plan, device_class_backend, device_class_of_capability,
                           load_registry, plan_backends, write_local_evidence)

_log = logging.getLogger(__name__)

FAKE_N_LAYER = 6
DEFAULT_TOKENS = 32
DEVICE_FIELDS = ("backend", "name", "description", "vendor", "driver_version", "architecture", "device_class",
                 "memory_total_bytes", "memory_free_bytes", "memory_predicted_bytes")


class CertifyRefused(DgrError):
    """The device cannot be certified (a device problem, or figures outside the criterion)."""


def parse_backend_spec(spec: str) -> list[str]:
    """``vulkan`` or ``cpu,vulkan`` (one backend per Shard in route order; ``+`` is read as ``,``)."""
    items = [b.strip() for b in spec.replace("+", ",").split(",") if b.strip()]
    bad = [b for b in items if b not in BACKENDS]
    if not items or bad:
        raise DgrError(f"--backend {spec!r}: unknown backend {bad[0] if bad else '(none)'}; "
                       f"choose from {', '.join(BACKENDS)}, or one per Shard such as cpu,vulkan")
    return items


def even_split(n_layer: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous ranges of ``n_layer`` layers, as even as they go."""
    cuts = [round(i * n_layer / n) for i in range(n + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:])]


def default_splits(n_layer: int) -> list[list[tuple[int, int]]]:
    """A 2- and a 3-range split (only the 2-range one for a 2-layer model)."""
    if n_layer < 2:
        raise DgrError(f"the model has {n_layer} layer: a split needs at least 2")
    return [even_split(n_layer, n) for n in (2, 3) if n <= n_layer]


def split_backends(items: Sequence[str], n_shards: int) -> list[str]:
    """One backend per Shard: ``items`` as given when it names one per Shard, one backend for
    all, or (a plan with fewer backends than Shards) in order with the last one repeated, so the
    backend plan stays the same (cpu,vulkan on 3 Shards: cpu, vulkan, vulkan)."""
    if len(items) == 1:
        return list(items) * n_shards
    if len(items) > n_shards:
        raise DgrError(f"--backend {','.join(items)} names {len(items)} backends for a {n_shards}-range split: "
                       "give --split with at least as many ranges")
    return list(items) + [items[-1]] * (n_shards - len(items))


def split_text(split: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{a}:{b}" for a, b in split)


# ---- running workers (a Runner; tests inject their own) ----

class Started(Protocol):
    endpoints: list[str]

    def capabilities(self) -> list[Any]: ...


Run = tuple[list[int], list[list[tuple[int, float]]]]   # one prompt's tokens and top-k per position


class Runner(Protocol):
    """Starts workers for a split and runs prompts through them (:class:`LocalRunner`)."""

    def start(self, split: Sequence[tuple[int, int]],
              backends: Sequence[str]) -> "contextlib.AbstractContextManager[Started]": ...
    def tokenize(self, endpoints: Sequence[str], prompts: Sequence[str]) -> list[list[int]]: ...
    def generate(self, endpoints: Sequence[str], token_prompts: Sequence[Sequence[int]], n_tokens: int,
                 forced: Sequence[Sequence[int]] | None = None) -> list[Run]: ...


@dataclass
class _Workers:
    workers: list[Any]

    @property
    def endpoints(self) -> list[str]:
        return [w.target for w in self.workers]

    def capabilities(self) -> list[Any]:
        out = []
        for w in self.workers:
            c = w.client()
            try:
                out.append(c.capability(refresh=True))
            finally:
                c.close()
        return out


class LocalRunner:
    """Local dgr-worker processes on 127.0.0.1: the model (:class:`dgr.route.local.LocalRoute`),
    or with ``fake`` the deterministic fake model, every Shard of backend B claiming the device
    class ``fake_classes[B]`` (``--fake-device-class``; a CPU Shard claims nothing: "cpu")."""

    def __init__(self, model: Path | None, *, threads: int | None = None, fake: bool = False,
                 fake_classes: dict[str, str] | None = None, n_layer: int = FAKE_N_LAYER) -> None:
        self.model, self.threads, self.fake = model, threads, fake
        self.fake_classes = dict(fake_classes or {})
        self.n_layer = n_layer

    @contextlib.contextmanager
    def start(self, split: Sequence[tuple[int, int]], backends: Sequence[str]) -> Iterator[_Workers]:
        if not self.fake:
            from .local import LocalRoute

            with LocalRoute(self.model, list(split), threads=self.threads, backend=list(backends),
                            max_sessions=4) as lr:
                yield _Workers(lr.workers)
            return
        from ..upstream.build import worker_binary
        from .supervisor import WorkerArgs, WorkerProcess, WorkerStartError

        binary = worker_binary("cpu")     # the fake model needs no backend
        started = _Workers([])
        try:
            for (a, b), backend in zip(split, backends):
                cls = self.fake_classes.get(backend, "" if backend == "cpu" else f"{backend}:fake")
                extra = ("--fake-device-class", cls) if cls else ()
                args = WorkerArgs(fake_model=True, n_layer=self.n_layer, layers=(a, b), max_sessions=4, extra=extra)
                try:
                    started.workers.append(WorkerProcess.start(args, binary=binary, ready_timeout=60))
                except WorkerStartError as exc:
                    raise DgrError(f"fake worker for layers {a}:{b} did not start: {exc}") from None
            yield started
        finally:
            for w in started.workers:
                try:
                    w.terminate(10)
                except Exception:  # noqa: BLE001 - stopping is best effort; kill what is left
                    w.kill()

    def tokenize(self, endpoints: Sequence[str], prompts: Sequence[str]) -> list[list[int]]:
        from .drift import _tokenize

        return asyncio.run(_tokenize(endpoints, prompts, True))

    def generate(self, endpoints: Sequence[str], token_prompts: Sequence[Sequence[int]], n_tokens: int,
                 forced: Sequence[Sequence[int]] | None = None) -> list[Run]:
        from .drift import _runs

        return asyncio.run(_runs(endpoints, token_prompts, n_tokens, forced=forced))


# ---- devices ----

def device_record(cap: Any) -> dict[str, Any]:
    """What a worker says about its device (GetCapability.device), plus the class it is
    certified as (``device_class``; "cpu" for a CPU worker that reports none) and whether it
    reported one (``reported``)."""
    dev = getattr(cap, "device", None)
    out: dict[str, Any] = {k: getattr(dev, k, "") if dev is not None else "" for k in DEVICE_FIELDS}
    for k in ("memory_total_bytes", "memory_free_bytes", "memory_predicted_bytes"):
        out[k] = int(out[k] or 0)
    for k in DEVICE_FIELDS:
        if not k.startswith("memory_"):
            out[k] = str(out[k] or "")
    out["reported"] = bool(out["device_class"])
    out["device_class"] = device_class_of_capability(cap)
    out["runtime_backend"] = str(cap.runtime.backend)
    return out


def check_devices(caps: Sequence[Any], backends: Sequence[str], *, fake: bool, where: str) -> list[dict[str, Any]]:
    """One device record per worker; :class:`CertifyRefused` when a worker's device cannot be
    certified: no device class (an accelerator worker built before device reporting), one that
    is not a device class, or one of another backend than the Shard's."""
    out = []
    for cap, backend in zip(caps, backends):
        rec = device_record(cap)
        rng = f"{where} [{cap.identity.range.start}:{cap.identity.range.end})" if hasattr(cap, "identity") else where
        cls = rec["device_class"]
        if not cls:
            raise CertifyRefused(f"the {backend} worker of {rng} reports no device class (GetCapability.device is "
                                 f"empty: a dgr-worker built before device reporting)",
                                 hint=f"rebuild it: dgr build --backend {backend}")
        try:
            on = device_class_backend(cls)
        except RecipeError as exc:
            raise CertifyRefused(f"the {backend} worker of {rng} reports {exc}") from None
        if on != backend:
            raise CertifyRefused(f"the {backend} worker of {rng} computes on {cls}, a {on} device: it is not "
                                 f"a {backend} device to certify")
        if not fake and rec["runtime_backend"] != backend:
            raise CertifyRefused(f"the worker of {rng} was built for {rec['runtime_backend']}, not {backend}")
        out.append(rec)
    return out


def device_classes_by_backend(records: Sequence[dict[str, Any]], backends: Sequence[str]) -> dict[str, str]:
    """backend -> the one device class its workers report; :class:`CertifyRefused` when the
    workers of one backend report several (several devices: certify one at a time)."""
    seen: dict[str, set[str]] = {}
    for rec, b in zip(records, backends):
        seen.setdefault(b, set()).add(rec["device_class"])
    many = {b: sorted(c) for b, c in seen.items() if len(c) > 1}
    if many:
        b, classes = next(iter(many.items()))
        raise CertifyRefused(f"the {b} workers report different device classes ({', '.join(classes)}): certify one "
                             "device at a time (GGML_VK_VISIBLE_DEVICES, CUDA_VISIBLE_DEVICES)")
    return {b: next(iter(c)) for b, c in seen.items()}


# ---- figures ----

def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else "inf"


def parity_figures(ref: Sequence[Run], got: Sequence[Run]) -> dict[str, Any]:
    """Exact greedy parity of a split's runs with the whole model's, prompt by prompt: identical
    when every prompt's tokens are equal; the agreeing tokens, the first divergence per prompt,
    and the largest |Δ logprob| over tokens in both top-k lists before it (0 when bit-exact)."""
    compared = agree = 0
    first: list[int | None] = []
    worst = 0.0
    for (rt, rtop), (gt, gtop) in zip(ref, got):
        n = min(len(rt), len(gt))
        compared += max(len(rt), len(gt))
        agree += sum(1 for a, b in zip(rt[:n], gt[:n]) if a == b)
        k = next((i for i in range(n) if rt[i] != gt[i]), None)
        if k is None and len(rt) != len(gt):
            k = n
        first.append(k)
        for ra, ga in list(zip(rtop, gtop))[: n if k is None else k]:
            rd, gd = dict(ra), dict(ga)
            for t in set(rd) & set(gd):
                worst = max(worst, abs(rd[t] - gd[t]))
    return {"identical": len(ref) == len(got) and all(k is None for k in first), "prompts": len(ref),
            "tokens": compared, "agreeing_tokens": agree, "first_divergence": first,
            "max_abs_dlogprob_topk": _finite(worst)}


def drift_figures(prompts: Sequence[str], token_prompts: Sequence[Sequence[int]],
                  ref: Sequence[Run], greedy: Sequence[Run], forced: Sequence[Run],
                  tolerance: dict[str, float], *, split: str, backends: Sequence[str], n_tokens: int,
                  ) -> tuple[dict[str, Any], list[str]]:
    """A mixed split's drift against the CPU whole model (dgr.route.drift: teacher-forced top-1
    agreement and max |Δ logprob|, free-running greedy agreement and first divergence) and the
    bounds of ``tolerance`` it breaks."""
    from .drift import DriftReport, compare_prompt

    rep = DriftReport("", split.split(","), list(backends), backend_plan(list(backends)), "cpu", n_tokens)
    for p, t, r, g, f in zip(prompts, token_prompts, ref, greedy, forced):
        rep.prompts.append(compare_prompt(p, len(t), r, g[0], f))
    figures = {k: _finite(float(v)) if isinstance(v, float) else v for k, v in rep.metrics().items()}
    figures["first_divergence"] = [p.first_divergence for p in rep.prompts]
    figures["prompts"] = len(rep.prompts)
    return figures, rep.violations(tolerance)


# ---- the certification ----

@dataclass
class CertifyResult:
    ok: bool
    doc: dict[str, Any]
    problems: list[str] = field(default_factory=list)
    path: Path | None = None

    @property
    def entry(self) -> str:
        return str(self.doc.get("entry", ""))


def _git_commit() -> str:
    from .. import paths

    try:
        p = subprocess.run(["git", "-C", str(paths.repo_root()), "rev-parse", "HEAD"], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.SubprocessError, DgrError):
        return ""
    return p.stdout.strip() if p.returncode == 0 else ""


def _fake_recipe(cap: Any, backend: str, plan: str) -> RuntimeRecipe:
    """The recipe a fake-model route stands for: the llama class at this runtime's adapter
    version, the fake worker's artifact and runtime (never routable: fake evidence is ignored)."""
    from ..gguf.slice import ADAPTERS

    return RuntimeRecipe(artifact_id=cap.identity.artifact_id, tokenizer_digest="fake", arch_adapter="llama",
                         arch_adapter_version=ADAPTERS["llama"].version, backend=backend, backends=plan,
                         dgr_version=cap.runtime.dgr_version, pin_commit=cap.runtime.llama_commit,
                         patch_digest=cap.runtime.patch_digest)


def _entry_for(registry: Registry, recipe: RuntimeRecipe) -> RegistryEntry:
    entry = registry.lookup(recipe)
    plan = recipe.plan
    if entry is None:
        raise DgrError(f"recipe class ({recipe.arch_adapter} v{recipe.arch_adapter_version}, wire "
                       f"{recipe.activation_dtype}, KV {recipe.kv_dtype}) is not in the registry: nothing to certify")
    if entry.status != "certified":
        raise DgrError(f"recipe {entry.name} is dark: a device certification extends a certified entry to this "
                       "machine's device, it does not certify a recipe class")
    if plan not in entry.backends:
        raise DgrError(f"no certified registry entry of recipe class {entry.name} holds the backend plan {plan}",
                       hint="a device certification extends a certified entry to this machine's device; a new backend "
                            "plan needs its own entry and evidence (docs/backends.md)")
    return entry


def certify(model: Path | None, backend_spec: str, *, splits: Sequence[Sequence[tuple[int, int]]] | None = None,
            n_tokens: int = DEFAULT_TOKENS, prompts: Sequence[str] | None = None, threads: int | None = None,
            fake: bool = False, fake_classes: dict[str, str] | None = None, registry: Registry | None = None,
            runner: Runner | None = None, store: Path | None = None, write: bool = True,
            n_layer: int | None = None) -> CertifyResult:
    """Certify the local device(s) for ``backend_spec``'s plan (module docstring). Returns the
    result, with the evidence document written (``write``) only when it passed. Raises
    :class:`DgrError` before running anything when there is nothing to certify (no certified
    entry for the plan; too few tokens for the tolerance), or when a worker does not start."""
    from .sessions import DEFAULT_PROMPTS

    items = parse_backend_spec(backend_spec)
    plan = backend_plan(items)
    mixed = len(plan_backends(plan)) > 1
    prompts = list(prompts or DEFAULT_PROMPTS)
    if n_tokens < 1:
        raise DgrError("--tokens must be at least 1")
    registry = registry or load_registry(local=False)
    if fake:
        n_layer = n_layer or FAKE_N_LAYER
        template = RuntimeRecipe(artifact_id="fake", tokenizer_digest="fake", arch_adapter="llama",
                                 arch_adapter_version=1, backend=items[0], backends=plan)
        recipe: RuntimeRecipe | None = None
    else:
        if model is None:
            raise DgrError("certify needs a model (or --fake)")
        from ..gguf.recipe import recipe_for
        from .local import model_n_layer

        n_layer = model_n_layer(model)
        recipe = template = recipe_for(model, backend=items[0], backends=plan, progress=False)
    entry = _entry_for(registry, template)
    tolerance = dict(entry.tolerance)
    if mixed and tolerance.get("tokens", 0) > n_tokens * len(prompts):
        raise DgrError(f"the tolerance of {entry.name} needs {tolerance['tokens']:g} compared tokens per split; "
                       f"{len(prompts)} prompts x {n_tokens} tokens give {n_tokens * len(prompts)}: raise --tokens")
    splits = [list(s) for s in (splits or default_splits(n_layer))]
    for s in splits:
        if not s or s[0][0] != 0 or s[-1][1] != n_layer or len(s) < 2:
            raise DgrError(f"split {split_text(s)} is not a split of the model's {n_layer} layers into 2 or more "
                           "ranges")
    split_items = [split_backends(items, len(s)) for s in splits]
    runner = runner or LocalRunner(model, threads=threads, fake=fake, fake_classes=fake_classes, n_layer=n_layer)

    ref_backend = "cpu" if mixed else items[0]
    records: list[dict[str, Any]] = []
    backends_of_records: list[str] = []
    runs: list[dict[str, Any]] = []
    problems: list[str] = []
    _log.info(f"reference: whole model [0:{n_layer}) on {ref_backend}, {len(prompts)} prompt(s) x {n_tokens} tokens")
    with runner.start([(0, n_layer)], [ref_backend]) as ws:
        caps = ws.capabilities()
        recs = check_devices(caps, [ref_backend], fake=fake, where="the whole model")
        if recipe is None:
            recipe = _fake_recipe(caps[0], items[0], plan)
        toks = runner.tokenize(ws.endpoints, prompts)
        ref = runner.generate(ws.endpoints, toks, n_tokens)
    reference = {"backend": ref_backend, "device_class": recs[0]["device_class"], "layers": f"0:{n_layer}"}
    if not mixed:   # the reference runs on the device being certified
        records += recs
        backends_of_records.append(ref_backend)
    for split, bs in zip(splits, split_items):
        text = split_text(split)
        _log.info(f"split {text} on {','.join(bs)}" + (": greedy, then teacher-forced" if mixed else ": greedy"))
        with runner.start(split, bs) as ws:
            recs = check_devices(ws.capabilities(), bs, fake=fake, where=f"split {text}")
            records += recs
            backends_of_records += bs
            greedy = runner.generate(ws.endpoints, toks, n_tokens)
            forced = runner.generate(ws.endpoints, toks, n_tokens, forced=[r[0] for r in ref]) if mixed else None
        run: dict[str, Any] = {"split": text, "backends": list(bs), "device_classes": [r["device_class"] for r in recs]}
        if mixed:
            assert forced is not None
            figures, bad = drift_figures(prompts, toks, ref, greedy, forced, tolerance, split=text, backends=bs,
                                         n_tokens=n_tokens)
            run["drift"] = figures
            run["violations"] = bad
            problems += [f"split {text}: {b}" for b in bad]
        else:
            figures = parity_figures(ref, greedy)
            run["parity"] = figures
            if not figures["identical"]:
                where = "; ".join(f"prompt {i} at token {k}" for i, k in enumerate(figures["first_divergence"])
                                  if k is not None)
                problems.append(f"split {text} is not exact against the whole model on {ref_backend} "
                                f"({figures['agreeing_tokens']}/{figures['tokens']} tokens agree; diverges: {where})")
        runs.append(run)
    by_backend = device_classes_by_backend(records, backends_of_records)
    classes = [by_backend[b] for b in plan_backends(plan) if b in by_backend]
    classes = list(dict.fromkeys(classes))
    devices: list[dict[str, Any]] = []
    for rec in records:
        if rec["device_class"] not in [d["device_class"] for d in devices]:
            devices.append({k: v for k, v in rec.items()})
    from .. import __version__

    doc: dict[str, Any] = {
        "kind": EVIDENCE_KIND, "schema": EVIDENCE_SCHEMA, "verdict": "pass" if not problems else "fail",
        "entry": entry.name, "plan": plan, "backends": items, "device_classes": classes, "devices": devices,
        "criterion": (f"drift against the CPU whole model within the tolerance {tolerance}" if mixed
                      else f"exact greedy parity against the whole model on the {plan} device"),
        **({"tolerance": tolerance} if mixed else {}),
        "reference": reference, "runs": runs, "prompts": len(prompts), "tokens_per_prompt": n_tokens,
        "model": "fake" if fake else Path(model).name if model else "",
        "artifact_id": recipe.artifact_id, "fingerprint": recipe.fingerprint(), "recipe": recipe.to_json(),
        "fake": bool(fake), "dgr_version": __version__, "dgr_commit": _git_commit(),
        "pin_commit": recipe.pin_commit, "patch_digest": recipe.patch_digest,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if problems:
        doc["problems"] = problems
        return CertifyResult(False, doc, problems)
    path = write_local_evidence(doc, store, allow_fake=fake, registry=registry) if write else None
    return CertifyResult(True, doc, [], path)


def summary(res: CertifyResult) -> str:
    """The figures, one line per run."""
    d = res.doc
    classes = ", ".join(d.get("device_classes", [])) or "unknown"
    ref = d.get("reference", {})
    lines = [f"certify plan {d.get('plan')} of {d.get('entry')} on {classes}"
             + (" (fake-model workers)" if d.get("fake") else "") + f": model {d.get('model')}, "
             f"{d.get('prompts')} prompt(s) x {d.get('tokens_per_prompt')} tokens"]
    for dev in d.get("devices", []):
        what = ", ".join(x for x in (dev.get("description") or dev.get("name"), dev.get("vendor"),
                                      dev.get("driver_version") and f"driver {dev['driver_version']}") if x)
        lines.append(f"  device {dev['device_class']}: {what or 'no details reported'}")
    lines.append(f"  reference: whole model {ref.get('layers')} on {ref.get('backend')} ({ref.get('device_class')})")
    for run in d.get("runs", []):
        head = f"  split {run['split']} ({','.join(run['backends'])}): "
        if "parity" in run:
            p = run["parity"]
            lines.append(head + (f"identical, {p['tokens']} tokens" if p["identical"] else
                                 f"NOT identical: {p['agreeing_tokens']}/{p['tokens']} tokens agree, first "
                                 f"divergence per prompt {p['first_divergence']}"))
        else:
            f = run["drift"]
            lines.append(head + f"top-1 agreement (teacher-forced) {f['top1_agreement']:.4f}, greedy agreement "
                         f"(free run) {f['greedy_agreement']:.4f}, first divergence per prompt "
                         + ", ".join("none" if k is None else str(k) for k in f["first_divergence"])
                         + f", max |d logprob| {f['max_abs_dlogprob']} nats over {f['tokens']} tokens"
                         + ("" if not run.get("violations") else "; OUTSIDE: " + "; ".join(run["violations"])))
    return "\n".join(lines)
