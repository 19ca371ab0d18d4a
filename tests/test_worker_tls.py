"""dgr-worker over TLS and mutual TLS (certificates made with the openssl CLI)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from dgr.protocol.client import WorkerClient, WorkerError
from dgr.route.supervisor import WorkerProcess

pytestmark = pytest.mark.native


@pytest.fixture(scope="module")
def worker_bin(native_bin: Path) -> Path:
    env = os.environ.get("DGR_WORKER_BIN")
    return Path(env) if env else native_bin / "dgr-worker"


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    if not shutil.which("openssl"):
        pytest.skip("openssl CLI missing")
    d = tmp_path_factory.mktemp("pki")
    _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
         "-subj", "/CN=dgr-test-ca", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "extendedKeyUsage=clientAuth")):
        _run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text(ext + "\n")
        _run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)
    return d


def test_tls(worker_bin: Path, pki: Path):
    creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
    with WorkerProcess.start(["--fake-model", "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key")],
                             binary=worker_bin, credentials=creds) as w:
        with w.client() as c:
            assert c.capability().identity.architecture == "fake"
            with c.open_session() as s:
                assert s.prefill([1, 2, 3]) is not None
        with WorkerClient(w.target, timeout=3) as plain, pytest.raises(WorkerError) as ei:
            plain.capability()
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls(worker_bin: Path, pki: Path):
    ca = (pki / "ca.pem").read_bytes()
    good = grpc.ssl_channel_credentials(root_certificates=ca, private_key=(pki / "client.key").read_bytes(),
                                        certificate_chain=(pki / "client.pem").read_bytes())
    with WorkerProcess.start(["--fake-model", "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
                              "--tls-client-ca", str(pki / "ca.pem")], binary=worker_bin, credentials=good) as w:
        with w.client() as c:
            assert c.capability().identity.architecture == "fake"
        no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
        with WorkerClient(w.target, timeout=3, credentials=no_cert) as c, pytest.raises(WorkerError):
            c.capability()
