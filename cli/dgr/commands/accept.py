"""`dgr accept <STORY-ID>`: run an acceptance scenario and write evidence/<ID>/."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..accept import evidence
from ..errors import DgrError

app = typer.Typer()


@app.callback(invoke_without_command=True)
def accept(
    story_id: Optional[str] = typer.Argument(None, metavar="STORY-ID", help="e.g. DGR-004"),
    out: Optional[Path] = typer.Option(None, "--out", help="Evidence root (default evidence/)."),
    list_: bool = typer.Option(False, "--list", help="List registered stories."),
    backend: str = typer.Option("cpu", "--backend", help="Backend build to use."),
    model: Optional[Path] = typer.Option(None, "--model", help="Model GGUF or packaged model name (default: "
                                         "the story's own, usually the embedded SmolLM2)."),
) -> None:
    """Run a registered acceptance story; exit 0 only when every criterion passes."""
    if list_:
        for st in evidence.registered():
            typer.echo(f"{st.story_id}  [{st.lane}]  {st.title}")
        return
    if not story_id:
        raise DgrError("name a story (e.g. `dgr accept DGR-004`) or use --list")
    from ..gguf.models import resolve_model

    ok, out_dir = evidence.run_story(story_id, out, backend=backend,
                                     model=resolve_model(model) if model else None)
    typer.echo(f"{story_id.upper()}: {'PASS' if ok else 'FAIL'} — evidence in {out_dir}")
    if not ok:
        raise typer.Exit(1)
