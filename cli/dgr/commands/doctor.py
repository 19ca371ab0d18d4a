"""`dgr doctor`: each compute backend, what is present, what is missing, how to install it."""

from __future__ import annotations

import json
from typing import List, Optional

import typer


def doctor(
    backend: Optional[List[str]] = typer.Option(None, "--backend", help="Only this backend (repeat); default all: "
                                                "cpu, vulkan, cuda, hip, metal."),
    as_json: bool = typer.Option(False, "--json", help="Print the reports as JSON."),
) -> None:
    """List each backend with what this machine has, what is missing and the exact command that
    installs it. Only looks; `dgr build --backend B` obtains and builds."""
    from ..upstream import doctor as doc

    reports = [doc.check(b) for b in (backend or doc.BACKENDS)]
    if as_json:
        typer.echo(json.dumps([r.to_json() for r in reports], indent=2))
        return
    for r in reports:
        state = "ready" if r.ready else "missing pieces"
        built = f"; built: {r.built}" if r.built else ""
        typer.echo(f"{r.backend}: {state}{built}")
        for i in r.items:
            typer.echo(f"  [{'x' if i.present else ' '}] {i.name}: {i.detail}")
        for n in r.notes:
            typer.echo(f"  note: {n}")
        for c in r.install:
            typer.echo(f"  install: {c}")
