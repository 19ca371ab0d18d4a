"""`dgr certify`: certify this machine's device for a backend plan (docs/backends.md,
"Certification per device class")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import DgrError


def certify(
    model: Optional[Path] = typer.Option(None, "--model", help="GGUF file or any part of a split set "
                                         "(default: the embedded SmolLM2-135M)."),
    backend: str = typer.Option("cpu", "--backend", help="The backend plan to certify: cpu, vulkan or cuda (every "
                                "Shard on this machine's device), or one backend per Shard in route order, e.g. "
                                "cpu,vulkan (a mixed plan, measured against the CPU whole model)."),
    split: Optional[List[str]] = typer.Option(None, "--split", help="A split to check, START:END,… (repeat for "
                                              "several; default: a 2- and a 3-range split of the model)."),
    tokens: int = typer.Option(32, "--tokens", min=1, help="Greedy tokens generated per prompt."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Threads per worker (default: CPU count)."),
    list_only: bool = typer.Option(False, "--list", help="List this machine's device evidence (and files it ignores, "
                                   "with the reason); run nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the evidence document as JSON (also a failed "
                                 "one: verdict fail)."),
    fake: bool = typer.Option(False, "--fake", hidden=True, help="Fake-model workers (tests)."),
    fake_device_class: Optional[List[str]] = typer.Option(
        None, "--fake-device-class", hidden=True, help="With --fake: the device class a backend's fake workers "
        "claim, e.g. vulkan:fakegpu (repeat or comma-separate, one per backend)."),
) -> None:
    """Certify this machine's device: run the whole model and a 2- and a 3-range split on local
    workers, read the device class each worker reports, check exact greedy parity (one backend)
    or the drift against the CPU whole model within the registry's tolerance (a mixed plan), and
    record local evidence that makes the registry entry hold for that device class on this
    machine. A failure records nothing and exits 1."""
    from ..gguf import recipe as recipe_mod

    if list_only:
        _list(as_json)
        return
    from ..route import certify as cert
    from ..route.local import parse_split

    classes: dict[str, str] = {}
    for item in (c.strip() for v in fake_device_class or [] for c in v.split(",")):
        if not item:
            continue
        if not fake:
            raise DgrError("--fake-device-class goes with --fake")
        try:
            classes[recipe_mod.device_class_backend(item)] = item
        except recipe_mod.RecipeError as exc:
            raise DgrError(f"--fake-device-class {exc}") from None
    items = cert.parse_backend_spec(backend)
    for on, cls in classes.items():
        if on not in items:
            raise DgrError(f"--fake-device-class {cls} is a {on} device, and --backend {backend} has no {on} Shard")
    splits = [parse_split(s) for s in split] if split else None
    src = None
    if not fake:
        from ..gguf.models import resolve_model

        src = resolve_model(model)
    elif model is not None:
        raise DgrError("--model does not go with --fake (fake-model workers)")
    res = cert.certify(src, backend, splits=splits, n_tokens=tokens, threads=threads, fake=fake, fake_classes=classes)
    if as_json:
        typer.echo(json.dumps({**res.doc, "evidence_path": str(res.path) if res.path else None}, indent=2))
    else:
        typer.echo(cert.summary(res))
    if not res.ok:
        raise DgrError(f"not certified: {'; '.join(res.problems)}; nothing recorded")
    if not as_json:
        classes_text = ", ".join(res.doc["device_classes"])
        note = " (fake-model workers: the registry ignores this evidence)" if fake else ""
        typer.echo(f"certified: {res.entry} holds for {classes_text} on this machine (plan {res.doc['plan']}, "
                   f"this runtime){note}")
        typer.echo(f"  evidence: {res.path}")


def _list(as_json: bool) -> None:
    from ..gguf import recipe as recipe_mod

    reg = recipe_mod.load_registry(warn=False)
    local = [{"entry": e.name, "plan": c.plan, "device_class": c.device_class, "date": c.date, "path": c.path,
              "pin_commit": c.pin_commit, "patch_digest": c.patch_digest} for e in reg.entries for c in e.local]
    if as_json:
        typer.echo(json.dumps({"store": reg.store, "certified": local, "ignored": list(reg.ignored)}, indent=2))
        return
    typer.echo(f"local device evidence in {reg.store}:")
    if not local:
        typer.echo("  none")
    for c in local:
        typer.echo(f"  {c['entry']} plan {c['plan']} on {c['device_class']} ({c['date'] or 'undated'}, "
                   f"llama.cpp {c['pin_commit'][:12]}): {c['path']}")
    for why in reg.ignored:
        typer.echo(f"  ignored: {why}")
