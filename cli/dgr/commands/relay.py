"""`dgr relay bridge|egress`: the two ends of a hop carried by a byte relay (docs/routes.md,
"Relayed hops")."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import DgrError

app = typer.Typer(no_args_is_help=True, add_completion=False)

_TLS_HELP = "PEM {what} (mutual TLS on every side of this end: give --tls-ca, --tls-cert and --tls-key together)."


def _hostport(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise DgrError(f"{what} {value!r}: expected HOST:PORT (port 0..65535)")
    return host.strip("[]"), int(port)


def _tls(ca: Optional[Path], cert: Optional[Path], key: Optional[Path], listen: str, insecure: bool):
    from ..netaddr import is_loopback_host
    from ..protocol.tls import TlsFiles

    given = [x is not None for x in (ca, cert, key)]
    if any(given) and not all(given):
        raise DgrError("--tls-ca, --tls-cert and --tls-key go together (mutual TLS)")
    host, _ = _hostport(listen, "--listen")
    if not all(given) and not insecure and not is_loopback_host(host):
        raise DgrError(f"refusing to listen on {host} without TLS: anyone who reaches it would reach the worker",
                       hint="give --tls-ca/--tls-cert/--tls-key, listen on loopback, or pass --insecure on a "
                            "network you trust")
    return TlsFiles(ca, cert, key) if all(given) else None


def _run(end) -> None:
    import asyncio

    from ..protocol.relay_host import run_until_signalled

    async def main() -> None:
        try:
            await end.start()
        except (OSError, RuntimeError) as exc:
            raise DgrError(f"cannot listen on {end.host}:{end.port}: {exc}") from None
        typer.echo(f"dgr relay: ready {end.address}", err=True)
        await run_until_signalled(end)

    asyncio.run(main())


@app.command("bridge")
def bridge(
    worker: str = typer.Option(..., "--worker", help="HOST:PORT of the worker this node runs."),
    listen: str = typer.Option("127.0.0.1:0", "--listen", help="HOST:PORT for relay connections (port 0: any free "
                               "port; the chosen one is printed)."),
    tls_ca: Optional[Path] = typer.Option(None, "--tls-ca", help=_TLS_HELP.format(what="CA of the peers' certificates")),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help=_TLS_HELP.format(what="certificate of this node")),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key", help=_TLS_HELP.format(what="private key of --tls-cert")),
    insecure: bool = typer.Option(False, "--insecure", help="Listen on a non-loopback address without TLS."),
) -> None:
    """The worker's end: runs each relay connection as one gRPC call on --worker, the frames as
    opaque bytes. Drivers reach the worker as relay+tcp://HOST:PORT (this listen address as the
    relay exposes it). Runs until SIGTERM or Ctrl-C."""
    from ..protocol.relay_host import relay_end

    _hostport(worker, "--worker")
    tls = _tls(tls_ca, tls_cert, tls_key, listen, insecure)
    _run(relay_end(worker=worker, listen=listen, tls=tls))


@app.command("egress")
def egress(
    relay: str = typer.Option(..., "--relay", help="relay+tcp://HOST:PORT: the next Shard's bridge, as the relay "
                              "exposes it to this node."),
    listen: str = typer.Option("127.0.0.1:0", "--listen", help="HOST:PORT the worker of this node dials as its "
                               "downstream (port 0: any free port; the chosen one is printed)."),
    tls_ca: Optional[Path] = typer.Option(None, "--tls-ca", help=_TLS_HELP.format(what="CA of the peers' certificates")),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help=_TLS_HELP.format(what="certificate of this node")),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key", help=_TLS_HELP.format(what="private key of --tls-cert")),
    insecure: bool = typer.Option(False, "--insecure", help="Listen on a non-loopback address without TLS."),
) -> None:
    """The dialling end of a chained hop: a local gRPC endpoint that this node's worker dials
    for the next Shard, carrying every call through --relay. Give the driver this address as the
    next Shard's hop (`dgr route generate --hop`), and the route stays chained. Runs until
    SIGTERM or Ctrl-C."""
    from ..protocol.relay import RELAY_SCHEME
    from ..protocol.relay_host import relay_end

    if not relay.startswith(RELAY_SCHEME):
        raise DgrError(f"--relay {relay!r}: expected {RELAY_SCHEME}HOST:PORT")
    _hostport(relay.removeprefix(RELAY_SCHEME), "--relay")
    tls = _tls(tls_ca, tls_cert, tls_key, listen, insecure)
    _run(relay_end(egress=relay, listen=listen, tls=tls))
