"""The `dgr` command line: a thin Typer root composing one sub-app per command group.

Commands parse arguments, call a logic module (which never imports Typer) and print.
Expected failures are :class:`dgr.errors.DgrError`, printed as one line with exit code 1.
"""

from __future__ import annotations

import sys

import typer

from . import __version__
from .errors import DgrError

app = typer.Typer(
    name="dgr",
    help="dgr - run one GGUF model split by layer ranges (Shards) across several machines.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version_text() -> str:
    from .upstream import pin as pin_mod
    from .upstream import patchstack

    lines = [f"dgr {__version__}"]
    try:
        p = pin_mod.load_pin()
        lines.append(f"llama.cpp {p.commit} ({p.date})")
    except DgrError as exc:
        lines.append(f"llama.cpp pin: unavailable ({exc.one_line()})")
    try:
        lines.append(f"patch series {patchstack.default_stack().series_digest()}")
    except DgrError as exc:
        lines.append(f"patch series: unavailable ({exc.one_line()})")
    return "\n".join(lines)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(_version_text())
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True,
        help="Print the dgr version, the pinned llama.cpp commit and the patch-series digest.",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also show debug log lines (on stderr)."),
    quiet: bool = typer.Option(False, "--quiet", "-q",
                               help="Show only warnings and errors on stderr; results on stdout are unchanged."),
) -> None:
    """dgr - distributed GGUF runtime toolkit."""
    from .console import setup_logging, verbosity_level

    setup_logging(verbosity_level(verbose, quiet))


def _register() -> None:
    # One sub-app per command group (cli/dgr/commands/<group>.py exposes `app`).
    from .commands import pin, patches, build, accept
    from .commands import proto as proto_cmd

    app.add_typer(pin.app, name="pin", help="The exact llama.cpp pin: show, fetch, verify.")
    app.add_typer(patches.app, name="patches", help="The llama.cpp patch stack: apply, export, verify, status.")
    app.add_typer(build.app, name="build", help="Build the patched llama.cpp and the dgr-worker.")
    from .commands import gguf
    app.add_typer(gguf.app, name="gguf", help="Inspect, fingerprint, slice and verify GGUF files; synthetic models.")
    from .commands import worker
    app.add_typer(worker.app, name="worker", help="Serve one Shard with the native dgr-worker (gRPC).")
    # a plain command, so options may follow the story id (`dgr accept DGR-014 --backend cpu`)
    app.command("accept", help="Run an acceptance story (or --all) and write its evidence folder.")(accept.accept)
    app.add_typer(proto_cmd.app, name="proto", help="Shard protocol: generate/check Python code, golden vectors.")
    from .commands import bench
    app.add_typer(bench.app, name="bench", help="Measure against baselines (JSON out); check results against the contract.")
    from .commands import route as route_cmd, demo as demo_cmd
    app.add_typer(route_cmd.app, name="route", help="Run an Inference Route: local workers for a split, or running workers.")
    app.command("demo")(demo_cmd.demo)
    from .commands import upstream as upstream_cmd
    app.add_typer(upstream_cmd.app, name="upstream",
                  help="The collaboration package for llama.cpp: render the proposal, check the examples.")
    from .commands import lab as lab_cmd
    app.add_typer(lab_cmd.app, name="lab", help="Simulated hosts on one machine: namespaces, own CPUs and memory, shaped links, mTLS.")
    from .commands import serve as serve_cmd
    app.command("serve")(serve_cmd.serve)
    from .commands import doctor as doctor_cmd
    app.command("doctor", help="Each compute backend: what is present, what is missing, the install command.")(doctor_cmd.doctor)
    from .commands import drill as drill_cmd
    app.command("drill", help="Inject one fault into a route under load; measure detection, failover and what survivors hold.")(drill_cmd.drill)
    from .commands import pki as pki_cmd
    app.add_typer(pki_cmd.app, name="pki", help="Certificates for mutual TLS between a route's machines: issue, show.")
    from .commands import plan as plan_cmd
    app.command("plan", help="Choose a route's split over unequal hosts from their measured capabilities (a prediction).")(plan_cmd.plan)
    from .commands import certify as certify_cmd
    app.command("certify", help="Certify this machine's device for a backend plan: parity or drift on local workers, local evidence.")(certify_cmd.certify)
    from .commands import relay as relay_cmd
    app.add_typer(relay_cmd.app, name="relay", help="The two ends of a hop through a byte relay: the bridge by a worker, "
                  "the egress by the worker that dials it.")
    # Further command groups register here.


_register()


def _click_errors() -> tuple[type, type, type]:
    """(ClickException, UsageError, Abort) of the click that Typer runs on (newer Typer vendors it)."""
    import typer.core

    ck = getattr(typer.core, "_click", None)
    if ck is None:  # pragma: no cover - older Typer runs on click itself
        import click as ck
    return ck.exceptions.ClickException, ck.exceptions.UsageError, typer.core.Abort


def main() -> None:
    click_error, usage_error, abort = _click_errors()
    try:
        rv = app(standalone_mode=False, prog_name="dgr")
    except DgrError as exc:
        typer.echo(f"dgr: error: {exc.one_line()}", err=True)
        sys.exit(exc.exit_code)
    except click_error as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare group: its help, as Typer shows it
            exc.show()
            sys.exit(exc.exit_code)
        # a bad option value or usage: one line (the value's range, the command's --help), exit 2
        where = f" (see '{exc.ctx.command_path} --help')" if isinstance(exc, usage_error) and exc.ctx else ""
        message = " ".join(exc.format_message().split())
        typer.echo(f"dgr: error: {message}{where}", err=True)
        sys.exit(exc.exit_code)
    except abort:
        typer.echo("dgr: aborted", err=True)
        sys.exit(1)
    if isinstance(rv, int):  # typer.Exit(code) and --help end here in non-standalone mode
        sys.exit(rv)


if __name__ == "__main__":
    main()
