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


def _verdict(out_dir: Path, ok: bool) -> str:
    """The verdict the run wrote (a decision, for a story that ends in one), else PASS/FAIL."""
    import json

    try:
        v = str(json.loads((out_dir / "results.json").read_text()).get("verdict") or "").upper()
    except (OSError, ValueError):
        v = ""
    if v in ("PASS", "FAIL") or not v:
        return "PASS" if ok else "FAIL"
    return f"{v} (the run held)" if ok else "FAIL"


def accept(
    story_id: Optional[str] = typer.Argument(None, metavar="STORY-ID", help="e.g. DGR-004"),
    out: Optional[Path] = typer.Option(None, "--out", help="Evidence root (default evidence/)."),
    list_: bool = typer.Option(False, "--list", help="List registered stories."),
    all_: bool = typer.Option(False, "--all", help="Run every registered story in id order (each writes its folder)."),
    index: bool = typer.Option(False, "--index", help="Only regenerate the evidence/README.md index."),
    stale: bool = typer.Option(False, "--stale", help="List the stories whose evidence is stale (a file they cover "
                               "changed since their run, a dirty-tree run) or missing; exit 1 if there is any."),
    backend: Optional[str] = typer.Option(None, "--backend", help="Backend build to use (default: the story's own; "
                                          "cpu for all but DGR-018, which runs on vulkan)."),
    model: Optional[Path] = typer.Option(None, "--model", help="Model GGUF or packaged model name (default: "
                                         "the story's own, usually the embedded SmolLM2)."),
) -> None:
    """Run a registered acceptance story; exit 0 only when every criterion passes. A story that ends
    in a decision (DGR-014, the release gate) prints the decision as its verdict."""
    from .. import paths

    if list_:
        for st in evidence.registered():
            on = f" (runs on {st.backend})" if st.backend else ""
            typer.echo(f"{st.story_id}  [{st.lane}]{on}  {st.title}")
        return
    root = out or (paths.repo_root() / "evidence")
    if (stale or index) and (all_ or story_id):
        raise DgrError("--stale and --index only report; they take no story and no --all")
    if index:
        typer.echo(f"index written: {evidence.write_index(root)}")
        return
    if stale:
        rows = evidence.freshness(root)
        bad = [f for f in rows if f.state in ("stale", "missing")]
        for f in rows:
            if f.state != "fresh":
                typer.echo(f"{f.story}: {f.state} — {f.reason}")
        head = evidence.git_state()
        at = (head.get("git_commit") or "?")[:12] + (" (the working tree has uncommitted changes, not judged)"
                                                     if head.get("git_dirty") else "")
        fresh = sum(f.state == "fresh" for f in rows)
        typer.echo(f"{fresh} fresh, {len(bad)} stale or missing, {len(rows) - fresh - len(bad)} locked; at {at}")
        if bad:
            raise typer.Exit(1)
        return
    if all_ and story_id:
        raise DgrError("name one story or use --all, not both")

    from ..gguf.models import resolve_model

    model_path = resolve_model(model) if model else None
    if all_:
        results = evidence.run_all(out, backend=backend, model=model_path)
        for sid, ok, d in results:
            typer.echo(f"{sid}: {_verdict(d, ok)} — evidence in {d}")
        if not all(ok for _, ok, _ in results):
            raise typer.Exit(1)
        return
    if not story_id:
        raise DgrError("name a story (e.g. `dgr accept DGR-004`), or use --all or --list")
    ok, out_dir = evidence.run_story(story_id, out, backend=backend, model=model_path)
    typer.echo(f"{story_id.upper()}: {_verdict(out_dir, ok)} — evidence in {out_dir}")
    if not ok:
        raise typer.Exit(1)
