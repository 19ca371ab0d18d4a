"""Route driver: runs Route Sessions across the Shards of an Inference Route.

Two modes, the same tokens:

- **chained** (default when every Shard advertises ``Capacity.chain_forwarding`` and
  ``Capacity.server_generation`` and no hop is relayed): one ``Session`` stream per session, to
  the head only. The opening frame names the Shards after the head (``StepFrame.downstream``);
  the head forwards its boundary output along the chain itself and answers with what the tail
  answered. The last prefill chunk carries ``StepFrame.generate``: the head feeds every sampled
  token back itself and streams one response per token, so no Python sits between two tokens.
- **stepwise** (client-driven): one long-lived bidirectional ``Session`` stream per Shard.
  Prefill goes in bounded chunks: the head takes token ids, every next Shard takes the previous
  Shard's boundary bundle (forwarded as received — the driver never decodes activations), and
  the tail samples under the session's sampling contract. Decode steps then use the compact
  ``FastDecodeFrame``.

Prefill chunks are at most ``max_prefill_chunk_tokens`` of the smallest shard in both modes.
Many sessions run concurrently on one asyncio loop over shared channels; workers batch them.

A failure on any Shard ends that session with :class:`RouteSessionError` naming the Shard;
other sessions continue. In chained mode the head reports a downstream failure with a message
naming the downstream endpoint; the driver attributes it to that Shard (and, for a timeout or an
unnamed unavailability, to the first Shard that does not answer a capability probe).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

import grpc

from ..protocol.bundle import frame_payload_checksum
from ..errors import DgrError
from ..shard.v1 import shard_runtime_pb2 as pb
from ..shard.v1 import shard_runtime_pb2_grpc as pbg

from ..protocol.keepalive import keepalive_options
from ..protocol.tls import TlsFiles  # noqa: F401  (RouteDriver(tls=…))
from ..protocol.client import Sampling  # re-exported: one Sampling class for the client and the route driver
from .telemetry import GenerationTelemetry, NodeTiming

DEFAULT_TIMEOUT_S = 60.0
# generated tokens per answer from a chained head (GenerateParams.tokens_per_answer)
DEFAULT_TOKENS_PER_ANSWER = 4
RELEASE_TIMEOUT_S = 2.0
PROBE_TIMEOUT_S = 2.0      # chained mode: capability probe that finds a silent shard after a failure
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    *keepalive_options(),   # detection bounds: dgr/protocol/keepalive.py
]


class RouteError(DgrError):
    """The route cannot be used (incomplete, incompatible, unreachable)."""


class RouteSessionError(DgrError):
    """One route session failed; names the Shard and the structured reason."""

    def __init__(self, shard: "ShardHandle", reason: str, message: str, *, grpc_code: int | None = None) -> None:
        self.shard_endpoint = shard.endpoint
        self.shard_range = (shard.start, shard.end)
        self.reason = reason
        self.detail = message
        self.grpc_code = grpc_code
        super().__init__(f"shard {shard.endpoint} [{shard.start}:{shard.end}) failed: {reason}: {message}")


@dataclass
class ShardHandle:
    endpoint: str
    channel: grpc.aio.Channel
    stub: pbg.ShardRuntimeServiceStub
    capability: pb.GetCapabilityResponse

    @property
    def start(self) -> int:
        return self.capability.identity.range.start

    @property
    def end(self) -> int:
        return self.capability.identity.range.end


@dataclass
class GenerationResult:
    session_id: str
    prompt_tokens: list[int]
    tokens: list[int]
    finish_reason: str
    telemetry: GenerationTelemetry
    error: RouteSessionError | None = None
    # per sampled token when Sampling.top_logprobs > 0: [(token id, logprob), ...] most likely first
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class _Stream:
    """One Session stream to one Shard: write a request, read the response(s) of that step."""

    def __init__(self, shard: ShardHandle, timeout: float) -> None:
        self.shard = shard
        self.call = shard.stub.Session(timeout=None)
        self.timeout = timeout
        self.step = 0
        self.busy_s = 0.0           # send -> complete response, all steps
        self.decode_busy_s = 0.0    # the same, decode steps only
        self.decode_steps = 0
        self.seam_bytes_in = 0      # boundary payload bytes received by this shard (from the previous hop)
        self.frame_bytes_in = 0     # serialized request frames sent to this shard
        self.frame_bytes_out = 0    # serialized responses received from this shard
        self.decode_frame_bytes_in = 0

    async def exchange(self, req: pb.SessionRequest) -> pb.SessionResponse:
        t0 = time.perf_counter()
        resp = await self._guard(self._write_read(req))
        dt = time.perf_counter() - t0
        self.busy_s += dt
        nin, nout = req.ByteSize(), resp.ByteSize()
        self.frame_bytes_in += nin
        self.frame_bytes_out += nout
        if req.WhichOneof("frame") == "fast_decode":
            self.decode_busy_s += dt
            self.decode_steps += 1
            self.decode_frame_bytes_in += nin
        return self._checked(resp)

    async def read_generated(self) -> pb.SessionResponse:
        """The next response of a server-side generation (no request of ours answers it)."""
        t0 = time.perf_counter()
        resp = await self._guard(self._read())
        dt = time.perf_counter() - t0
        self.busy_s += dt
        self.decode_busy_s += dt
        self.decode_steps += max(1, len(resp.tail.tokens))   # one step per token (tokens_per_answer)
        self.frame_bytes_out += resp.ByteSize()
        return self._checked(resp)

    def _checked(self, resp: pb.SessionResponse) -> pb.SessionResponse:
        if resp.WhichOneof("result") == "error":
            e = resp.error
            raise RouteSessionError(self.shard, pb.ErrorReason.Name(e.reason), e.message, grpc_code=e.grpc_code)
        return resp

    async def _write_read(self, req: pb.SessionRequest) -> pb.SessionResponse:
        await self.call.write(req)
        return await self._read()

    async def _read(self) -> pb.SessionResponse:
        resp = await self.call.read()
        if resp is grpc.aio.EOF:
            code, details = await self._final_status()
            raise RouteSessionError(self.shard, code if code not in ("", "OK") else "STREAM_CLOSED",
                                    details or "the worker closed the session stream")
        if resp.WhichOneof("result") == "boundary":
            resp = await self._complete_boundary(resp)
        return resp

    async def _guard(self, aw: Awaitable[pb.SessionResponse]) -> pb.SessionResponse:
        """Bounds one answer by the step deadline and maps transport failures to RouteSessionError."""
        try:
            async with asyncio.timeout(self.timeout):
                return await aw
        except TimeoutError:
            raise RouteSessionError(self.shard, "DEADLINE_EXCEEDED", f"no answer within {self.timeout:.0f}s") from None
        except grpc.aio.AioRpcError as exc:
            raise RouteSessionError(self.shard, exc.code().name, exc.details() or "", grpc_code=exc.code().value[0]) from None
        except (grpc.aio.UsageError, asyncio.InvalidStateError) as exc:  # the call already ended
            code, details = await self._final_status()
            raise RouteSessionError(self.shard, code or "STREAM_CLOSED", details or str(exc) or "the session stream ended",
                                    grpc_code=None) from None

    async def _final_status(self) -> tuple[str, str]:
        """The status the stream ended with (e.g. UNAVAILABLE when the worker died)."""
        try:
            code = await asyncio.wait_for(self.call.code(), 1.0)
            details = await asyncio.wait_for(self.call.details(), 1.0)
            return code.name, details or ""
        except Exception:
            return "", ""

    async def _complete_boundary(self, resp: pb.SessionResponse) -> pb.SessionResponse:
        """A boundary bundle may be spread over several responses with the same header."""
        def missing(b: pb.TensorBundle) -> bool:
            have: dict[str, int] = {}
            for t in b.tensors:
                have[t.name] = have.get(t.name, 0) + len(t.fragments)
            return any(have[t.name] < t.fragment_count for t in b.tensors)

        while missing(resp.boundary):
            more = await self.call.read()
            if more is grpc.aio.EOF or more.WhichOneof("result") != "boundary":
                raise RouteSessionError(self.shard, "BAD_BUNDLE", "boundary bundle ended before all fragments arrived")
            for t in more.boundary.tensors:
                dst = next((d for d in resp.boundary.tensors if d.name == t.name), None)
                if dst is None:
                    resp.boundary.tensors.append(t)
                else:
                    dst.fragments.extend(t.fragments)
        return resp

    async def close(self) -> None:
        try:
            await self.call.done_writing()
        except Exception:
            pass
        self.call.cancel()


def exc_shard(driver: "RouteDriver", exc: RouteSessionError) -> ShardHandle:
    return next(s for s in driver.shards if s.endpoint == exc.shard_endpoint)


def _bundle_bytes(b: pb.TensorBundle) -> int:
    return sum(len(f.data) for t in b.tensors for f in t.fragments)


class _Gen:
    """What one generation collected so far (shared by both modes)."""

    def __init__(self, max_tokens: int, stop_on_eog: bool, top_logprobs: bool,
                 on_token: Callable[[int], Awaitable[None] | None] | None) -> None:
        self.max_tokens = max_tokens
        self.stop_on_eog = stop_on_eog
        self.want_top = top_logprobs
        self.on_token = on_token
        self.out: list[int] = []
        self.top: list[list[tuple[int, float]]] = []
        self.forced: list[int] | None = None   # teacher forcing (stepwise): the tokens fed back
        self.finish = "length"

    async def emit(self, tok: pb.SampledToken) -> bool:
        """Records one sampled token; True when the generation is complete."""
        self.out.append(tok.token_id)
        if self.want_top:
            self.top.append([(t.token_id, t.logprob) for t in tok.top_logprobs])
        if self.on_token is not None:
            r = self.on_token(tok.token_id)
            if asyncio.iscoroutine(r):
                await r
        if self.stop_on_eog and tok.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish = pb.FinishReason.Name(tok.finish_reason).removeprefix("FINISH_REASON_").lower()
            return True
        return len(self.out) >= self.max_tokens


class RouteDriver:
    """Drives sessions over an ordered list of worker endpoints covering [0, n_layer).

    ``chain``: None (default) uses the chained mode when every shard supports it and no hop
    is relayed, else stepwise; False always stepwise; True requires the chained mode
    (:class:`RouteError` when a shard lacks it).

    ``tokens_per_answer`` (chained mode): the head may send up to this many generated tokens in
    one answer while they come less than 50 ms apart, none held longer than 50 ms
    (``GenerateParams.tokens_per_answer``); the first token and the last always come at once. Fewer answers cost this process less CPU,
    which on a host shared with the shards is compute time. 1: one answer per token."""

    def __init__(self, endpoints: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT_S,
                 chain: bool | None = None, tokens_per_answer: int = DEFAULT_TOKENS_PER_ANSWER,
                 tls: "TlsFiles | None" = None) -> None:
        if not endpoints:
            raise RouteError("a route needs at least one shard endpoint")
        if tokens_per_answer < 1:
            raise RouteError(f"tokens_per_answer must be >= 1, got {tokens_per_answer}")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.chain = chain
        self.tokens_per_answer = tokens_per_answer
        self.tls = tls    # mutual TLS to every shard (and over relayed hops) when set
        self.shards: list[ShardHandle] = []
        self._ids = itertools.count(1)
        self._active: dict[str, int] = {}   # session id -> epoch of sessions in flight
        self._cancelled: set[str] = set()   # sessions cancelled through this driver
        self._releasing: set[asyncio.Future] = set()   # background releases of failed sessions

    async def connect(self, *, validate: bool = True) -> "RouteDriver":
        """Opens channels and reads every shard's capability; ``validate`` checks that the
        shards form a complete compatible route (off: e.g. tokenizing on a head alone)."""
        from ..protocol.relay import RelayChannel, RelayStub, is_relay_endpoint

        for ep in self.endpoints:
            if is_relay_endpoint(ep):  # a hop through a byte relay (same frames, opaque bytes)
                ch, stub = RelayChannel(), RelayStub(ep, ssl=self.tls.client_context() if self.tls else None)
            else:
                ch = (grpc.aio.secure_channel(ep, self.tls.grpc_credentials(), options=CHANNEL_OPTIONS) if self.tls
                      else grpc.aio.insecure_channel(ep, options=CHANNEL_OPTIONS))
                stub = pbg.ShardRuntimeServiceStub(ch)
            try:
                cap = await stub.GetCapability(pb.GetCapabilityRequest(), timeout=self.timeout)
            except grpc.aio.AioRpcError as exc:
                await ch.close()
                raise RouteError(f"shard {ep} is unreachable: {exc.code().name}: {exc.details()}") from None
            self.shards.append(ShardHandle(ep, ch, stub, cap))
        if validate:
            self._validate()
            if self.chain and not self.chain_supported:
                raise RouteError(f"chained mode requested but not available: {self.chain_unsupported_reason}")
        return self

    def _validate(self) -> None:
        ids = [s.capability.identity for s in self.shards]
        fps = {i.compatibility_fingerprint for i in ids}
        if len(fps) != 1:
            raise RouteError("shards disagree on the compatibility fingerprint: "
                             + ", ".join(f"{s.endpoint}={s.capability.identity.compatibility_fingerprint[:12]}" for s in self.shards))
        if len({i.artifact_id for i in ids}) != 1:
            raise RouteError("shards serve different artifacts")
        n_layer = ids[0].n_layer
        pos = 0
        for s in self.shards:
            if s.start != pos:
                raise RouteError(f"route is not contiguous: {s.endpoint} serves [{s.start}:{s.end}), expected start {pos}")
            pos = s.end
        if pos != n_layer:
            raise RouteError(f"route ends at layer {pos}, the model has {n_layer}")
        if not ids[0].head or not ids[-1].tail:
            raise RouteError("the first shard must be the head and the last the tail")

    @property
    def chain_unsupported_reason(self) -> str | None:
        """Why the chained mode cannot be used on this route (None: it can)."""
        from ..protocol.relay import is_relay_endpoint

        if not self.shards:
            return "not connected"
        for s in self.shards:
            if is_relay_endpoint(s.endpoint):
                return f"{s.endpoint} is a relayed hop (the head cannot dial it)"
            c = s.capability.capacity
            if not (c.chain_forwarding and c.server_generation):
                return f"shard {s.endpoint} does not advertise chain_forwarding and server_generation"
        return None

    @property
    def chain_supported(self) -> bool:
        return self.chain_unsupported_reason is None

    @property
    def chained(self) -> bool:
        """Whether sessions run in the chained mode (head forwards, worker-side generation)."""
        if self.chain is False:
            return False
        return self.chain_supported

    @property
    def mode(self) -> str:
        return "chained" if self.chained else "stepwise"

    @property
    def fingerprint(self) -> str:
        return self.shards[0].capability.identity.compatibility_fingerprint

    @property
    def chunk_tokens(self) -> int:
        return max(1, min(s.capability.capacity.max_prefill_chunk_tokens or 512 for s in self.shards))

    @property
    def head(self) -> ShardHandle:
        return self.shards[0]

    async def close(self) -> None:
        if self._releasing:
            await asyncio.wait(list(self._releasing), timeout=RELEASE_TIMEOUT_S + 1)
        for s in self.shards:
            await s.channel.close()

    async def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        r = await self.head.stub.Tokenize(pb.TokenizeRequest(text=text, add_special=add_special,
                                                             parse_special=parse_special), timeout=self.timeout)
        return list(r.token_ids)

    async def detokenize(self, ids: Sequence[int]) -> bytes:
        r = await self.head.stub.Detokenize(pb.DetokenizeRequest(token_ids=list(ids)), timeout=self.timeout)
        return r.text

    def _header(self, shard: ShardHandle, sid: str, epoch: int, step: int, phase: int, start: int, end: int,
                expect: pb.CacheExpectation, request_id: str) -> pb.FrameHeader:
        return pb.FrameHeader(
            schema_version=pb.SCHEMA_VERSION_V1, request_id=request_id, session_id=sid, route_epoch=epoch,
            compatibility_fingerprint=self.fingerprint,
            shard_range=pb.ShardRange(start=shard.start, end=shard.end), effective_start=shard.start,
            phase=phase, positions=pb.PositionRange(start=start, end=end), step=step,
            cache_expectation=expect, compression=pb.COMPRESSION_NONE)

    def chain_hops(self) -> list[pb.ChainHop]:
        """The ``StepFrame.downstream`` of a chained session's opening frame."""
        return [pb.ChainHop(endpoint=s.endpoint, range=pb.ShardRange(start=s.start, end=s.end),
                            compatibility_fingerprint=s.capability.identity.compatibility_fingerprint)
                for s in self.shards[1:]]

    async def generate(self, prompt_tokens: Sequence[int], *, max_tokens: int = 32,
                       sampling: Sampling = Sampling(), session_id: str | None = None, epoch: int = 1,
                       on_token: Callable[[int], Awaitable[None] | None] | None = None,
                       stop_on_eog: bool = True, forced_tokens: Sequence[int] | None = None) -> GenerationResult:
        """One Route Session. ``forced_tokens`` (stepwise mode only): teacher forcing, the
        decode step after output k feeds ``forced_tokens[k]`` instead of the sampled token, so
        every output (and its top logprobs) is the route's prediction on that fixed context;
        used to measure numeric drift between routes on the same token sequence."""
        sid = session_id or f"s-{uuid.uuid4().hex[:12]}"
        tel = GenerationTelemetry(request_id=f"r-{uuid.uuid4().hex[:12]}", session_id=sid, route_epoch=epoch,
                                  route=[f"{s.endpoint}[{s.start}:{s.end})" for s in self.shards],
                                  prompt_tokens=len(prompt_tokens))
        if self.chain and not self.chain_supported:
            raise RouteError(f"chained mode requested but not available: {self.chain_unsupported_reason}")
        chained = self.chained
        if forced_tokens is not None and chained:
            raise RouteError("forced tokens need the stepwise mode (RouteDriver(chain=False))")
        streams = [_Stream(self.head, self.timeout)] if chained else [_Stream(s, self.timeout) for s in self.shards]
        self._active[sid] = epoch
        g = _Gen(max_tokens, stop_on_eog, bool(sampling.top_logprobs), on_token)
        g.forced = list(forced_tokens) if forced_tokens is not None else None
        t0 = time.perf_counter()
        try:
            if not prompt_tokens:
                raise RouteError("the prompt is empty")
            if chained:
                await self._run_chained(streams[0], prompt_tokens, sampling, sid, epoch, tel, g, t0)
            else:
                await self._run_stepwise(streams, prompt_tokens, sampling, sid, epoch, tel, g, t0)
            tel.status = "completed"
            return GenerationResult(sid, list(prompt_tokens), g.out, g.finish, tel, top_logprobs=g.top)
        except RouteSessionError as exc:
            if sid in self._cancelled and exc.reason not in ("CANCELLED", "ERROR_REASON_CANCELLED"):
                # the stream may end before the CANCELLED frame is read (write on a closed call)
                exc = RouteSessionError(exc_shard(self, exc), "ERROR_REASON_CANCELLED",
                                        f"cancelled by the driver ({exc.reason})", grpc_code=1)
            elif chained and sid not in self._cancelled:
                exc = await self._attribute(exc)
            tel.status = "cancelled" if exc.reason in ("CANCELLED", "ERROR_REASON_CANCELLED") else "failed"
            tel.error = str(exc)
            return GenerationResult(sid, list(prompt_tokens), g.out, "error", tel, error=exc, top_logprobs=g.top)
        except asyncio.CancelledError:
            tel.status = "cancelled"
            raise
        finally:
            tel.completion_tokens = len(g.out)
            tel.total_s = time.perf_counter() - t0
            tel.nodes = [NodeTiming(f"{st.shard.endpoint}[{st.shard.start}:{st.shard.end})", st.busy_s,
                                    st.step, st.seam_bytes_in, decode_busy_s=st.decode_busy_s,
                                    decode_steps=st.decode_steps, frame_bytes_in=st.frame_bytes_in,
                                    frame_bytes_out=st.frame_bytes_out,
                                    decode_frame_bytes_in=st.decode_frame_bytes_in) for st in streams]
            if chained:
                # the other shards ran the same steps, driven by the head (the driver never waited on them)
                h = streams[0]
                tel.nodes += [NodeTiming(f"{s.endpoint}[{s.start}:{s.end})", 0.0, h.step,
                                         decode_steps=h.decode_steps) for s in self.shards[1:]]
            self._active.pop(sid, None)
            self._cancelled.discard(sid)
            # bounded: a hung shard must not hold the caller (its session TTL frees it later). In
            # chained mode the head closes its downstream streams; releasing them too is harmless.
            extra = [self._release_shard(s, sid, epoch) for s in self.shards[1:]] if chained else []
            release = asyncio.wait_for(asyncio.gather(*(self._release(st, sid, epoch) for st in streams), *extra,
                                                      return_exceptions=True), RELEASE_TIMEOUT_S)
            if tel.status == "failed":
                # a failed shard may be silent: release in the background so that the caller
                # (failover, dgr/route/failover.py) moves on at once; close() waits for it
                t = asyncio.ensure_future(release)
                self._releasing.add(t)
                t.add_done_callback(lambda f: (self._releasing.discard(f), f.cancelled() or f.exception()))
            else:
                try:
                    await release
                except asyncio.TimeoutError:
                    pass

    async def _run_stepwise(self, streams: list[_Stream], prompt_tokens: Sequence[int], sampling: Sampling,
                            sid: str, epoch: int, tel: GenerationTelemetry, g: _Gen, t0: float) -> None:
        n = len(prompt_tokens)
        chunk = self.chunk_tokens
        samp = sampling.to_proto()
        for ci, a in enumerate(range(0, n, chunk)):
            b = min(n, a + chunk)
            expect = pb.CacheExpectation(kind=pb.CACHE_EXPECTATION_KIND_EMPTY) if a == 0 else \
                pb.CacheExpectation(kind=pb.CACHE_EXPECTATION_KIND_POSITION, position=a)
            last = b == n
            payload: pb.TokenSpan | pb.TensorBundle = pb.TokenSpan(token_ids=list(prompt_tokens[a:b]))
            resp = None
            step_id = f"{tel.request_id}/p{ci}"   # work id of this route step, same on every seam
            for i, st in enumerate(streams):
                h = self._header(st.shard, sid, epoch, st.step, pb.PHASE_PREFILL, a, b, expect, step_id)
                h.payload_checksum.CopyFrom(frame_payload_checksum(payload))
                frame = pb.StepFrame(header=h, sample=last)
                if isinstance(payload, pb.TokenSpan):
                    frame.tokens.CopyFrom(payload)
                else:
                    frame.bundle.CopyFrom(payload)
                    st.seam_bytes_in += _bundle_bytes(payload)
                if i == len(streams) - 1 and ci == 0:
                    frame.sampling.CopyFrom(samp)
                resp = await st.exchange(pb.SessionRequest(step=frame))
                st.step += 1
                if i < len(streams) - 1:
                    payload = resp.boundary
            tok_out = resp.tail.tokens if resp is not None else []
        tel.ttft_s = time.perf_counter() - t0
        tel.prefill_s = tel.ttft_s
        if not tok_out:
            raise RouteSessionError(self.shards[-1], "BAD_RESPONSE", "the tail returned no token after prefill")
        pos = n
        t_dec = time.perf_counter()
        try:
            while True:
                if await g.emit(tok_out[0]):
                    break
                k = pos - n
                fast_payload: int | pb.TensorBundle = (
                    g.forced[k] if g.forced is not None and k < len(g.forced) else tok_out[0].token_id)
                step_id = f"{tel.request_id}/d{pos}"
                for i, st in enumerate(streams):
                    fd = pb.FastDecodeFrame(session_id=sid, route_epoch=epoch, step=st.step, position=pos,
                                            request_id=step_id)
                    if isinstance(fast_payload, int):
                        fd.token_id = fast_payload
                    else:
                        fd.bundle.CopyFrom(fast_payload)
                        st.seam_bytes_in += _bundle_bytes(fast_payload)
                    resp = await st.exchange(pb.SessionRequest(fast_decode=fd))
                    st.step += 1
                    if i < len(streams) - 1:
                        fast_payload = resp.boundary
                tok_out = resp.tail.tokens
                if not tok_out:
                    raise RouteSessionError(self.shards[-1], "BAD_RESPONSE", "the tail returned no token")
                pos += 1
        finally:
            tel.decode_s = time.perf_counter() - t_dec

    async def _run_chained(self, st: _Stream, prompt_tokens: Sequence[int], sampling: Sampling,
                           sid: str, epoch: int, tel: GenerationTelemetry, g: _Gen, t0: float) -> None:
        """One stream to the head: prefill chunks (the opening one names the chain), the last
        one asks the head to generate; then read one response per token."""
        n = len(prompt_tokens)
        chunk = self.chunk_tokens     # the head forwards each chunk as is: it must fit every shard
        resp: pb.SessionResponse | None = None
        for ci, a in enumerate(range(0, n, chunk)):
            b = min(n, a + chunk)
            expect = pb.CacheExpectation(kind=pb.CACHE_EXPECTATION_KIND_EMPTY) if a == 0 else \
                pb.CacheExpectation(kind=pb.CACHE_EXPECTATION_KIND_POSITION, position=a)
            last = b == n
            payload = pb.TokenSpan(token_ids=list(prompt_tokens[a:b]))
            h = self._header(st.shard, sid, epoch, st.step, pb.PHASE_PREFILL, a, b, expect, f"{tel.request_id}/p{ci}")
            h.payload_checksum.CopyFrom(frame_payload_checksum(payload))
            frame = pb.StepFrame(header=h, tokens=payload, sample=last)
            if ci == 0:
                frame.downstream.extend(self.chain_hops())
                frame.sampling.CopyFrom(sampling.to_proto())   # the head passes it on to the tail
            if last:
                frame.generate.CopyFrom(pb.GenerateParams(max_tokens=max(1, g.max_tokens),
                                                          continue_after_finish=not g.stop_on_eog,
                                                          tokens_per_answer=self.tokens_per_answer))
            resp = await st.exchange(pb.SessionRequest(step=frame))
            self._check_chained(resp, st.step, pb.PHASE_PREFILL, a)
            st.step += 1
        assert resp is not None
        tel.ttft_s = time.perf_counter() - t0
        tel.prefill_s = tel.ttft_s
        tok_out = resp.tail.tokens
        if not tok_out:
            raise RouteSessionError(self.shards[-1], "BAD_RESPONSE", "the tail returned no token after prefill")
        pos = n
        t_dec = time.perf_counter()
        try:
            # an answer holds one token, or several in order (tokens_per_answer), one step each
            pending = list(tok_out[:1])
            while not await self._emit_all(g, pending):
                resp = await st.read_generated()
                pending = list(resp.tail.tokens)
                self._check_chained(resp, st.step + max(0, len(pending) - 1), pb.PHASE_DECODE, pos)
                if not pending:
                    raise RouteSessionError(self.shards[-1], "BAD_RESPONSE", "the tail returned no token")
                if resp.header.positions.end != pos + len(pending):
                    raise RouteSessionError(
                        self.head, "BAD_RESPONSE",
                        f"chained head answered {len(pending)} token(s) for positions "
                        f"[{resp.header.positions.start}:{resp.header.positions.end})")
                st.step += len(pending)
                pos += len(pending)
        finally:
            tel.decode_s = time.perf_counter() - t_dec

    @staticmethod
    async def _emit_all(g: _Gen, tokens: Sequence[pb.SampledToken]) -> bool:
        """Emits tokens in order; True once the generation is done (the rest is not emitted)."""
        for t in tokens:
            if await g.emit(t):
                return True
        return False

    def _check_chained(self, resp: pb.SessionResponse, step: int, phase: int, start: int) -> None:
        """A chained head answers each step with the tail's output, in order."""
        h = resp.header
        kind = resp.WhichOneof("result")
        if kind != "tail" or h.step != step or h.phase != phase or h.positions.start != start:
            raise RouteSessionError(
                self.head, "BAD_RESPONSE",
                f"chained head answered {kind or 'no result'} for step {h.step} ({pb.Phase.Name(h.phase)}, "
                f"positions [{h.positions.start}:{h.positions.end})); expected a tail output for step {step} "
                f"({pb.Phase.Name(phase)}) at position {start}")

    def _named_shard(self, message: str) -> ShardHandle | None:
        """The downstream shard an error message names (the farthest along the route)."""
        named = None
        for s in self.shards[1:]:
            if re.search(re.escape(s.endpoint) + r"(?![0-9])", message):
                named = s
        return named

    async def _silent_shard(self) -> ShardHandle | None:
        """The first shard (route order) that does not answer a capability probe."""
        async def alive(s: ShardHandle) -> bool:
            try:
                await s.stub.GetCapability(pb.GetCapabilityRequest(), timeout=min(PROBE_TIMEOUT_S, self.timeout))
                return True
            except Exception:
                return False
        res = await asyncio.gather(*(alive(s) for s in self.shards))
        return next((s for s, ok in zip(self.shards, res) if not ok), None)

    async def _attribute(self, exc: RouteSessionError) -> RouteSessionError:
        """Chained mode: a failure reported by (or seen on) the head stream, attributed to the
        shard it came from."""
        if len(self.shards) == 1 or exc.shard_endpoint != self.head.endpoint:
            return exc
        shard = self._named_shard(exc.detail)
        if shard is None and ("ping timeout" in exc.detail or "keepalive" in exc.detail):
            return exc      # the driver's own connection to the head went silent: the head it is
        if shard is None and exc.reason.removeprefix("ERROR_REASON_") in (
                "UNAVAILABLE", "DEADLINE_EXCEEDED", "STREAM_CLOSED", "INTERNAL", "UNKNOWN"):
            shard = await self._silent_shard()
        if shard is None or shard is self.head:
            return exc
        return RouteSessionError(shard, exc.reason, exc.detail, grpc_code=exc.grpc_code)

    @property
    def active_sessions(self) -> dict[str, int]:
        return dict(self._active)

    async def cancel(self, session_id: str, epoch: int = 0) -> list[bool]:
        """Cancels a session on every Shard of the route (CancelSession, idempotent). The
        session's :meth:`generate` then returns with status ``cancelled``. Returns, per shard,
        whether it held anything. The head goes first (in chained mode it stops the generation
        and its downstream streams itself)."""
        async def one(s: ShardHandle) -> bool:
            try:
                r = await s.stub.CancelSession(pb.CancelSessionRequest(session_id=session_id, route_epoch=epoch),
                                               timeout=5)
                return r.cancelled
            except grpc.aio.AioRpcError:
                return False
        self._cancelled.add(session_id)
        first = await one(self.head)
        return [first, *await asyncio.gather(*(one(s) for s in self.shards[1:]))]

    async def _release(self, st: _Stream, sid: str, epoch: int) -> None:
        await st.close()
        await self._release_shard(st.shard, sid, epoch)

    async def _release_shard(self, shard: ShardHandle, sid: str, epoch: int) -> None:
        try:
            await shard.stub.ReleaseSession(pb.ReleaseSessionRequest(session_id=sid, route_epoch=epoch),
                                            timeout=RELEASE_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            pass
