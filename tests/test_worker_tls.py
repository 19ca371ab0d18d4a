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


def test_one_channel_factory_makes_tls_and_mutual_tls_for_every_client(worker_bin: Path, pki: Path):
    """``tls=TlsFiles(...)`` (protocol.channel.open_channel): a CA alone is TLS, a CA with a
    certificate and key is mutual TLS; the sync client, the asyncio client and the route driver
    all open their channels through it."""
    import asyncio

    from dgr.protocol.client import AsyncWorkerClient
    from dgr.protocol.tls import TlsFiles
    from dgr.route.driver import RouteDriver, RouteError

    mtls = TlsFiles(pki / "ca.pem", pki / "client.pem", pki / "client.key")
    server_only = TlsFiles(pki / "ca.pem")
    with WorkerProcess.start(["--fake-model", "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
                              "--tls-client-ca", str(pki / "ca.pem")], binary=worker_bin,
                             credentials=mtls.grpc_credentials()) as w:
        with WorkerClient(w.target, timeout=5, tls=mtls) as c, c.open_session() as s:
            assert s.prefill([1, 2, 3]) is not None
        with WorkerClient(w.target, timeout=3, tls=server_only) as c, pytest.raises(WorkerError):
            c.capability()   # the worker requires a client certificate

        async def through_async_client_and_driver() -> list[int]:
            async with AsyncWorkerClient(w.target, timeout=5, tls=mtls) as ac:
                s = await ac.open_session()
                first = await s.prefill([1, 2, 3])
                await s.close()
            d = await RouteDriver([w.target], tls=mtls, timeout=5).connect()
            try:
                r = await d.generate([1, 2, 3], max_tokens=3, stop_on_eog=False)
            finally:
                await d.close()
            assert r.error is None
            assert r.tokens[0] == first     # same worker, same prompt: the same first token
            with pytest.raises(RouteError, match="unreachable"):
                await RouteDriver([w.target], tls=server_only, timeout=3).connect()
            return r.tokens

        assert len(asyncio.run(through_async_client_and_driver())) == 3
