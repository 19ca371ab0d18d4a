"""Typed Python client of one dgr-worker (``dgr.shard.v1.ShardRuntimeService``) over grpcio.

Used by the tests and by route code. Sync API; every blocking call has a deadline, and the
channel sends keepalive pings, so a dead worker shows up as :class:`WorkerUnavailable`
(gRPC UNAVAILABLE) within a bounded time instead of a hang.

    with WorkerClient("127.0.0.1:50151") as c:
        cap = c.capability()
        with c.open_session("s1") as s:
            first = s.prefill([1, 2, 3])          # sampled token after the prompt (tail)
            tokens = s.generate(first, 16)         # 16 more greedy tokens
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from dgr import bundle as bundle_mod
from dgr.shard.v1 import shard_runtime_pb2 as pb
from dgr.shard.v1 import shard_runtime_pb2_grpc as pb_grpc

SERVICE_NAME = "dgr.shard.v1.ShardRuntimeService"
_DONE = object()


class WorkerError(Exception):
    """A gRPC failure talking to a worker (status code + details)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class WorkerUnavailable(WorkerError):
    """UNAVAILABLE: the worker is gone or not serving; retry elsewhere."""


class ShardError(Exception):
    """A structured error frame (``ShardError``) answering one session step."""

    def __init__(self, err: pb.ShardError, header: pb.ResponseHeader | None = None) -> None:
        self.proto = err
        self.reason = err.reason
        self.reason_name = pb.ErrorReason.Name(err.reason)
        self.grpc_code = err.grpc_code
        self.terminated = err.session_terminated
        self.header = header
        super().__init__(f"{self.reason_name}: {err.message}")


def _wrap(exc: grpc.RpcError) -> WorkerError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = WorkerUnavailable if code == grpc.StatusCode.UNAVAILABLE else WorkerError
    return cls(code, details or "")


@dataclass(frozen=True)
class Sampling:
    """The tail's sampling contract (greedy unless ``temperature`` > 0)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    min_p: float = 0.0
    seed: int = 0
    top_logprobs: int = 0
    ignore_eog: bool = True
    stop_token_ids: tuple[int, ...] = ()

    def to_proto(self) -> pb.SamplingParams:
        mode = pb.SAMPLING_MODE_STOCHASTIC if self.temperature > 0 else pb.SAMPLING_MODE_GREEDY
        return pb.SamplingParams(mode=mode, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                 min_p=self.min_p, seed=self.seed, top_logprobs=self.top_logprobs,
                                 ignore_eog=self.ignore_eog, stop_token_ids=list(self.stop_token_ids))


def channel_options(max_message_bytes: int = 64 << 20) -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_time_ms", 2000),
        ("grpc.keepalive_timeout_ms", 2000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.enable_retries", 0),
    ]


_HEALTH = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


class WorkerClient:
    """One channel to one worker."""

    def __init__(self, target: str, *, timeout: float = 10.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.target = target
        self.timeout = timeout
        opts = channel_options()
        self._channel = (grpc.secure_channel(target, credentials, options=opts) if credentials
                         else grpc.insecure_channel(target, options=opts))
        self.stub = pb_grpc.ShardRuntimeServiceStub(self._channel)
        self._cap: pb.GetCapabilityResponse | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "WorkerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn, req, timeout: float | None):
        try:
            return fn(req, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as exc:
            raise _wrap(exc) from None

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """grpc.health.v1 Check: SERVING / NOT_SERVING / UNKNOWN / SERVICE_UNKNOWN.

        Encoded by hand (two one-field messages) so no extra package is needed."""
        raw = service.encode()
        req = b"\x0a" + _varint(len(raw)) + raw if raw else b""
        check = self._channel.unary_unary("/grpc.health.v1.Health/Check",
                                          request_serializer=lambda b: b, response_deserializer=lambda b: b)
        resp = self._call(check, req, timeout)
        status = 0
        if len(resp) >= 2 and resp[0] == 0x08:
            status = resp[1]
        return _HEALTH.get(status, str(status))

    def wait_ready(self, deadline_s: float = 30.0) -> pb.GetCapabilityResponse:
        """Polls GetCapability until it answers or the deadline passes."""
        end = time.monotonic() + deadline_s
        last: Exception | None = None
        while time.monotonic() < end:
            try:
                return self.capability(refresh=True, timeout=min(2.0, max(0.1, end - time.monotonic())))
            except WorkerError as exc:
                last = exc
                time.sleep(0.05)
        raise TimeoutError(f"worker at {self.target} not ready after {deadline_s}s: {last}")

    # -- unary RPCs ----------------------------------------------------------------------
    def capability(self, *, refresh: bool = False, timeout: float | None = None) -> pb.GetCapabilityResponse:
        if self._cap is None or refresh:
            self._cap = self._call(self.stub.GetCapability, pb.GetCapabilityRequest(), timeout)
        return self._cap

    def metrics(self, timeout: float | None = None) -> pb.GetMetricsResponse:
        return self._call(self.stub.GetMetrics, pb.GetMetricsRequest(), timeout)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` whose labels include ``labels``."""
        total = 0.0
        for s in self.metrics().samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
        return total

    def load(self) -> pb.LoadSnapshot:
        return self.metrics().load

    def release(self, session_id: str, epoch: int = 0, timeout: float | None = None) -> pb.ReleaseSessionResponse:
        return self._call(self.stub.ReleaseSession,
                          pb.ReleaseSessionRequest(session_id=session_id, route_epoch=epoch), timeout)

    def cancel(self, session_id: str, epoch: int = 0, timeout: float | None = None) -> pb.CancelSessionResponse:
        return self._call(self.stub.CancelSession,
                          pb.CancelSessionRequest(session_id=session_id, route_epoch=epoch), timeout)

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
        r = self._call(self.stub.Tokenize, pb.TokenizeRequest(text=text, add_special=add_special,
                                                              parse_special=parse_special), None)
        return list(r.token_ids)

    def detokenize(self, ids: Sequence[int], *, remove_special: bool = False, unparse_special: bool = False) -> bytes:
        r = self._call(self.stub.Detokenize, pb.DetokenizeRequest(token_ids=list(ids), remove_special=remove_special,
                                                                  unparse_special=unparse_special), None)
        return r.text

    def open_session(self, session_id: str | None = None, epoch: int = 1, *,
                     sampling: Sampling | None = None, step_timeout: float | None = None,
                     stream_deadline: float | None = None) -> "SessionStream":
        """A Session stream. ``step_timeout``: seconds to wait for each answer (client side);
        ``stream_deadline``: a gRPC deadline for the whole stream (the worker sees it expire,
        cancels the stream and releases the session)."""
        return SessionStream(self, session_id or uuid.uuid4().hex, epoch, sampling=sampling,
                             step_timeout=self.timeout if step_timeout is None else step_timeout,
                             stream_deadline=stream_deadline)


class SessionStream:
    """One Route Session on one worker: a bidi ``Session`` stream with step bookkeeping.

    ``send``/``recv`` are the raw frame level (tests of malformed frames); ``prefill``,
    ``decode``, ``truncate`` and ``release`` build correct frames and track step and positions.
    Error frames raise :class:`ShardError` (``raise_errors=False`` returns them instead).
    """

    def __init__(self, client: WorkerClient, session_id: str, epoch: int, *,
                 sampling: Sampling | None, step_timeout: float, stream_deadline: float | None = None) -> None:
        self.client = client
        self.session_id = session_id
        self.epoch = epoch
        self.sampling = sampling
        self.step_timeout = step_timeout
        self.cap = client.capability()
        self.step = 0
        self.positions = 0
        self._requests: queue.Queue = queue.Queue()
        self._responses: queue.Queue = queue.Queue()
        self._closed = False
        self._ids = itertools.count()
        self._call = client.stub.Session(self._request_iter(), timeout=stream_deadline)
        self._reader = threading.Thread(target=self._read, name=f"session-{session_id[:8]}", daemon=True)
        self._reader.start()

    # -- plumbing ------------------------------------------------------------------------
    def _request_iter(self) -> Iterator[pb.SessionRequest]:
        while True:
            item = self._requests.get()
            if item is _DONE:
                return
            yield item

    def _read(self) -> None:
        try:
            for resp in self._call:
                self._responses.put(resp)
            self._responses.put(_DONE)
        except grpc.RpcError as exc:
            self._responses.put(_wrap(exc))

    def send(self, req: pb.SessionRequest) -> None:
        self._requests.put(req)

    def recv(self, timeout: float | None = None) -> pb.SessionResponse:
        """Next response; raises WorkerError when the stream ended with a status."""
        try:
            item = self._responses.get(timeout=self.step_timeout if timeout is None else timeout)
        except queue.Empty:
            raise TimeoutError(f"no response from {self.client.target} within the step deadline") from None
        if item is _DONE:
            self._responses.put(_DONE)
            raise WorkerError(grpc.StatusCode.OK, "stream ended")
        if isinstance(item, WorkerError):
            self._responses.put(item)
            raise item
        return item

    def exchange(self, req: pb.SessionRequest, *, raise_errors: bool = True,
                 timeout: float | None = None) -> pb.SessionResponse:
        self.send(req)
        resp = self.recv(timeout)
        if resp.HasField("error") and raise_errors:
            raise ShardError(resp.error, resp.header)
        return resp

    def close(self) -> None:
        """Half-closes the stream (the worker releases the session)."""
        if not self._closed:
            self._closed = True
            self._requests.put(_DONE)

    def cancel_stream(self) -> None:
        self._call.cancel()

    def __enter__(self) -> "SessionStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_closed(self, timeout: float = 10.0) -> grpc.StatusCode:
        """Waits for the stream to end; returns its status code."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                self.recv(timeout=max(0.01, end - time.monotonic()))
            except WorkerError as exc:
                return exc.code
            except TimeoutError:
                break
        raise TimeoutError("stream did not end")

    # -- frames --------------------------------------------------------------------------
    def header(self, phase: int, start: int, end: int, *, step: int | None = None,
               expect: int | None = None, payload: pb.TokenSpan | pb.TensorBundle | None = None,
               **overrides: object) -> pb.FrameHeader:
        ident = self.cap.identity
        step = self.step if step is None else step
        if expect is None:
            expect = pb.CACHE_EXPECTATION_KIND_EMPTY if step == 0 else pb.CACHE_EXPECTATION_KIND_POSITION
        h = pb.FrameHeader(
            schema_version=pb.SCHEMA_VERSION_V1, request_id=f"{self.session_id}:{next(self._ids)}",
            session_id=self.session_id, route_epoch=self.epoch,
            compatibility_fingerprint=ident.compatibility_fingerprint,
            shard_range=pb.ShardRange(start=ident.range.start, end=ident.range.end),
            phase=phase, positions=pb.PositionRange(start=start, end=end), step=step,
            cache_expectation=pb.CacheExpectation(kind=expect, position=self.positions),
            compression=pb.COMPRESSION_NONE,
            payload_checksum=bundle_mod.frame_payload_checksum(payload),
        )
        for k, v in overrides.items():
            if isinstance(v, pb.ShardRange | pb.PositionRange | pb.CacheExpectation):
                getattr(h, k).CopyFrom(v)
            else:
                setattr(h, k, v)
        return h

    def _input_frame(self, phase: int, tokens: Sequence[int] | None, rows: np.ndarray | None,
                     sample: bool) -> pb.SessionRequest:
        n = len(tokens) if tokens is not None else int(rows.shape[0])
        payload: pb.TokenSpan | pb.TensorBundle
        if tokens is not None:
            payload = pb.TokenSpan(token_ids=list(tokens))
        else:
            payload = bundle_mod.boundary_bundle(np.ascontiguousarray(rows, dtype=np.float32))
        frame = pb.StepFrame(header=self.header(phase, self.positions, self.positions + n, payload=payload),
                             sample=sample)
        if tokens is not None:
            frame.tokens.CopyFrom(payload)
        else:
            frame.bundle.CopyFrom(payload)
        if self.sampling is not None and self.step == 0:
            frame.sampling.CopyFrom(self.sampling.to_proto())
        return pb.SessionRequest(step=frame)

    def _applied(self, resp: pb.SessionResponse) -> pb.SessionResponse:
        self.step += 1
        self.positions = resp.header.cached_positions
        return resp

    def prefill_chunk(self, tokens: Sequence[int] | None = None, *, rows: np.ndarray | None = None,
                      sample: bool = True) -> pb.SessionResponse:
        return self._applied(self.exchange(self._input_frame(pb.PHASE_PREFILL, tokens, rows, sample)))

    def prefill(self, tokens: Sequence[int], *, chunk: int | None = None) -> int | None:
        """Appends a prompt in chunks of at most max_prefill_chunk_tokens; returns the token
        sampled after it (tail) or None."""
        chunk = chunk or self.cap.capacity.max_prefill_chunk_tokens or 256
        resp = None
        for i in range(0, len(tokens), chunk):
            part = tokens[i:i + chunk]
            resp = self.prefill_chunk(part, sample=i + chunk >= len(tokens))
        return sampled(resp) if resp is not None else None

    def decode_step(self, token: int, *, fast: bool = True) -> pb.SessionResponse:
        if fast and self.step > 0:
            req = pb.SessionRequest(fast_decode=pb.FastDecodeFrame(
                session_id=self.session_id, route_epoch=self.epoch, step=self.step, position=self.positions,
                token_id=token))
        else:
            req = self._input_frame(pb.PHASE_DECODE, [token], None, True)
        return self._applied(self.exchange(req))

    def decode(self, token: int, *, fast: bool = True) -> int | None:
        return sampled(self.decode_step(token, fast=fast))

    def generate(self, first: int, n: int, *, fast: bool = True) -> list[int]:
        """Feeds ``first`` and each sampled token back ``n`` times; returns the n tokens sampled."""
        out: list[int] = []
        tok = first
        for _ in range(n):
            nxt = self.decode(tok, fast=fast)
            assert nxt is not None
            out.append(nxt)
            tok = nxt
        return out

    def truncate(self, position: int) -> pb.SessionResponse:
        req = pb.SessionRequest(step=pb.StepFrame(header=self.header(pb.PHASE_TRUNCATE, position, position)))
        resp = self.exchange(req)
        self.step += 1
        self.positions = resp.header.cached_positions
        return resp

    def release(self) -> pb.SessionResponse:
        req = pb.SessionRequest(step=pb.StepFrame(header=self.header(pb.PHASE_RELEASE, self.positions,
                                                                     self.positions)))
        resp = self.exchange(req)
        self.positions = 0
        return resp


def sampled(resp: pb.SessionResponse | None) -> int | None:
    if resp is None or not resp.HasField("tail") or not resp.tail.tokens:
        return None
    return resp.tail.tokens[0].token_id


def boundary_rows(resp: pb.SessionResponse, n_embd: int) -> np.ndarray:
    """The residual rows of a non-tail shard's response."""
    n = resp.header.positions.end - resp.header.positions.start
    return bundle_mod.read_boundary(resp.boundary, n_tokens=n, n_embd=n_embd)


class AsyncWorkerClient:
    """asyncio variant (grpc.aio) of :class:`WorkerClient` for route code that drives many
    sessions from one event loop. Same frames; errors raise the same exception types."""

    def __init__(self, target: str, *, timeout: float = 10.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.target = target
        self.timeout = timeout
        opts = channel_options()
        self._channel = (grpc.aio.secure_channel(target, credentials, options=opts) if credentials
                         else grpc.aio.insecure_channel(target, options=opts))
        self.stub = pb_grpc.ShardRuntimeServiceStub(self._channel)
        self._cap: pb.GetCapabilityResponse | None = None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncWorkerClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, fn, req, timeout: float | None):
        try:
            return await fn(req, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as exc:
            raise _wrap(exc) from None

    async def capability(self, *, refresh: bool = False) -> pb.GetCapabilityResponse:
        if self._cap is None or refresh:
            self._cap = await self._call(self.stub.GetCapability, pb.GetCapabilityRequest(), None)
        return self._cap

    async def metrics(self) -> pb.GetMetricsResponse:
        return await self._call(self.stub.GetMetrics, pb.GetMetricsRequest(), None)

    async def release(self, session_id: str, epoch: int = 0) -> pb.ReleaseSessionResponse:
        return await self._call(self.stub.ReleaseSession,
                                pb.ReleaseSessionRequest(session_id=session_id, route_epoch=epoch), None)

    async def cancel(self, session_id: str, epoch: int = 0) -> pb.CancelSessionResponse:
        return await self._call(self.stub.CancelSession,
                                pb.CancelSessionRequest(session_id=session_id, route_epoch=epoch), None)

    async def tokenize(self, text: str, *, add_special: bool = False) -> list[int]:
        r = await self._call(self.stub.Tokenize, pb.TokenizeRequest(text=text, add_special=add_special), None)
        return list(r.token_ids)

    async def open_session(self, session_id: str | None = None, epoch: int = 1, *,
                           sampling: Sampling | None = None) -> "AsyncSessionStream":
        cap = await self.capability()
        return AsyncSessionStream(self, cap, session_id or uuid.uuid4().hex, epoch, sampling)


class AsyncSessionStream:
    """asyncio Session stream; frames are built exactly as :class:`SessionStream` builds them."""

    def __init__(self, client: AsyncWorkerClient, cap: pb.GetCapabilityResponse, session_id: str, epoch: int,
                 sampling: Sampling | None) -> None:
        self.client = client
        self.session_id = session_id
        self.epoch = epoch
        self.sampling = sampling
        self.cap = cap
        self.step = 0
        self.positions = 0
        self._ids = itertools.count()
        self._call = client.stub.Session()

    # frame builders shared with the sync stream
    header = SessionStream.header
    _input_frame = SessionStream._input_frame
    _applied = SessionStream._applied

    async def exchange(self, req: pb.SessionRequest, *, raise_errors: bool = True,
                       timeout: float | None = None) -> pb.SessionResponse:
        import asyncio

        try:
            await self._call.write(req)
            resp = await asyncio.wait_for(self._call.read(), self.client.timeout if timeout is None else timeout)
        except grpc.RpcError as exc:
            raise _wrap(exc) from None
        if resp is grpc.aio.EOF:
            raise WorkerError(grpc.StatusCode.OK, "stream ended")
        if resp.HasField("error") and raise_errors:
            raise ShardError(resp.error, resp.header)
        return resp

    async def prefill(self, tokens: Sequence[int]) -> int | None:
        chunk = self.cap.capacity.max_prefill_chunk_tokens or 256
        resp = None
        for i in range(0, len(tokens), chunk):
            req = self._input_frame(pb.PHASE_PREFILL, tokens[i:i + chunk], None, i + chunk >= len(tokens))
            resp = self._applied(await self.exchange(req))
        return sampled(resp)

    async def decode(self, token: int) -> int | None:
        req = pb.SessionRequest(fast_decode=pb.FastDecodeFrame(
            session_id=self.session_id, route_epoch=self.epoch, step=self.step, position=self.positions,
            token_id=token))
        return sampled(self._applied(await self.exchange(req)))

    async def generate(self, first: int, n: int) -> list[int]:
        out: list[int] = []
        tok = first
        for _ in range(n):
            tok = await self.decode(tok)  # type: ignore[assignment]
            out.append(tok)
        return out

    async def close(self) -> None:
        """Half-closes the stream (the worker releases the session)."""
        try:
            await self._call.done_writing()
        except grpc.RpcError:
            pass
