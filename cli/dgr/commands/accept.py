"""`dgr accept <STORY-ID> [options]` / `dgr accept --all`: run acceptance stories and write
evidence/<ID>/ plus the evidence/README.md index.

Registered as a plain command (not a sub-app) so options may follow the story id:
``dgr accept DGR-014 --backend cpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..accept import evidence
from ..errors import DgrError


def accept(
    story_id: Optional[str] = typer.Argument(None, metavar="STORY-ID", help="e.g. DGR-004"),
    out: Optional[Path] = typer.Option(None, "--out", help="Evidence root (default evidence/)."),
    list_: bool = typer.Option(False, "--list", help="List registered stories."),
    all_: bool = typer.Option(False, "--all", help="Run every registered story in id order (each writes its folder)."),
    index: bool = typer.Option(False, "--index", help="Only regenerate the evidence/README.md index."),
    backend: str = typer.Option("cpu", "--backend", help="Backend build to use."),
    model: Optional[Path] = typer.Option(None, "--model", help="Model GGUF or packaged model name (default: "
                                         "the story's own, usually the embedded SmolLM2)."),
) -> None:
    """Run a registered acceptance story; exit 0 only when every criterion passes."""
    from .. import paths

    if list_:
        for st in evidence.registered():
            typer.echo(f"{st.story_id}  [{st.lane}]  {st.title}")
        return
    root = out or (paths.repo_root() / "evidence")
    if index:
        typer.echo(f"index written: {evidence.write_index(root)}")
        return
    if all_ and story_id:
        raise DgrError("name one story or use --all, not both")
    from ..gguf.models import resolve_model

    model_path = resolve_model(model) if model else None
    if all_:
        results = evidence.run_all(out, backend=backend, model=model_path)
        for sid, ok, d in results:
            typer.echo(f"{sid}: {'PASS' if ok else 'FAIL'} — evidence in {d}")
        if not all(ok for _, ok, _ in results):
            raise typer.Exit(1)
        return
    if not story_id:
        raise DgrError("name a story (e.g. `dgr accept DGR-004`), or use --all or --list")
    ok, out_dir = evidence.run_story(story_id, out, backend=backend, model=model_path)
    typer.echo(f"{story_id.upper()}: {'PASS' if ok else 'FAIL'} — evidence in {out_dir}")
    if not ok:
        raise typer.Exit(1)
