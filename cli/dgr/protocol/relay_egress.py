"""The dialling side of a relayed hop in a chained route: a local gRPC endpoint that carries
every call it accepts through a byte relay (docs/routes.md, "Relayed hops").

In the chained mode a worker dials the next Shard itself (``StepFrame.downstream``), over gRPC.
When the next Shard is reachable only through a relay, the worker's node runs a
:class:`RelayEgress`: the worker dials it like any Shard, and it forwards each call through the
relay to the :class:`~dgr.protocol.relay.RelayBridge` on the next Shard's node, which runs it
on that worker. Frames stay opaque bytes end to end (no request or response is parsed here):
the same ``OPEN``/``MSG``/``HALF_CLOSE``/``STATUS`` records as :mod:`dgr.protocol.relay`, so
a relayed hop keeps the chained, pipelined mode instead of falling back to stepwise.

Written here rather than taken from a library: the relay framing is dgr's own (a few records
around opaque gRPC messages), and grpc.aio's generic handlers already give a bytes-in/bytes-out
server; what is left is the pump between the two.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

import grpc

from .keepalive import server_options
from .relay import (_CODES, _UNARY, DEFAULT_MAX_FRAME, HALF_CLOSE, MSG, RELAY_SCHEME, SERVICE, STATUS, RelayRpcError,
                    _open, _record)

_log = logging.getLogger(__name__)


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, egress: "RelayEgress") -> None:
        self.egress = egress

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        method = details.method
        name = method.removeprefix(SERVICE)
        if not method.startswith(SERVICE):
            return None
        if name == "Session":
            return grpc.stream_stream_rpc_method_handler(self.egress._session)
        if name in _UNARY:
            return grpc.unary_unary_rpc_method_handler(self.egress._unary_for(method))
        return None


class RelayEgress:
    """Listens on ``host:port`` (gRPC; ``server_credentials`` for TLS) and runs each call it
    accepts through the relay at ``relay`` (``relay+tcp://HOST:PORT``; ``ssl``: an
    ssl.SSLContext for the relay byte stream)."""

    def __init__(self, relay: str, *, host: str = "127.0.0.1", port: int = 0, max_frame: int = DEFAULT_MAX_FRAME,
                 server_credentials: grpc.ServerCredentials | None = None, ssl: Any = None) -> None:
        if not relay.startswith(RELAY_SCHEME):
            raise ValueError(f"not a relay endpoint: {relay!r} (want {RELAY_SCHEME}HOST:PORT)")
        rhost, _, rport = relay.removeprefix(RELAY_SCHEME).rpartition(":")
        self.relay_host, self.relay_port = rhost, int(rport)
        self.host, self.port, self.max_frame = host, port, max_frame
        self.server_credentials, self.ssl = server_credentials, ssl
        self._server: grpc.aio.Server | None = None
        self.calls = 0
        self.frames_forwarded = 0

    async def start(self) -> "RelayEgress":
        opts = [("grpc.max_receive_message_length", self.max_frame), ("grpc.max_send_message_length", self.max_frame),
                # the dialling worker pings every 500 ms (its failure detection on the hop)
                *server_options(min_ping_interval_ms=200)]
        self._server = grpc.aio.server(options=opts)
        self._server.add_generic_rpc_handlers((_Handler(self),))
        addr = f"{self.host}:{self.port}"
        if self.server_credentials is not None:
            self.port = self._server.add_secure_port(addr, self.server_credentials)
        else:
            self.port = self._server.add_insecure_port(addr)
        await self._server.start()
        return self

    async def close(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=0.5)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def _connect(self, method: str, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await _open(self.relay_host, self.relay_port, method, self.max_frame, self.ssl)
        except RelayRpcError as exc:
            await context.abort(exc.code(), exc.details() or "relay unreachable")

    async def _finish(self, body: bytes, context: grpc.aio.ServicerContext) -> None:
        """The relayed call's final status: returns on OK, else ends this call with it."""
        code = _CODES.get(body[0] if body else 2, grpc.StatusCode.UNKNOWN)
        if code != grpc.StatusCode.OK:
            await context.abort(code, body[1:].decode(errors="replace"))

    async def _session(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        self.calls += 1
        conn = await self._connect(SERVICE + "Session", context)

        async def upstream() -> None:
            try:
                async for req in requests:
                    self.frames_forwarded += 1
                    conn.writer.write(_record(MSG, req, self.max_frame))
                    await conn.writer.drain()
                conn.writer.write(_record(HALF_CLOSE))
                await conn.writer.drain()
            except (ConnectionError, grpc.aio.AbortError, asyncio.InvalidStateError):
                conn.writer.close()

        up = asyncio.create_task(upstream())
        try:
            while True:
                try:
                    rec = await conn.rr.next()
                except ConnectionError as exc:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"relay connection lost: {exc}")
                if rec is None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "relay connection closed")
                tag, body = rec
                if tag == MSG:
                    self.frames_forwarded += 1
                    yield body
                elif tag == STATUS:
                    await self._finish(body, context)
                    return
                else:
                    await context.abort(grpc.StatusCode.INTERNAL, f"unexpected relay record tag {tag}")
        finally:
            # the caller went away, the relayed call ended, or the relay did: close the relay
            # connection (the bridge then ends the call on the worker)
            up.cancel()
            conn.writer.close()

    def _unary_for(self, method: str) -> Any:
        async def unary(req: bytes, context: grpc.aio.ServicerContext) -> bytes:
            self.calls += 1
            conn = await self._connect(method, context)
            try:
                conn.writer.write(_record(MSG, req, self.max_frame))
                await conn.writer.drain()
                resp = None
                while True:
                    rec = await conn.rr.next()
                    if rec is None:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, "relay connection closed")
                    tag, body = rec
                    if tag == MSG:
                        resp = body
                    elif tag == STATUS:
                        await self._finish(body, context)
                        if resp is None:
                            await context.abort(grpc.StatusCode.INTERNAL, "no response through the relay")
                        return resp
            except ConnectionError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"relay connection lost: {exc}")
            finally:
                conn.writer.close()
            raise AssertionError("unreachable")
        return unary
