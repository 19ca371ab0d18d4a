"""`dgr patches …`: apply, export, verify and inspect the llama.cpp patch stack."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .. import paths
from ..upstream import patchstack
from ..upstream import pin as pin_mod
from ..errors import DgrError

app = typer.Typer(no_args_is_help=True)

TreeOpt = typer.Option(None, "--tree", help="Patched working tree (default build/llama.cpp).")


def _tree(tree: Optional[Path]) -> Path:
    return tree or paths.patched_source_dir()


@app.command("apply")
def apply(tree: Optional[Path] = TreeOpt,
          force: bool = typer.Option(False, "--force", help="Recreate the tree, discarding local commits/edits.")) -> None:
    """Make a git tree of the pinned source under build/ and `git am` the series onto it."""
    stack = patchstack.default_stack()
    src = pin_mod.located_source()
    pin_mod.verify_tree(src, pin_mod.load_pin())
    st = patchstack.apply(stack, src, _tree(tree), force=force)
    typer.echo(f"{_tree(tree)}: base {st.base[:12] if st.base else '?'} + {len(st.applied)} patch(es)")


@app.command("export")
def export(tree: Optional[Path] = TreeOpt) -> None:
    """Regenerate upstream/patches/ (numbered files + series) from the tree's commits."""
    names = patchstack.export(patchstack.default_stack(), _tree(tree))
    typer.echo(f"exported {len(names)} patch(es) to {paths.patches_dir()}")
    for n in names:
        typer.echo(f"  {n}")


@app.command("verify")
def verify() -> None:
    """Apply the series at the exact pin in a scratch tree, re-export, byte-compare, check assumptions."""
    stack = patchstack.default_stack()
    src = pin_mod.located_source()
    pin_mod.verify_tree(src, pin_mod.load_pin())
    report = patchstack.verify(stack, src)
    if not report.ok:
        for p in report.problems:
            typer.echo(f"FAIL {p}", err=True)
        raise DgrError(f"patch stack does not verify: {report.problems[0]}"
                       + (f" (+{len(report.problems) - 1} more)" if len(report.problems) > 1 else ""))
    typer.echo(f"patches ok: {len(report.patches)} patch(es) apply at {stack.base_commit[:12]} "
               f"and re-export byte-identically; assumptions hold; series {report.digest}")


@app.command("status")
def status(tree: Optional[Path] = TreeOpt) -> None:
    """Show the base, applied patches and local edits not yet exported."""
    stack = patchstack.default_stack()
    st = patchstack.state(stack, _tree(tree))
    typer.echo(f"tree:    {_tree(tree)}")
    typer.echo(f"base:    {st.base or '(none recorded)'}" + ("" if st.base == stack.base_commit else "  (differs from the pin!)"))
    typer.echo(f"series:  {len(stack.series())} patch(es), {stack.series_digest()}")
    typer.echo(f"applied: {len(st.applied)}")
    for s in st.applied:
        typer.echo(f"  {s}")
    if st.unexported:
        typer.echo("not exported (run `dgr patches export`):")
        for n in st.unexported:
            typer.echo(f"  {n}")
    if st.dirty:
        typer.echo("uncommitted edits:")
        for d in st.dirty:
            typer.echo(f"  {d}")
    if not st.unexported and not st.dirty:
        typer.echo("clean: tree matches the committed series")


@app.command("assumptions")
def assumptions(tree: Optional[Path] = TreeOpt,
                refresh: bool = typer.Option(False, "--refresh", help="Rewrite the file list from what the series touches.")) -> None:
    """Check (or --refresh) upstream/assumptions.toml against the patched tree."""
    stack = patchstack.default_stack()
    if refresh:
        files = patchstack.refresh_assumption_blobs(stack, _tree(tree))
        typer.echo(f"assumptions: {len(files)} touched file(s) recorded")
        return
    problems = patchstack.check_assumptions(stack, _tree(tree))
    for p in problems:
        typer.echo(f"FAIL {p}", err=True)
    if problems:
        raise DgrError(problems[0])
    typer.echo("assumptions hold")
