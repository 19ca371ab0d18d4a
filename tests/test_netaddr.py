"""Loopback checks parse or resolve addresses (dgr.netaddr, the gateway's --host check, the
worker's --listen check); names that merely start like loopback are refused."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dgr.errors import DgrError
from dgr.netaddr import is_loopback_host, parse_ip
from dgr.serve.server import ServeOptions

LOOKALIKES = ["127.0.0.1.evil.example", "localhost.attacker", "127.evil", "::1.evil"]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.8.7", "::1", "[::1]", "[::ffff:127.0.0.1]", "::ffff:127.0.0.1",
                                  "localhost"])
def test_loopback_addresses(host):
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", [*LOOKALIKES, "10.0.0.1", "::ffff:10.0.0.1", "0.0.0.0", "::", ""])
def test_not_loopback(host):
    assert not is_loopback_host(host)


def test_v4_mapped_is_the_v4_address():
    assert parse_ip("[::ffff:10.1.2.3]") == parse_ip("10.1.2.3")
    assert parse_ip("127.0.0.1.evil.example") is None


@pytest.mark.parametrize("host", LOOKALIKES)
def test_gateway_refuses_lookalike_host_without_key_and_tls(host):
    with pytest.raises(DgrError, match="beyond this machine"):
        ServeOptions(host=host).check()


@pytest.mark.native
@pytest.mark.parametrize("host", ["127.0.0.1.evil.example", "localhost.attacker"])
def test_worker_refuses_lookalike_listen_without_tls(native_bin: Path, host: str):
    r = subprocess.run([str(native_bin / "dgr-worker"), "serve", "--fake-model", "--listen", f"{host}:0"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "non-loopback" in r.stderr, r.stderr


@pytest.mark.native
@pytest.mark.parametrize("listen", ["[::ffff:127.0.0.1]:0", "[::1]:0"])
def test_worker_loopback_literals_pass_the_check(native_bin: Path, listen: str):
    # the check passes (no "non-loopback" refusal); binding may still fail where IPv6 is off
    p = subprocess.Popen([str(native_bin / "dgr-worker"), "serve", "--fake-model", "--listen", listen],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        if not line:
            assert "non-loopback" not in p.stderr.read()
        else:
            assert "listening on" in line
    finally:
        p.terminate()
        p.wait(20)
