"""Carry a route's gRPC frames through a byte relay.

Meshnet's relay moves bytes between two nodes that cannot reach each other directly. Over it we
run the *same* serialized ``dgr.shard.v1`` protobuf messages as the direct gRPC path, as opaque
length-delimited records (framing below): neither the relay nor the bridge parses
a dgr frame.

One relay connection carries one RPC (one Session stream, or one unary call):

    client -> bridge   OPEN  <method path, e.g. /dgr.shard.v1.ShardRuntimeService/Session>
    client -> bridge   MSG   <serialized request>            (one for unary, any number for Session)
    client -> bridge   HALF_CLOSE                           (Session: done writing)
    bridge -> client   MSG   <serialized response>          (per response)
    bridge -> client   STATUS <code byte><details utf-8>    (the RPC's final gRPC status; last record)

Each record is ``varint(len) || tag byte || body``. The worker side (:class:`RelayBridge`) turns
each relay connection into one gRPC call on the local worker with identity (bytes) serializers;
the client side (:class:`RelayStub`) offers the subset of the grpc.aio stub surface the
:class:`~dgr.route.driver.RouteDriver` uses, so a route may mix direct and relayed
hops (endpoint ``relay+tcp://HOST:PORT``).

Framing: a byte relay (Meshnet's relay, or anything that moves bytes) never parses dgr frames; it
moves records of the form ``varint(len) || bytes`` — the standard protobuf delimited encoding —
so the two ends can run the exact gRPC messages across it. :class:`FrameDecoder` accepts bytes
in arbitrary pieces and yields whole frames; a frame larger than the negotiated limit is an
error (never buffered without bound).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import grpc

from ..errors import DgrError
from .channel import open_channel
from ..shard.v1 import shard_runtime_pb2 as pb

# ---- framing --------------------------------------------------------------------------------

DEFAULT_MAX_FRAME = 64 << 20


class FrameTooLarge(DgrError):
    pass


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_frame(payload: bytes, *, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    if len(payload) > max_frame:
        raise FrameTooLarge(f"frame of {len(payload)} bytes exceeds the relay limit of {max_frame}")
    return _varint(len(payload)) + payload


class FrameDecoder:
    """Incremental decoder of varint-length-delimited frames."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        frames = []
        while True:
            n, shift, i = 0, 0, 0
            while i < len(self._buf):
                b = self._buf[i]
                n |= (b & 0x7F) << shift
                i += 1
                if not b & 0x80:
                    break
                shift += 7
                if shift > 63:
                    raise DgrError("relay stream corrupt: length varint longer than 10 bytes")
            else:
                return frames  # incomplete length prefix
            if n > self.max_frame:
                raise FrameTooLarge(f"incoming frame of {n} bytes exceeds the relay limit of {self.max_frame}")
            if len(self._buf) - i < n:
                return frames
            frames.append(bytes(self._buf[i:i + n]))
            del self._buf[:i + n]

    @property
    def pending(self) -> int:
        return len(self._buf)


# ---- the bridge and the client stub ------------------------------------------------------------

SERVICE = "/dgr.shard.v1.ShardRuntimeService/"
RELAY_SCHEME = "relay+tcp://"
OPEN, MSG, HALF_CLOSE, STATUS = 1, 2, 3, 4
_UNARY = {"GetCapability", "ReleaseSession", "CancelSession", "GetMetrics", "Tokenize", "Detokenize",
          "ApplyChatTemplate"}


def _record(tag: int, body: bytes = b"", max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    return encode_frame(bytes([tag]) + body, max_frame=max_frame + 1)


class _RecordReader:
    def __init__(self, reader: asyncio.StreamReader, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.reader = reader
        self.dec = FrameDecoder(max_frame + 1)
        self.pending: list[bytes] = []

    async def next(self) -> tuple[int, bytes] | None:
        while not self.pending:
            data = await self.reader.read(1 << 16)
            if not data:
                return None
            self.pending.extend(self.dec.feed(data))
        rec = self.pending.pop(0)
        if not rec:
            raise DgrError("relay record without a tag")
        return rec[0], rec[1:]


# ---- worker side ------------------------------------------------------------------------

class RelayBridge:
    """Accepts relay connections (TCP here; any byte stream in general) and runs each as one
    gRPC call on the worker at ``target``, forwarding frames as opaque bytes."""

    def __init__(self, target: str, *, host: str = "127.0.0.1", port: int = 0,
                 max_frame: int = DEFAULT_MAX_FRAME, tls: Any = None,
                 credentials: grpc.ChannelCredentials | None = None, ssl: Any = None) -> None:
        """``tls`` (a :class:`~dgr.protocol.tls.TlsFiles`) or ``credentials``: TLS to the worker
        (as :func:`~dgr.protocol.channel.open_channel`); ``ssl``: an ssl.SSLContext for the relay side."""
        self.target, self.host, self.port, self.max_frame = target, host, port, max_frame
        self.tls, self.credentials, self.ssl = tls, credentials, ssl
        self._server: asyncio.AbstractServer | None = None
        self._channel: grpc.aio.Channel | None = None
        self.connections = 0
        self.frames_forwarded = 0

    async def start(self) -> "RelayBridge":
        self._channel = open_channel(self.target, tls=self.tls, credentials=self.credentials, aio=True,
                                     max_message_bytes=self.max_frame)
        self._server = await asyncio.start_server(self._serve, self.host, self.port, ssl=self.ssl)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server:
            self._server.close()
            await self._server.wait_closed()
        if self._channel:
            await self._channel.close()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        rr = _RecordReader(reader, self.max_frame)
        try:
            first = await rr.next()
            if first is None or first[0] != OPEN:
                return
            method = first[1].decode()
            name = method.removeprefix(SERVICE)
            if not method.startswith(SERVICE) or (name not in _UNARY and name != "Session"):
                writer.write(_record(STATUS, bytes([grpc.StatusCode.UNIMPLEMENTED.value[0]]) + b"unknown method"))
                return
            assert self._channel is not None
            ident = lambda b: b  # noqa: E731  frames stay opaque bytes
            if name == "Session":
                await self._session(method, rr, writer, ident)
            else:
                rec = await rr.next()
                if rec is None or rec[0] != MSG:
                    return
                call = self._channel.unary_unary(method, request_serializer=ident, response_deserializer=ident)
                try:
                    resp = await call(rec[1], timeout=60)
                    writer.write(_record(MSG, resp, self.max_frame))
                    writer.write(_record(STATUS, bytes([0])))
                except grpc.aio.AioRpcError as exc:
                    writer.write(_record(STATUS, bytes([exc.code().value[0]]) + (exc.details() or "").encode()))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _session(self, method: str, rr: _RecordReader, writer: asyncio.StreamWriter, ident: Any) -> None:
        assert self._channel is not None
        call = self._channel.stream_stream(method, request_serializer=ident, response_deserializer=ident)()

        async def upstream() -> None:
            while True:
                rec = await rr.next()
                if rec is None:           # the relay connection went away: end the stream
                    call.cancel()
                    return
                tag, body = rec
                if tag == MSG:
                    self.frames_forwarded += 1
                    await call.write(body)
                elif tag == HALF_CLOSE:
                    await call.done_writing()
                    return

        up = asyncio.create_task(upstream())
        code, details = 0, b""
        try:
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    break
                self.frames_forwarded += 1
                writer.write(_record(MSG, resp, self.max_frame))
                await writer.drain()
            code = (await call.code()).value[0]
            details = (await call.details() or "").encode()
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code().value[0], (exc.details() or "").encode()
        except (grpc.aio.UsageError, asyncio.InvalidStateError):
            code, details = grpc.StatusCode.CANCELLED.value[0], b"relay connection closed"
        finally:
            up.cancel()
        writer.write(_record(STATUS, bytes([code]) + details))
        await writer.drain()


# ---- client side ------------------------------------------------------------------------

_CODES = {c.value[0]: c for c in grpc.StatusCode}


class RelayRpcError(grpc.aio.AioRpcError):
    """A gRPC status carried back through the relay (same surface as grpc.aio errors)."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(_CODES.get(code, grpc.StatusCode.UNKNOWN), grpc.aio.Metadata(), grpc.aio.Metadata(),
                         details=details)


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    rr: _RecordReader


async def _open(host: str, port: int, method: str, max_frame: int, ssl: Any = None) -> _Conn:
    try:
        reader, writer = await asyncio.open_connection(host, port, ssl=ssl, server_hostname=host if ssl else None)
    except OSError as exc:
        raise RelayRpcError(grpc.StatusCode.UNAVAILABLE.value[0], f"relay {host}:{port} unreachable: {exc}") from None
    writer.write(_record(OPEN, method.encode()))
    return _Conn(reader, writer, _RecordReader(reader, max_frame))


class RelaySessionCall:
    """The client end of a relayed Session stream: write/read/done_writing/cancel like
    grpc.aio's StreamStreamCall."""

    def __init__(self, stub: "RelayStub") -> None:
        self.stub = stub
        self._conn: _Conn | None = None
        self._status: tuple[int, str] | None = None
        self.bytes_sent = 0
        self.bytes_received = 0

    async def _ensure(self) -> _Conn:
        if self._conn is None:
            self._conn = await _open(self.stub.host, self.stub.port, SERVICE + "Session", self.stub.max_frame,
                                     self.stub.ssl)
        return self._conn

    async def write(self, req: pb.SessionRequest) -> None:
        if self._status is not None:
            raise asyncio.InvalidStateError("the relayed session stream has ended")
        c = await self._ensure()
        rec = _record(MSG, req.SerializeToString(), self.stub.max_frame)
        self.bytes_sent += len(rec)
        try:
            c.writer.write(rec)
            await c.writer.drain()
        except ConnectionError as exc:   # the relay connection went away: a status, as on grpc.aio
            raise self._lost(exc) from None

    def _lost(self, exc: BaseException) -> "RelayRpcError":
        if self._status is None:
            self._status = (grpc.StatusCode.UNAVAILABLE.value[0], f"relay connection lost: {exc}")
        return RelayRpcError(*self._status)

    async def read(self) -> Any:
        if self._status is not None:
            return self._eof()
        c = await self._ensure()
        try:
            rec = await c.rr.next()
        except ConnectionError as exc:
            raise self._lost(exc) from None
        if rec is None:
            self._status = (grpc.StatusCode.UNAVAILABLE.value[0], "relay connection closed")
            return self._eof()
        tag, body = rec
        self.bytes_received += len(body) + 1
        if tag == MSG:
            return pb.SessionResponse.FromString(body)
        if tag == STATUS:
            self._status = (body[0], body[1:].decode(errors="replace"))
            return self._eof()
        raise RelayRpcError(grpc.StatusCode.INTERNAL.value[0], f"unexpected relay record tag {tag}")

    def _eof(self) -> Any:
        assert self._status is not None
        code, details = self._status
        if code == 0:
            return grpc.aio.EOF
        raise RelayRpcError(code, details)

    async def done_writing(self) -> None:
        if self._conn is not None and self._status is None:
            try:
                self._conn.writer.write(_record(HALF_CLOSE))
                await self._conn.writer.drain()
            except ConnectionError as exc:
                raise self._lost(exc) from None

    def cancel(self) -> bool:
        if self._conn is not None:
            self._conn.writer.close()
        if self._status is None:
            self._status = (grpc.StatusCode.CANCELLED.value[0], "cancelled")
        return True


class _Unary:
    def __init__(self, stub: "RelayStub", name: str, resp_type: Any) -> None:
        self.stub, self.name, self.resp_type = stub, name, resp_type

    async def __call__(self, req: Any, timeout: float | None = None) -> Any:
        async def run() -> Any:
            c = await _open(self.stub.host, self.stub.port, SERVICE + self.name, self.stub.max_frame, self.stub.ssl)
            try:
                c.writer.write(_record(MSG, req.SerializeToString(), self.stub.max_frame))
                await c.writer.drain()
                resp = None
                while True:
                    rec = await c.rr.next()
                    if rec is None:
                        raise RelayRpcError(grpc.StatusCode.UNAVAILABLE.value[0], "relay connection closed")
                    tag, body = rec
                    if tag == MSG:
                        resp = self.resp_type.FromString(body)
                    elif tag == STATUS:
                        if body[0] != 0:
                            raise RelayRpcError(body[0], body[1:].decode(errors="replace"))
                        if resp is None:
                            raise RelayRpcError(grpc.StatusCode.INTERNAL.value[0], "no response through the relay")
                        return resp
            finally:
                c.writer.close()
        try:
            return await asyncio.wait_for(run(), timeout)
        except asyncio.TimeoutError:
            raise RelayRpcError(grpc.StatusCode.DEADLINE_EXCEEDED.value[0], "relay call timed out") from None
        except ConnectionError as exc:
            raise RelayRpcError(grpc.StatusCode.UNAVAILABLE.value[0], f"relay connection lost: {exc}") from None


class RelayStub:
    """The ShardRuntimeService stub surface the route driver uses, over a byte relay."""

    def __init__(self, address: str, *, max_frame: int = DEFAULT_MAX_FRAME, ssl: Any = None) -> None:
        host, _, port = address.removeprefix(RELAY_SCHEME).rpartition(":")
        self.host, self.port, self.max_frame = host, int(port), max_frame
        self.ssl = ssl   # ssl.SSLContext: the relay byte stream is TLS (the bridge's certificate is verified)
        self.GetCapability = _Unary(self, "GetCapability", pb.GetCapabilityResponse)
        self.ReleaseSession = _Unary(self, "ReleaseSession", pb.ReleaseSessionResponse)
        self.CancelSession = _Unary(self, "CancelSession", pb.CancelSessionResponse)
        self.GetMetrics = _Unary(self, "GetMetrics", pb.GetMetricsResponse)
        self.Tokenize = _Unary(self, "Tokenize", pb.TokenizeResponse)
        self.Detokenize = _Unary(self, "Detokenize", pb.DetokenizeResponse)
        self.ApplyChatTemplate = _Unary(self, "ApplyChatTemplate", pb.ApplyChatTemplateResponse)

    def Session(self, timeout: float | None = None) -> RelaySessionCall:  # noqa: N802 (gRPC name)
        return RelaySessionCall(self)


class RelayChannel:
    """Stands in for a grpc.aio.Channel of a relayed hop (nothing to hold open)."""

    async def close(self) -> None:
        return None


def is_relay_endpoint(endpoint: str) -> bool:
    return endpoint.startswith(RELAY_SCHEME)


# ---- the in-test loopback relay ---------------------------------------------------------

class LoopbackRelay:
    """A dumb byte relay: every accepted connection is piped to ``target`` (host:port), in
    pieces of at most ``chunk`` bytes (to prove the framing survives arbitrary splits). It never
    looks at the bytes; it counts them."""

    def __init__(self, target: str, *, chunk: int = 1000) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.chunk = chunk
        self.bytes_up = 0
        self.bytes_down = 0
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self) -> "LoopbackRelay":
        self._server = await asyncio.start_server(self._pipe, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def endpoint(self) -> str:
        return f"{RELAY_SCHEME}127.0.0.1:{self.port}"

    async def close(self) -> None:
        if self._server:
            self._server.close()
            await self._server.wait_closed()

    async def _pipe(self, r1: asyncio.StreamReader, w1: asyncio.StreamWriter) -> None:
        try:
            r2, w2 = await asyncio.open_connection(*self.target)
        except OSError:
            w1.close()
            return

        async def copy(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: bool) -> None:
            try:
                while data := await r.read(self.chunk):
                    if up:
                        self.bytes_up += len(data)
                    else:
                        self.bytes_down += len(data)
                    w.write(data)
                    await w.drain()
            except ConnectionError:
                pass
            finally:
                w.close()

        await asyncio.gather(copy(r1, w2, True), copy(r2, w1, False))
