"""`dgr pki`: certificates for mutual TLS between a route's machines (issue, show)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import typer

from ..errors import DgrError

app = typer.Typer(no_args_is_help=True)


def parse_hosts(host: List[str]) -> dict[str, list[str]]:
    """``NAME=IP[,IP…]`` per machine -> {name: [ips]}; DgrError on a malformed or repeated one."""
    from .named import named_values

    return {n: [x.strip() for x in ips.split(",") if x.strip()]
            for n, ips in named_values(host, "--host", "NAME=IP[,IP…]")}


def issue_certificates(host: List[str], out: Path, days: int) -> None:
    from ..pki import make_pki

    if out.exists() and any(out.iterdir()) if out.is_dir() else out.exists():
        raise DgrError(f"{out} exists and is not empty", hint="give a new directory: issuing never overwrites keys")
    pki = make_pki(out, parse_hosts(host), days=days)
    typer.echo(f"CA {pki.ca}; hosts: " + ", ".join(f"{n} ({h.cert.name}, SAN {','.join(h.ips)})"
                                                 for n, h in pki.hosts.items())
               + f"; driver {pki.client_cert.name}. Keep {pki.ca_key.name} private, or delete it once issued.")


@app.command("issue")
def issue(
    host: List[str] = typer.Option(..., "--host", help="NAME=IP[,IP…] per machine (repeat): its certificate's "
                                   "SAN; NAME names its files."),
    out: Path = typer.Option(Path("dgr-pki"), "--out", help="New directory for ca.pem, NAME.pem/.key, client.pem/.key."),
    days: int = typer.Option(7, "--days", min=1, max=3650, help="Validity in days."),
) -> None:
    """A CA, a certificate per machine (server and, for the chained hop, client identity; SAN = its
    IPs) and a driver/gateway client certificate: the mTLS of docs/multi-host.md. Labs issue
    theirs with the same code."""
    issue_certificates(host, out, days)


@app.command("show")
def show(
    cert: Path = typer.Argument(..., help="A PEM certificate (e.g. dgr-pki/a.pem)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Subject, issuer, SAN IPs, key usages and expiry of a certificate."""
    from ..pki import describe

    try:
        d = describe(cert)
    except OSError as exc:
        raise DgrError(f"cannot read {cert}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise DgrError(f"{cert} is not a PEM certificate: {exc}") from None
    if as_json:
        typer.echo(json.dumps(d, indent=2))
        return
    typer.echo(f"{cert}: {d['subject']}, issued by {d['issuer']}; SAN {', '.join(d['san_ips']) or 'none'}; "
               f"{', '.join(d['extended_key_usage']) or 'no extended key usage'}; valid until {d['not_after']}")
