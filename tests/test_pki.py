"""`dgr pki issue|show`: the certificates for mutual TLS between real machines (the same code
every lab issues its certificates with)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from dgr.main import app
from dgr.pki import describe


def test_issue_then_show(tmp_path):
    out = tmp_path / "pki"
    r = CliRunner().invoke(app, ["pki", "issue", "--host", "a=10.0.0.11", "--host", "b=10.0.0.12,10.0.1.12",
                                 "--out", str(out), "--days", "30"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["a.key", "a.pem", "b.key", "b.pem", "ca.key", "ca.pem",
                                                     "client.key", "client.pem"]
    d = describe(out / "b.pem")
    assert d["san_ips"] == ["10.0.0.12", "10.0.1.12"] and "dgr route CA" in d["issuer"]
    assert set(d["extended_key_usage"]) == {"serverAuth", "clientAuth"}
    r = CliRunner().invoke(app, ["pki", "show", str(out / "a.pem"), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["san_ips"] == ["10.0.0.11"]


def test_issue_never_overwrites_and_checks_its_hosts(tmp_path):
    out = tmp_path / "pki"
    assert CliRunner().invoke(app, ["pki", "issue", "--host", "a=10.0.0.11", "--out", str(out)]).exit_code == 0
    key = (out / "ca.key").read_bytes()
    for args, words in ((["--host", "a=10.0.0.11", "--out", str(out)], "not empty"),
                        (["--host", "a=10.0.0.1", "--host", "a=10.0.0.2", "--out", str(tmp_path / "x")], "twice"),
                        (["--host", "a", "--out", str(tmp_path / "y")], "NAME=IP"),
                        (["--host", "../a=10.0.0.1", "--out", str(tmp_path / "z")], "host name"),
                        (["--host", "a=not-an-ip", "--out", str(tmp_path / "w")], "host 'a'")):
        r = CliRunner().invoke(app, ["pki", "issue", *args])
        assert r.exit_code != 0 and words in str(r.exception), (args, r.exception)
    assert (out / "ca.key").read_bytes() == key
    assert not (tmp_path / "x").exists() and not (tmp_path / "z").exists()


def test_show_refuses_what_is_not_a_certificate(tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    r = CliRunner().invoke(app, ["pki", "show", str(junk)])
    assert r.exit_code != 0 and "not a PEM certificate" in str(r.exception)
    r = CliRunner().invoke(app, ["pki", "show", str(tmp_path / "missing.pem")])
    assert r.exit_code != 0 and "cannot read" in str(r.exception)
