"""`dgr pin …`: show, fetch and verify the exact llama.cpp pin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..upstream import pin as pin_mod

app = typer.Typer(no_args_is_help=True)

CacheOpt = typer.Option(None, "--cache", help="Pin cache folder (default build/pin, or DGR_PIN_CACHE).")


@app.command("show")
def show(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Print the pinned upstream commit and how its source is obtained."""
    p = pin_mod.load_pin()
    data = {
        "name": p.name, "repository": p.repository, "commit": p.commit, "date": p.date,
        "subject": p.subject,
        "sdist": {"package": p.sdist.package, "version": p.sdist.version,
                  "sha256": p.sdist.sha256, "path": p.sdist.path},
    }
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    typer.echo(f"{p.name} {p.commit} ({p.date})  {p.subject}")
    typer.echo(f"  repository: {p.repository}")
    typer.echo(f"  source:     pip sdist {p.sdist.package}=={p.sdist.version}, path {p.sdist.path}")
    typer.echo(f"  sha256:     {p.sdist.sha256}")


@app.command("fetch")
def fetch(
    cache: Optional[Path] = CacheOpt,
    archive: Optional[Path] = typer.Option(None, "--archive", help="Use an already downloaded sdist file."),
    from_git: Optional[str] = typer.Option(None, "--from-git", metavar="URL",
                                           help="Fetch the exact commit from a git remote instead."),
    force: bool = typer.Option(False, "--force", help="Re-extract / re-fetch even when cached."),
) -> None:
    """Download the pinned source (pip sdist by default), check its sha256 and git commit."""
    src = pin_mod.fetch(cache, archive=archive, from_git=from_git, force=force)
    typer.echo(f"pinned source verified at {src}")


@app.command("verify")
def verify(cache: Optional[Path] = CacheOpt) -> None:
    """Re-check the fetched pin: archive hash, exact commit, clean tree, notices."""
    report = pin_mod.verify(cache)
    typer.echo(f"pin ok: {report['head']} clean at {report['source_dir']}")
