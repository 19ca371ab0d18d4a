"""Relayed hops: the same serialized protobuf frames through a byte relay (in-test loopback
relay that splits the byte stream in small pieces) to real fake-model workers."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from dgr.protocol.relay import LoopbackRelay, RelayBridge
from dgr.route.driver import RouteDriver
from dgr.route.supervisor import WorkerProcess
from dgr.shard.v1 import shard_runtime_pb2 as pb

pytestmark = pytest.mark.native

PROMPTS = [[256, *b"through the relay"], [256, *b"a second concurrent session"], [256, *b"3"]]


@pytest.fixture(scope="module")
def workers(native_bin):
    ws = {r: WorkerProcess.start(["--fake-model", "--layers", r], binary=native_bin / "dgr-worker")
          for r in ("0:4", "4:8")}
    yield ws
    for w in ws.values():
        w.kill()


async def _route(endpoints, **kw):
    d = await RouteDriver(endpoints).connect()
    try:
        return await asyncio.gather(*(d.generate(p, **kw) for p in PROMPTS)), d
    finally:
        await d.close()


def test_relayed_route_gives_the_direct_routes_tokens(workers):
    async def main():
        bridges = [await RelayBridge(workers[r].target).start() for r in ("0:4", "4:8")]
        relays = [await LoopbackRelay(b.address, chunk=7).start() for b in bridges]
        try:
            direct, _ = await _route([workers["0:4"].target, workers["4:8"].target], max_tokens=20,
                                     stop_on_eog=False)
            # all relayed, and mixed (direct head, relayed tail)
            relayed, _ = await _route([r.endpoint for r in relays], max_tokens=20, stop_on_eog=False)
            mixed, _ = await _route([workers["0:4"].target, relays[1].endpoint], max_tokens=20, stop_on_eog=False)
            return direct, relayed, mixed, bridges, relays
        finally:
            for r in relays:
                await r.close()
            for b in bridges:
                await b.close()

    direct, relayed, mixed, bridges, relays = asyncio.run(main())
    assert all(r.error is None for r in direct + relayed + mixed), [str(r.error) for r in relayed + mixed]
    assert [r.tokens for r in relayed] == [r.tokens for r in direct]
    assert [r.tokens for r in mixed] == [r.tokens for r in direct]
    assert all(b.frames_forwarded > 0 for b in bridges)
    assert relays[1].bytes_up > 0 and relays[1].bytes_down > 0


def test_relay_carries_structured_errors_and_status(workers):
    """A shard error frame and a gRPC status both come back through the relay unchanged."""
    from dgr.shard.v1 import shard_runtime_pb2 as pb
    from dgr.protocol.relay import RelayRpcError, RelayStub

    async def main():
        bridge = await RelayBridge(workers["4:8"].target).start()
        relay = await LoopbackRelay(bridge.address, chunk=3).start()
        try:
            stub = RelayStub(relay.endpoint)
            cap = await stub.GetCapability(pb.GetCapabilityRequest(), timeout=10)
            call = stub.Session()
            # a token span to a non-head shard: ROLE_MISMATCH error frame
            h = pb.FrameHeader(schema_version=pb.SCHEMA_VERSION_V1, session_id="s", route_epoch=1,
                               compatibility_fingerprint=cap.identity.compatibility_fingerprint,
                               shard_range=cap.identity.range, phase=pb.PHASE_PREFILL,
                               positions=pb.PositionRange(start=0, end=1),
                               cache_expectation=pb.CacheExpectation(kind=pb.CACHE_EXPECTATION_KIND_EMPTY))
            await call.write(pb.SessionRequest(step=pb.StepFrame(header=h, tokens=pb.TokenSpan(token_ids=[1]))))
            resp = await asyncio.wait_for(call.read(), 10)
            await call.done_writing()
            call.cancel()
            try:
                await stub.Detokenize(pb.DetokenizeRequest(token_ids=[10**6]), timeout=10)
                unary_err = None
            except RelayRpcError as exc:
                unary_err = exc
            return cap, resp, unary_err
        finally:
            await relay.close()
            await bridge.close()

    cap, resp, unary_err = asyncio.run(main())
    assert cap.identity.range.start == 4 and cap.identity.tail
    assert resp.WhichOneof("result") == "error"
    assert resp.error.reason == pb.ERROR_REASON_ROLE_MISMATCH
    if unary_err is not None:   # an out-of-vocab detokenize is refused with a status, carried back
        assert unary_err.code().name in ("INVALID_ARGUMENT", "OUT_OF_RANGE")


def test_relay_connection_reset_is_a_grpc_status():
    """A relay connection that is reset (the bridge went away) surfaces as UNAVAILABLE, the way a
    grpc.aio call ends, never as a bare ConnectionError."""
    import socket
    import struct

    from dgr.protocol.relay import RelayRpcError, RelayStub

    async def main():
        async def reset(r, w):
            sock = w.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.close()
        srv = await asyncio.start_server(reset, "127.0.0.1", 0)
        stub = RelayStub(f"relay+tcp://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
        call = stub.Session()
        errors = []
        for _ in range(50):      # bounded: the reset is seen by a write or a read, whichever comes first
            try:
                await call.write(pb.SessionRequest())
                await call.read()
            except Exception as exc:  # noqa: BLE001 - the type is what is checked
                errors.append(exc)
                break
        srv.close()
        return errors
    errors = asyncio.run(main())
    assert len(errors) == 1 and isinstance(errors[0], RelayRpcError)
    assert errors[0].code() == grpc.StatusCode.UNAVAILABLE
