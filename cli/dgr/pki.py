"""A certificate authority for mutual TLS between a route's hosts: `dgr pki issue` on physical
machines, and every `dgr lab` (which calls the same code).

One CA, one certificate per host (SAN = the host's IP address(es); usable as a server identity
and, for the chained worker -> worker hop, as that worker's client identity), and one client
certificate for the route driver. Keys are EC P-256, valid for ``days`` (default 7).

Files written to ``out_dir``::

    ca.pem ca.key                       the authority (keep ca.key private; delete it after issuing)
    <host>.pem <host>.key               per host: serverAuth + clientAuth, SAN IP:<ip>, …
    client.pem client.key               the route driver: clientAuth
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .errors import DgrError

HOST_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
MAX_DAYS = 3650


@dataclass(frozen=True)
class HostCert:
    name: str
    cert: Path
    key: Path
    ips: tuple[str, ...]


@dataclass(frozen=True)
class Pki:
    dir: Path
    ca: Path
    ca_key: Path
    hosts: dict[str, HostCert]
    client_cert: Path
    client_key: Path

    def to_json(self) -> dict:
        return {"dir": str(self.dir), "ca": str(self.ca), "client_cert": str(self.client_cert),
                "client_key": str(self.client_key),
                "hosts": {n: {"cert": str(h.cert), "key": str(h.key), "san_ips": list(h.ips)}
                          for n, h in self.hosts.items()}}


def _write_key(path: Path, key) -> None:
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def make_pki(out_dir: Path, hosts: dict[str, Sequence[str]], *, days: int = 7,
             common_name: str = "dgr route CA") -> Pki:
    """Creates the CA and the certificates; ``hosts`` maps a host name to its IP addresses."""
    if importlib.util.find_spec("cryptography") is None:  # pragma: no cover - a declared dependency
        raise DgrError("the `cryptography` package is missing", hint="pip install -e . (it is a dgr dependency)")
    if not 1 <= days <= MAX_DAYS:
        raise DgrError(f"certificate lifetime must be 1..{MAX_DAYS} days, got {days}")
    ips: dict[str, list] = {}
    for name, addrs in hosts.items():
        if not HOST_NAME_RE.match(name):   # it names files in out_dir: no separators, no dot-dot
            raise DgrError(f"host name {name!r} must be 1-63 letters, digits, '-', '_' or '.', starting with a "
                           "letter or digit")
        if not addrs:
            raise DgrError(f"host {name!r} has no IP address for its certificate")
        try:
            ips[name] = [ipaddress.ip_address(a) for a in addrs]
        except ValueError as exc:
            raise DgrError(f"host {name!r}: {exc}") from None
        if name in ("ca", "client"):
            raise DgrError(f"host name {name!r} is reserved (ca, client)")
    try:
        return _make(out_dir, ips, days, common_name)
    except OSError as exc:
        raise DgrError(f"cannot write the certificates to {out_dir}: {exc.strerror or exc}") from None


def _make(out_dir: Path, ips: dict[str, list], days: int, common_name: str) -> Pki:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out_dir.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    until = now + dt.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now).not_valid_after(until)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))
    ca_pem, ca_key_path = out_dir / "ca.pem", out_dir / "ca.key"
    ca_pem.write_bytes(_pem(ca_cert))
    _write_key(ca_key_path, ca_key)

    def leaf(cn: str, san_ips: list, usages: list) -> tuple[bytes, object]:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
             .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now).not_valid_after(until)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
        if san_ips:
            b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(i) for i in san_ips]), critical=False)
        return _pem(b.sign(ca_key, hashes.SHA256())), key

    out: dict[str, HostCert] = {}
    for name, addrs in ips.items():
        pem, key = leaf(name, addrs, [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
        (out_dir / f"{name}.pem").write_bytes(pem)
        _write_key(out_dir / f"{name}.key", key)
        out[name] = HostCert(name, out_dir / f"{name}.pem", out_dir / f"{name}.key", tuple(str(a) for a in addrs))
    pem, key = leaf("dgr route driver", [], [ExtendedKeyUsageOID.CLIENT_AUTH])
    (out_dir / "client.pem").write_bytes(pem)
    _write_key(out_dir / "client.key", key)
    return Pki(out_dir, ca_pem, ca_key_path, out, out_dir / "client.pem", out_dir / "client.key")


def describe(cert_path: Path) -> dict:
    """Subject, SAN IPs, extended key usages and validity of a PEM certificate."""
    from cryptography import x509

    c = x509.load_pem_x509_certificate(cert_path.read_bytes())
    try:
        san = [str(i) for i in c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
               .get_values_for_type(x509.IPAddress)]
    except x509.ExtensionNotFound:
        san = []
    try:
        eku = [u._name for u in c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value]
    except x509.ExtensionNotFound:
        eku = []
    return {"subject": c.subject.rfc4514_string(), "issuer": c.issuer.rfc4514_string(), "san_ips": san,
            "extended_key_usage": eku, "not_after": c.not_valid_after_utc.isoformat()}
