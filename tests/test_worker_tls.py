"""dgr-worker over TLS and mutual TLS (certificates made with the openssl CLI)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from dgr.protocol.client import ShardError, WorkerClient, WorkerError
from dgr.shard.v1 import shard_runtime_pb2 as pb
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
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "extendedKeyUsage=clientAuth"),
                      ("other", "extendedKeyUsage=clientAuth")):
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


def _creds(pki: Path, name: str | None) -> grpc.ChannelCredentials:
    ca = (pki / "ca.pem").read_bytes()
    if name is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=(pki / f"{name}.key").read_bytes(),
                                        certificate_chain=(pki / f"{name}.pem").read_bytes())


def _reflection_lists_service(target: str, creds: grpc.ChannelCredentials) -> bool:
    from dgr.protocol.channel import open_channel

    with open_channel(target, credentials=creds) as ch:
        call = ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                request_serializer=lambda b: b, response_deserializer=lambda b: b)
        return b"dgr.shard.v1.ShardRuntimeService" in b"".join(call(iter([b"\x3a\x00"]), timeout=5))


def test_require_client_auth_leaves_only_health_and_reflection_open(worker_bin: Path, pki: Path):
    tls = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
           "--tls-client-ca", str(pki / "ca.pem"), "--require-client-auth"]
    with WorkerProcess.start(["--fake-model", *tls], binary=worker_bin, credentials=_creds(pki, "client")) as w:
        with WorkerClient(w.target, timeout=5, credentials=_creds(pki, None)) as anon:
            assert anon.health() == "SERVING"
            assert anon.health("dgr.shard.v1.ShardRuntimeService") == "SERVING"
            assert _reflection_lists_service(w.target, _creds(pki, None))
            for call in (anon.capability, anon.metrics, lambda: anon.tokenize("hi"), lambda: anon.detokenize([104]),
                         lambda: anon.release("x"), lambda: anon.cancel("x")):
                with pytest.raises(WorkerError) as ei:
                    call()
                assert ei.value.code == grpc.StatusCode.UNAUTHENTICATED, ei.value
            # a Session stream ends UNAUTHENTICATED before reading a frame
            from dgr.protocol.channel import open_channel
            from dgr.shard.v1 import shard_runtime_pb2_grpc as pb_grpc

            with open_channel(w.target, credentials=_creds(pki, None)) as ch, pytest.raises(grpc.RpcError) as ei:
                list(pb_grpc.ShardRuntimeServiceStub(ch).Session(iter([pb.SessionRequest()]), timeout=5))
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with w.client() as c:
            assert c.capability().identity.architecture == "fake"
            with c.open_session() as s:
                assert s.prefill([1, 2, 3]) is not None
    r = subprocess.run([str(worker_bin), "serve", "--fake-model", "--require-client-auth"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--require-client-auth needs --tls-client-ca" in r.stderr


def test_mtls_identity_owns_the_session(worker_bin: Path, pki: Path):
    """With client certificates, a newer epoch from another stream of the SAME client identity
    supersedes its session (a driver restarting on a fresh stream); another identity cannot."""
    tls = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
           "--tls-client-ca", str(pki / "ca.pem")]
    with WorkerProcess.start(["--fake-model", *tls], binary=worker_bin, credentials=_creds(pki, "client")) as w:
        with w.client() as mine, WorkerClient(w.target, timeout=5, credentials=_creds(pki, "other")) as theirs:
            owner = mine.open_session("sess")
            owner.prefill([1, 2, 3])
            intruder = theirs.open_session("sess", epoch=2)
            with pytest.raises(ShardError) as ei:
                intruder.prefill([4, 5])
            assert ei.value.reason == pb.ERROR_REASON_SESSION_NOT_OWNED
            assert owner.decode(7) is not None                       # untouched
            restart = mine.open_session("sess", epoch=2)
            assert restart.prefill([4, 5]) is not None              # same identity: supersedes
            assert owner.wait_closed() == grpc.StatusCode.ABORTED    # the old stream ends STALE_EPOCH
            restart.release()
            for s in (owner, intruder, restart):
                s.close()


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
