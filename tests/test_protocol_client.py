"""The one protocol client: one channel factory and its options, one Session stream
implementation behind the sync client, the asyncio client and the route driver."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from dgr.protocol.channel import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, channel_options
from dgr.protocol.channel import open_channel
from dgr.protocol.client import AsyncWorkerClient, StepTimeout, WorkerClient
from dgr.protocol.keepalive import server_options
from dgr.protocol.stream import AsyncSessionStream, sampled
from dgr.route.supervisor import WorkerProcess
from dgr.shard.v1 import shard_runtime_pb2 as pb
from fakeroute import run_alone

REPO = Path(__file__).resolve().parent.parent


def test_channel_options_keepalive_and_limits():
    opts = dict(channel_options())
    # the detection bounds (dgr.protocol.keepalive): a silent peer fails within time + timeout <= 3 s
    assert opts["grpc.keepalive_time_ms"] == KEEPALIVE_TIME_MS == 1_000
    assert opts["grpc.keepalive_timeout_ms"] == KEEPALIVE_TIMEOUT_MS == 1_000
    assert opts["grpc.http2.ping_timeout_ms"] == KEEPALIVE_TIMEOUT_MS
    assert opts["grpc.keepalive_permit_without_calls"] == 1 and opts["grpc.http2.max_pings_without_data"] == 0
    assert opts["grpc.max_receive_message_length"] == opts["grpc.max_send_message_length"] == 64 << 20
    assert opts["grpc.enable_retries"] == 0
    assert opts["grpc.use_local_subchannel_pool"] == 1   # every channel connects on its own
    assert dict(channel_options(1 << 20))["grpc.max_send_message_length"] == 1 << 20


def test_the_worker_accepts_our_ping_rate():
    """The client pings no more often than the worker allows without data (else it would answer
    with a too_many_pings GOAWAY)."""
    serve = (REPO / "worker" / "src" / "worker" / "serve.cpp").read_text()
    m = re.search(r"GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,\s*(\d+)", serve)
    assert m and KEEPALIVE_TIME_MS >= int(m.group(1))


async def _idle_call_survives(server_opts, hold_s: float) -> str:
    """One unary call that the server answers after ``hold_s`` of silence, on a channel with
    the route's keepalive: "ok", or the gRPC error the call ended with."""
    import grpc

    async def wait(request, context):
        await asyncio.sleep(hold_s)
        return request

    ident = lambda b: b  # noqa: E731
    server = grpc.aio.server(options=server_opts)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.Idle", {"Wait": grpc.unary_unary_rpc_method_handler(wait, ident, ident)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with open_channel(f"127.0.0.1:{port}", aio=True) as ch:
            try:
                await ch.unary_unary("/t.Idle/Wait", request_serializer=ident, response_deserializer=ident)(
                    b"x", timeout=hold_s + 10)
                return "ok"
            except grpc.aio.AioRpcError as e:
                return f"{e.code().name}: {e.details()}"
    finally:
        await server.stop(None)


def test_python_servers_accept_the_route_ping_rate():
    """A call that stays silent for several keepalive intervals survives on a server built with
    server_options(); at gRPC's default policy the same call ends in GOAWAY too_many_pings (the
    Transformers shard worker's defect at the 1B preset), so the check can fail."""
    hold = 5 * KEEPALIVE_TIME_MS / 1000 + 1.0   # at the defaults the GOAWAY comes after 4-5 pings
    assert asyncio.run(_idle_call_survives(server_options(), hold)) == "ok"
    failed = asyncio.run(_idle_call_survives([], hold))
    assert failed != "ok" and "too_many_pings" in failed.lower().replace(" ", "_"), failed


def test_server_options_refuse_a_negative_interval():
    with pytest.raises(ValueError):
        server_options(-1)


def test_every_python_grpc_server_takes_the_ping_policy():
    """Each gRPC server the package starts passes server_options() (a route dials all of them
    with keepalive pings)."""
    servers, offenders = 0, []
    for path in (REPO / "cli" / "dgr").rglob("*.py"):
        text = path.read_text()
        for m in re.finditer(r"grpc(?:\.aio)?\.server\(", text):
            servers += 1
            call = text[m.start():m.start() + 600]
            opts_name = re.search(r"options=(\w+)", call)
            if "server_options(" not in call and not (opts_name and "server_options(" in text):
                offenders.append(str(path.relative_to(REPO)))
    assert servers >= 2 and not offenders, offenders


def test_channels_are_opened_in_one_place():
    """No module but protocol/channel.py creates a gRPC channel (grpc.insecure_channel,
    grpc.secure_channel, their grpc.aio forms)."""
    offenders = []
    for root in (REPO / "cli" / "dgr", REPO / "meshnet_adapter"):
        for path in root.rglob("*.py"):
            if path.name == "channel.py" or "shard/v1" in path.as_posix():
                continue
            if re.search(r"\b(insecure|secure)_channel\(", path.read_text()):
                offenders.append(str(path.relative_to(REPO)))
    assert not offenders, offenders


native = pytest.mark.native


@pytest.fixture(scope="module")
def slow_worker(native_bin: Path):
    with WorkerProcess.start(["--fake-model", "--fake-delay-ms", "400"], binary=native_bin / "dgr-worker") as w:
        yield w


@native
def test_sync_stream_is_the_async_stream(slow_worker):
    with WorkerClient(slow_worker.target) as c, c.open_session() as s:
        assert isinstance(s.stream, AsyncSessionStream)
        s.step += 0            # state lives on the one stream
        assert s.stream.step == s.step == 0


@native
def test_sync_recv_timeout_leaves_the_read_pending(slow_worker):
    """recv(timeout) that passes does not end the stream: the next recv gets that answer."""
    with WorkerClient(slow_worker.target) as c, c.open_session() as s:
        s.send(s._input_frame(pb.PHASE_PREFILL, [1, 2, 3], None, True))
        with pytest.raises(StepTimeout):
            s.recv(timeout=0.05)
        resp = s.recv(timeout=10)
        assert resp.header.cached_positions == 3
        assert sampled(resp) == run_alone(c, [1, 2, 3], n=0)[0]   # the deterministic model's token


@native
def test_driver_streams_are_the_protocol_stream(slow_worker):
    from dgr.route.driver import RouteDriver

    async def main() -> None:
        d = await RouteDriver([slow_worker.target], chain=False).connect()
        try:
            st = await d.open_stream(d.head, "s-probe", 1)
            assert isinstance(st, AsyncSessionStream)
            assert isinstance(d.head.client, AsyncWorkerClient)
            await st.close()
            st.cancel()
        finally:
            await d.close()

    asyncio.run(main())


@native
def test_sync_client_loop_runs_only_while_a_sync_client_is_open(slow_worker):
    """The sync clients' event-loop thread stops when the last sync client closes: an idle
    extra grpc.aio loop in the process would be woken by every message of the route driver's."""
    import subprocess
    import sys

    code = (
        "import threading\n"
        "from dgr.protocol import client as cm\n"
        f"c = cm.WorkerClient({slow_worker.target!r}); d = cm.WorkerClient({slow_worker.target!r})\n"
        "assert c.capability().identity.architecture == 'fake' and d.load() is not None\n"
        "names = lambda: [t.name for t in threading.enumerate()]\n"
        "assert 'dgr-worker-client' in names(); c.close()\n"
        "assert 'dgr-worker-client' in names(); d.close(); d.close()\n"
        "assert cm._CLIENT_LOOP.loop is None and 'dgr-worker-client' not in names(), names()\n"
        "e = cm.WorkerClient(" + repr(slow_worker.target) + "); assert e.capability(); e.close()\n"
        "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def _serve_on(binary: Path, listen: str):
    """A fake worker on ``listen``, waited for by its stdout line only (no gRPC call: a health
    check from this process would itself wait out a stale connection and hide it)."""
    import subprocess

    proc = subprocess.Popen([str(binary), "serve", "--fake-model", "--listen", listen],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "listening on" in line:
            return proc
    proc.wait(10)
    raise AssertionError(f"worker on {listen} exited (exit {proc.returncode}) before listening")


@native
def test_new_route_to_a_restarted_worker_connects_at_once(native_bin: Path):
    """In one process, a route that saw its worker die keeps its channel; a new stepwise route to
    the worker restarted on the same port connects and generates at once, not failing with the
    old connection's error while that one backs off (each channel connects on its own)."""
    from dgr.protocol.errors import WorkerError
    from dgr.route.driver import RouteDriver

    binary = native_bin / "dgr-worker"
    first = WorkerProcess.start(["--fake-model"], binary=binary)
    target = first.target

    async def main() -> None:
        old = await RouteDriver([target], chain=False).connect()
        try:
            before = (await old.generate([1, 2, 3], max_tokens=4, stop_on_eog=False)).tokens
            assert len(before) == 4
            first.kill()
            with pytest.raises(WorkerError):             # the old route sees the worker gone
                await old.head.client.capability(refresh=True, timeout=10)
            proc = _serve_on(binary, target)
            try:
                new = await RouteDriver([target], chain=False).connect()
                try:
                    after = await new.generate([1, 2, 3], max_tokens=4, stop_on_eog=False)
                    assert after.error is None and after.tokens == before   # the same deterministic model
                finally:
                    await new.close()
            finally:
                proc.kill()
                proc.wait(10)
        finally:
            await old.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        first.kill()
