"""This machine's device evidence: what `dgr certify` records, and what the registry honours.

A passing `dgr certify` writes one JSON document per certification to a store outside the
repository (:func:`local_store_dir`). :func:`dgr.gguf.recipe.load_registry` reads the store
(:func:`read_local_evidence`) and extends each registry entry to the device classes whose
evidence holds: a certification of a known, certified entry and plan, by real (not fake-model)
workers, with a canonical recipe whose fingerprint it states, and figures within the entry's
bounds. Anything else is ignored, with the reason. docs/backends.md, "Certification per device
class".
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from ..errors import DgrError
from .recipe import (LocalCertification, RecipeError, Registry, RegistryEntry, RuntimeRecipe, backend_plan,
                     device_class_backend, load_registry, plan_backends, tolerance_problems)

EVIDENCE_KIND = "dgr-device-certification"
EVIDENCE_SCHEMA = 1
EVIDENCE_MAX_BYTES = 1 << 20


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
