"""`dgr proto …`: generate and check the Python code of the shard protocol, and its golden vectors."""

from __future__ import annotations

import typer

from ..protocol import protogen
from ..errors import DgrError

app = typer.Typer(no_args_is_help=True)


@app.command("generate")
def generate() -> None:
    """Regenerate cli/dgr/shard/** from proto/**/*.proto with the pinned grpcio-tools."""
    for path in protogen.generate():
        typer.echo(f"wrote {path}")


@app.command("check")
def check() -> None:
    """Exit non-zero, naming each file, when committed generated code drifts from the .proto files."""
    drift = protogen.check()
    if drift:
        for d in drift:
            typer.echo(f"drift: {d}", err=True)
        raise DgrError(f"{len(drift)} generated file(s) drifted from proto/",
                       hint="run `dgr proto generate` and commit the result")
    typer.echo("generated protocol code is up to date")


@app.command("vectors")
def vectors(
    write: bool = typer.Option(False, "--write", help="(Re)write tests/vectors/proto/ from the generator."),
) -> None:
    """Check (default) or write the golden binary frames under tests/vectors/proto/."""
    from ..protocol import vectors as protovectors  # numpy + generated code: imported only when used

    if write:
        for path in protovectors.write():
            typer.echo(f"wrote {path}")
        return
    problems = protovectors.check()
    if problems:
        for p in problems:
            typer.echo(f"vector drift: {p}", err=True)
        raise DgrError(f"{len(problems)} golden vector file(s) differ from the generator",
                       hint="run `dgr proto vectors --write` if the change is intended")
    typer.echo("golden protocol vectors are up to date")
