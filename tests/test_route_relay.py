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


def test_a_relay_egress_keeps_the_chained_mode_with_the_direct_routes_tokens(workers):
    """The head dials a relay egress (a local gRPC endpoint) that carries the hop through the
    relay to the tail's bridge: the route stays chained and makes the direct route's tokens; the
    unary calls go through it too, and errors come back with their status."""
    from dgr.protocol.relay_egress import RelayEgress
    from dgr.protocol.relay import RelayStub  # noqa: F401  (the driver's side of the same relay)

    async def main():
        bridge = await RelayBridge(workers["4:8"].target).start()
        relay = await LoopbackRelay(bridge.address, chunk=5).start()
        egress = await RelayEgress(relay.endpoint).start()
        try:
            direct, dd = await _route([workers["0:4"].target, workers["4:8"].target], max_tokens=20,
                                      stop_on_eog=False)
            d = await RouteDriver([workers["0:4"].target, relay.endpoint], hops=["", egress.address]).connect()
            try:
                mode, hops = d.mode, [h.endpoint for h in d.chain_hops()]
                relayed = await asyncio.gather(*(d.generate(p, max_tokens=20, stop_on_eog=False) for p in PROMPTS))
            finally:
                await d.close()
            # a unary call and a refused one through the egress, as a worker would make them
            ch = grpc.aio.insecure_channel(egress.address)
            cap = await ch.unary_unary("/dgr.shard.v1.ShardRuntimeService/GetCapability",
                                       request_serializer=pb.GetCapabilityRequest.SerializeToString,
                                       response_deserializer=pb.GetCapabilityResponse.FromString)(
                pb.GetCapabilityRequest(), timeout=10)
            try:
                await ch.unary_unary("/dgr.shard.v1.ShardRuntimeService/Detokenize",
                                     request_serializer=pb.DetokenizeRequest.SerializeToString,
                                     response_deserializer=pb.DetokenizeResponse.FromString)(
                    pb.DetokenizeRequest(token_ids=[10**6]), timeout=10)
                code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
            await ch.close()
            return dd.mode, mode, hops, direct, relayed, egress.calls, egress.frames_forwarded, cap, code
        finally:
            await egress.close()
            await relay.close()
            await bridge.close()

    dmode, mode, hops, direct, relayed, calls, frames, cap, code = asyncio.run(main())
    assert dmode == "chained" and mode == "chained"
    assert hops == [hops[0]] and hops[0].startswith("127.0.0.1:")     # the head dials the egress
    assert all(r.error is None for r in relayed), [str(r.error) for r in relayed]
    assert [r.tokens for r in relayed] == [r.tokens for r in direct]
    assert calls >= len(PROMPTS) and frames > 2 * len(PROMPTS)
    assert cap.identity.range.start == 4
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)


def test_a_relay_egress_whose_relay_is_gone_fails_the_session_naming_the_tail(workers):
    """The relay behind the egress is unreachable: the head's hop fails, and the driver names
    the relayed shard (the head reports the egress address it dialled)."""
    import socket

    from dgr.protocol.relay_egress import RelayEgress

    async def main():
        bridge = await RelayBridge(workers["4:8"].target).start()
        relay = await LoopbackRelay(bridge.address).start()
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        dead = f"relay+tcp://127.0.0.1:{s.getsockname()[1]}"     # bound, never listening: refused
        egress = await RelayEgress(dead).start()
        try:
            d = await RouteDriver([workers["0:4"].target, relay.endpoint], hops=["", egress.address]).connect()
            try:
                r = await d.generate(PROMPTS[0], max_tokens=8, stop_on_eog=False)
                return d.mode, r
            finally:
                await d.close()
        finally:
            s.close()
            await egress.close()
            await relay.close()
            await bridge.close()

    mode, r = asyncio.run(main())
    assert mode == "chained" and r.error is not None
    assert r.error.shard_range == (4, 8), str(r.error)


def test_every_unary_rpc_of_the_service_goes_through_the_relay():
    """The relay stub and bridge know every unary method the service has (a new RPC that the
    relay does not carry broke `dgr lab route --relay` with an AttributeError once)."""
    from dgr.protocol.relay import _UNARY, RelayStub

    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["ShardRuntimeService"].methods}
    unary = {m.name for m in pb.DESCRIPTOR.services_by_name["ShardRuntimeService"].methods
             if not m.client_streaming and not m.server_streaming}
    assert methods - unary == {"Session"}
    assert unary == _UNARY
    stub = RelayStub("relay+tcp://127.0.0.1:1")
    assert all(callable(getattr(stub, name, None)) for name in unary)


def _ready(p) -> str:
    """The address a `dgr relay …` process printed once ready (bounded)."""
    import re

    for _ in range(50):
        line = p.stderr.readline()
        if not line:
            break
        m = re.search(r"dgr relay: ready (\S+)", line)
        if m:
            return m.group(1)
    raise AssertionError("dgr relay did not report ready")


def test_dgr_relay_commands_and_route_generate_hop_keep_the_route_chained(workers):
    """The operator's path: `dgr relay bridge` by the tail, `dgr relay egress` by the head, and
    `dgr route generate --shard HEAD --shard relay+tcp://BRIDGE --hop relay+tcp://BRIDGE=EGRESS`:
    chained, the direct route's tokens."""
    import json
    import signal
    import subprocess
    import sys

    dgr = [sys.executable, "-c", "from dgr.main import main; main()"]
    procs = []
    try:
        b = subprocess.Popen([*dgr, "relay", "bridge", "--worker", workers["4:8"].target], stderr=subprocess.PIPE,
                             text=True)
        procs.append(b)
        bridge = "relay+tcp://" + _ready(b)
        e = subprocess.Popen([*dgr, "relay", "egress", "--relay", bridge], stderr=subprocess.PIPE, text=True)
        procs.append(e)
        egress = _ready(e)
        args = ["route", "generate", "--prompt", "relay", "--raw", "--max-tokens", "12", "--json"]
        direct = subprocess.run([*dgr, *args, "--shard", workers["0:4"].target, "--shard", workers["4:8"].target],
                                capture_output=True, text=True, timeout=120)
        relayed = subprocess.run([*dgr, *args, "--shard", workers["0:4"].target, "--shard", bridge,
                                  "--hop", f"{bridge}={egress}"], capture_output=True, text=True, timeout=120)
        assert direct.returncode == 0 and relayed.returncode == 0, relayed.stderr[-2000:]
        d, r = json.loads(direct.stdout), json.loads(relayed.stdout)
        assert d["mode"] == "chained" and r["mode"] == "chained"
        assert r["sessions"][0]["tokens"] == d["sessions"][0]["tokens"] and len(d["sessions"][0]["tokens"]) == 12
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            assert p.wait(15) == 0


@pytest.mark.parametrize("args, says", [
    (["relay", "egress", "--relay", "tcp://127.0.0.1:1"], "expected relay+tcp://HOST:PORT"),
    (["relay", "bridge", "--worker", "127.0.0.1:1", "--listen", "0.0.0.0:0"], "without TLS"),
    (["relay", "bridge", "--worker", "nohost"], "expected HOST:PORT"),
    (["relay", "egress", "--relay", "relay+tcp://127.0.0.1:1", "--tls-ca", "x.pem"], "go together"),
    (["route", "generate", "--prompt", "x", "--shard", "127.0.0.1:1", "--shard", "relay+tcp://127.0.0.1:2",
      "--hop", "relay+tcp://127.0.0.1:3=127.0.0.1:4"], "is not a --shard"),
    (["route", "generate", "--prompt", "x", "--shard", "127.0.0.1:1", "--shard", "relay+tcp://127.0.0.1:2",
      "--hop", "127.0.0.1:1=127.0.0.1:4"], "the head is dialled by the driver"),
    (["route", "generate", "--prompt", "x", "--shard", "127.0.0.1:1", "--shard", "relay+tcp://127.0.0.1:2",
      "--hop", "nonsense"], "expected SHARD=HOST:PORT"),
    (["serve", "--port", "0", "--hop", "relay+tcp://127.0.0.1:2=127.0.0.1:4"], "--hop goes with --shard or --route"),
    (["serve", "--port", "0", "--shard", "127.0.0.1:1", "--shard", "relay+tcp://127.0.0.1:2", "--hop",
      "relay+tcp://127.0.0.1:2=127.0.0.1:4", "--standby", "127.0.0.1:5"], "does not go with --standby"),
    (["serve", "--port", "0", "--route", "127.0.0.1:1,relay+tcp://127.0.0.1:2", "--hop",
      "relay+tcp://127.0.0.1:9=127.0.0.1:4"], "is not a --shard"),
])
def test_relay_options_are_refused_in_one_line(args, says):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", "from dgr.main import main; main()", *args], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1, p.stderr
    assert says in p.stderr and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_the_gateway_serves_a_relayed_route_chained_through_its_hop(workers):
    """`dgr serve --shard HEAD --shard relay+tcp://BRIDGE --hop …`: the gateway's route is chained
    through the egress, and its answer equals the direct route's."""
    import httpx

    from dgr.protocol.relay_egress import RelayEgress
    from dgr.serve.server import Gateway, RouteSpec

    async def up():
        bridge = await RelayBridge(workers["4:8"].target).start()
        egress = await RelayEgress("relay+tcp://" + bridge.address).start()
        return bridge, egress

    loop = asyncio.new_event_loop()
    import threading

    threading.Thread(target=loop.run_forever, daemon=True).start()
    bridge, egress = asyncio.run_coroutine_threadsafe(up(), loop).result(30)
    ask = dict(model="m", prompt="hop", max_tokens=12, temperature=0)
    try:
        with Gateway([workers["0:4"].target, workers["4:8"].target], model_id="m") as direct:
            want = httpx.post(direct.url + "/v1/completions", json=ask, timeout=30).json()["choices"][0]["text"]
        relayed = "relay+tcp://" + bridge.address
        spec = RouteSpec((workers["0:4"].target, relayed), "m", hops=("", egress.address))
        with Gateway(routes=[spec]) as gw:
            assert gw.engine.driver.mode == "chained"
            got = httpx.post(gw.url + "/v1/completions", json=ask, timeout=30).json()["choices"][0]["text"]
        assert got == want and egress.calls > 0
    finally:
        asyncio.run_coroutine_threadsafe(egress.close(), loop).result(30)
        asyncio.run_coroutine_threadsafe(bridge.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
