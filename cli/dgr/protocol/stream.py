"""The one implementation of a ``Session`` stream to one dgr-worker (asyncio).

:class:`AsyncSessionStream` builds the frames of one Route Session on one Shard, tracks its step
and positions, reads answers under a step deadline (reassembling boundary bundles that arrive
in several fragments), maps every failure to the exception types of :mod:`dgr.protocol.errors`
and counts time and bytes per stream (route telemetry). Everything that talks to a worker's
Session stream goes through it: the asyncio client (:class:`~dgr.protocol.client.AsyncWorkerClient`),
the sync client (:class:`~dgr.protocol.client.SessionStream` runs it on the client's event-loop
thread) and the route driver (one stream per Shard, or one to a chained route's head).

The transport is a ``grpc.aio`` stream-stream call, or anything with its surface
(``write``/``read``/``done_writing``/``cancel``): a relayed hop's
:class:`~dgr.protocol.relay.RelaySessionCall`.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from . import bundle as bundle_mod
from .limits import capacity_limit
from .errors import BadResponse, ShardError, StepTimeout, StreamClosed, WorkerError, wrap_rpc_error
from ..shard.v1 import shard_runtime_pb2 as pb

T = TypeVar("T")
FINAL_STATUS_TIMEOUT_S = 1.0   # reading the final status of a stream that ended


@dataclass(frozen=True)
class Sampling:
    """The tail's sampling contract: greedy unless ``temperature`` > 0.

    ``ignore_eog`` is False by default: generation stops at end-of-generation (and at
    ``stop_token_ids``). Pass ``ignore_eog=True`` to generate through them. In greedy mode the
    stochastic fields (temperature, top_k, top_p, min_p, seed) are not sent; ``logit_bias``, the
    penalties and the grammar apply in both modes.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    min_p: float = 0.0
    seed: int = 0
    top_logprobs: int = 0
    ignore_eog: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # (token id, bias) pairs added to the logits the token is chosen from, greedy or not
    logit_bias: tuple[tuple[int, float], ...] = ()
    # penalties on the last ``penalty_last_n`` tokens (llama.cpp's penalties sampler), greedy or
    # not: ``penalty_prompt`` holds the prompt's last tokens, which the tail never sees
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 0
    penalty_prompt: tuple[int, ...] = ()
    # constrained sampling: a GBNF grammar (root rule "root") or a JSON schema (JSON text)
    grammar: str = ""
    json_schema: str = ""

    def penalized(self) -> bool:
        return self.penalty_last_n > 0 and (self.repeat_penalty != 1 or self.frequency_penalty != 0
                                            or self.presence_penalty != 0)

    def to_proto(self) -> pb.SamplingParams:
        common = dict(top_logprobs=self.top_logprobs, ignore_eog=self.ignore_eog,
                      stop_token_ids=list(self.stop_token_ids),
                      logit_bias=[pb.TokenBias(token_id=t, bias=b) for t, b in self.logit_bias],
                      grammar=self.grammar, json_schema=self.json_schema)
        if self.penalized():
            common.update(repeat_penalty=self.repeat_penalty, frequency_penalty=self.frequency_penalty,
                          presence_penalty=self.presence_penalty, penalty_last_n=self.penalty_last_n,
                          penalty_prompt_tokens=list(self.penalty_prompt[-self.penalty_last_n:]))
        if self.temperature <= 0:
            return pb.SamplingParams(mode=pb.SAMPLING_MODE_GREEDY, **common)
        return pb.SamplingParams(mode=pb.SAMPLING_MODE_STOCHASTIC, temperature=self.temperature, top_k=self.top_k,
                                 top_p=self.top_p, min_p=self.min_p, seed=self.seed, **common)


def sampled(resp: pb.SessionResponse | None) -> int | None:
    """The first token a tail answer carries (None: no tail output)."""
    if resp is None or not resp.HasField("tail") or not resp.tail.tokens:
        return None
    return resp.tail.tokens[0].token_id


def boundary_rows(resp: pb.SessionResponse, n_embd: int) -> np.ndarray:
    """The residual rows of a non-tail shard's response."""
    n = resp.header.positions.end - resp.header.positions.start
    return bundle_mod.read_boundary(resp.boundary, n_tokens=n, n_embd=n_embd)


def _incomplete(b: pb.TensorBundle) -> bool:
    have: dict[str, int] = {}
    for t in b.tensors:
        have[t.name] = have.get(t.name, 0) + len(t.fragments)
    return any(have[t.name] < t.fragment_count for t in b.tensors)


class AsyncSessionStream:
    """One Route Session on one worker over one bidirectional ``Session`` stream.

    Raw level: :meth:`send`, :meth:`recv`, :meth:`exchange` (tests of malformed frames use it).
    Frames: :meth:`header`, :meth:`input_frame`, :meth:`fast_decode`, :meth:`generate_frame`.
    Steps: :meth:`prefill`, :meth:`decode`, :meth:`generate`, server-side generation
    (:meth:`prefill_generate`, :meth:`decode_generate`, :meth:`next_generated`),
    :meth:`truncate`, :meth:`release`. Error frames raise :class:`ShardError`
    (``exchange(raise_errors=False)`` returns them).

    ``step`` and ``positions`` follow the session; the step helpers advance them, the raw level
    leaves them to the caller. Counters (``busy_s``, ``frame_bytes_in`` …) add up every
    :meth:`exchange` and :meth:`next_generated`.
    """

    def __init__(self, call: Any, cap: pb.GetCapabilityResponse, session_id: str, epoch: int, *,
                 target: str, step_timeout: float, sampling: Sampling | None = None,
                 downstream: Sequence[pb.ChainHop] = (), effective_start: int = 0) -> None:
        self.call = call
        self.cap = cap
        self.target = target
        self.session_id = session_id
        self.epoch = epoch
        self.sampling = sampling
        self.downstream = list(downstream)
        self.step_timeout = step_timeout
        self.effective_start = effective_start
        self.step = 0
        self.positions = 0
        self._ids = itertools.count()
        self._unread: pb.SessionResponse | None = None   # an answer read after a failed write
        self.busy_s = 0.0           # send -> complete answer, every exchange and generated answer
        self.decode_busy_s = 0.0    # the same, decode steps only
        self.decode_steps = 0
        self.seam_bytes_in = 0      # boundary payload bytes sent to this shard (the route driver counts them)
        self.frame_bytes_in = 0     # serialized request frames sent
        self.frame_bytes_out = 0    # serialized answers received
        self.decode_frame_bytes_in = 0

    # -- transport -----------------------------------------------------------------------
    async def _bounded(self, aw: Awaitable[T], timeout: float | None) -> T:
        """Bounds one answer by the step deadline (``timeout``; None: ``step_timeout``; math.inf:
        none) and maps transport failures to the types of errors.py. A deadline that passes
        cancels the read, and with it the stream."""
        t = self.step_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(None if t == math.inf else t):
                return await aw
        except TimeoutError:
            raise StepTimeout(self.target, t) from None
        except grpc.RpcError as exc:
            raise wrap_rpc_error(exc) from None
        except (grpc.aio.UsageError, asyncio.InvalidStateError) as exc:   # the call already ended
            raise await self._closed(str(exc) or "the session stream ended") from None

    async def _closed(self, fallback: str) -> StreamClosed:
        """The stream's final status (e.g. UNAVAILABLE when the worker died), as StreamClosed."""
        try:
            code = await asyncio.wait_for(self.call.code(), FINAL_STATUS_TIMEOUT_S)
            details = await asyncio.wait_for(self.call.details(), FINAL_STATUS_TIMEOUT_S)
            return StreamClosed(code, details or fallback)
        except Exception:  # noqa: BLE001  (no status to read: a relayed call, a call cancelled here)
            return StreamClosed(None, fallback)

    async def _read(self) -> pb.SessionResponse:
        if self._unread is not None:
            resp, self._unread = self._unread, None
            return resp
        resp = await self.call.read()
        if resp is grpc.aio.EOF:
            raise await self._closed("the worker closed the session stream")
        if resp.WhichOneof("result") == "boundary" and _incomplete(resp.boundary):
            resp = await self._complete_boundary(resp)
        return resp

    async def _write(self, req: pb.SessionRequest) -> None:
        try:
            await self.call.write(req)
        except (grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            self._unread = await self._answer_before_end()
            if self._unread is None:
                raise

    async def _answer_before_end(self) -> pb.SessionResponse | None:
        """After a write failed because the worker had ended the stream: the answer it sent
        before (an error frame saying why: cancelled, released, draining), when one is still
        unread. grpc.aio's public ``read()`` refuses once a write failed, so this reads through
        its ``_read()`` (the message read without the done check; grpc.aio's StreamStreamCall
        has it since grpc 1.32); a call without it (a relayed hop) has no such answer."""
        read = getattr(self.call, "_read", None)
        if read is None:
            return None
        try:
            async with asyncio.timeout(FINAL_STATUS_TIMEOUT_S):
                resp = await read()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():   # our caller is being cancelled: let it
                raise
            return None                                   # the call itself was cancelled
        except Exception:  # noqa: BLE001  (nothing buffered: the write's own error stands)
            return None
        return None if resp is grpc.aio.EOF else resp

    async def _write_read(self, req: pb.SessionRequest) -> pb.SessionResponse:
        await self._write(req)
        return await self._read()

    async def _complete_boundary(self, resp: pb.SessionResponse) -> pb.SessionResponse:
        """A boundary bundle may be spread over several responses with the same header."""
        while _incomplete(resp.boundary):
            more = await self.call.read()
            if more is grpc.aio.EOF or more.WhichOneof("result") != "boundary":
                raise BadResponse("BAD_BUNDLE", "boundary bundle ended before all fragments arrived")
            for t in more.boundary.tensors:
                dst = next((d for d in resp.boundary.tensors if d.name == t.name), None)
                if dst is None:
                    resp.boundary.tensors.append(t)
                else:
                    dst.fragments.extend(t.fragments)
        return resp

    async def send(self, req: pb.SessionRequest) -> None:
        """Writes one frame (no answer read)."""
        await self._bounded(self._write(req), None)

    async def recv(self, timeout: float | None = None) -> pb.SessionResponse:
        """The next answer (error frames included); raises when the stream ended or the step
        deadline (``timeout``, default ``step_timeout``) passed."""
        return await self._bounded(self._read(), timeout)

    async def exchange(self, req: pb.SessionRequest, *, raise_errors: bool = True,
                       timeout: float | None = None) -> pb.SessionResponse:
        """Writes one frame and reads its answer."""
        t0 = time.perf_counter()
        resp = await self._bounded(self._write_read(req), timeout)
        dt = time.perf_counter() - t0
        self.busy_s += dt
        nin = req.ByteSize()
        self.frame_bytes_in += nin
        self.frame_bytes_out += resp.ByteSize()
        if req.WhichOneof("frame") == "fast_decode":
            self.decode_busy_s += dt
            self.decode_steps += 1
            self.decode_frame_bytes_in += nin
        if raise_errors and resp.WhichOneof("result") == "error":
            raise ShardError(resp.error, resp.header)
        return resp

    async def next_generated(self, timeout: float | None = None) -> pb.SessionResponse:
        """The next answer of a server-side generation (no request of ours answers it); one
        decode step per token it carries (``tokens_per_answer``)."""
        t0 = time.perf_counter()
        resp = await self._bounded(self._read(), timeout)
        dt = time.perf_counter() - t0
        self.busy_s += dt
        self.decode_busy_s += dt
        self.decode_steps += max(1, len(resp.tail.tokens))
        self.frame_bytes_out += resp.ByteSize()
        if resp.WhichOneof("result") == "error":
            raise ShardError(resp.error, resp.header)
        return resp

    async def close(self) -> None:
        """Half-closes the stream (the worker releases the session)."""
        try:
            await self.call.done_writing()
        except Exception:  # noqa: BLE001  (already ended: nothing to close)
            pass

    def cancel(self) -> None:
        """Cancels the stream (the worker sees CANCELLED and frees the session)."""
        self.call.cancel()

    async def wait_closed(self, timeout: float = 10.0) -> grpc.StatusCode:
        """Waits for the stream to end (answers still coming are dropped); its status code."""
        end = time.monotonic() + timeout
        while True:
            try:
                await self.recv(timeout=max(0.01, end - time.monotonic()))
            except StepTimeout:
                raise TimeoutError("stream did not end") from None
            except WorkerError as exc:
                return exc.code

    # -- frames --------------------------------------------------------------------------
    def header(self, phase: int, start: int, end: int, *, step: int | None = None,
               expect: int | None = None, cached: int | None = None,
               payload: pb.TokenSpan | pb.TensorBundle | None = None, request_id: str | None = None,
               **overrides: object) -> pb.FrameHeader:
        """A frame header for this session; ``cached``: the positions the worker should hold
        (default :attr:`positions`); ``overrides``: header fields to replace (malformed-frame tests)."""
        ident = self.cap.identity
        step = self.step if step is None else step
        if expect is None:
            expect = pb.CACHE_EXPECTATION_KIND_EMPTY if step == 0 else pb.CACHE_EXPECTATION_KIND_POSITION
        h = pb.FrameHeader(
            schema_version=pb.SCHEMA_VERSION_V1,
            request_id=f"{self.session_id}:{next(self._ids)}" if request_id is None else request_id,
            session_id=self.session_id, route_epoch=self.epoch,
            compatibility_fingerprint=ident.compatibility_fingerprint,
            shard_range=pb.ShardRange(start=ident.range.start, end=ident.range.end),
            effective_start=self.effective_start,
            phase=phase, positions=pb.PositionRange(start=start, end=end), step=step,
            cache_expectation=pb.CacheExpectation(kind=expect, position=self.positions if cached is None else cached),
            compression=pb.COMPRESSION_NONE,
            payload_checksum=bundle_mod.frame_payload_checksum(payload),
        )
        for k, v in overrides.items():
            if isinstance(v, pb.ShardRange | pb.PositionRange | pb.CacheExpectation):
                getattr(h, k).CopyFrom(v)
            else:
                setattr(h, k, v)
        return h

    def input_frame(self, phase: int, tokens: Sequence[int] | None = None, *, rows: np.ndarray | None = None,
                    bundle: pb.TensorBundle | None = None, sample: bool = True, start: int | None = None,
                    end: int | None = None, request_id: str | None = None) -> pb.SessionRequest:
        """A StepFrame carrying token ids (head), residual ``rows`` or a received boundary
        ``bundle`` (forwarded as is) for positions [start, end) (default: from :attr:`positions`,
        one per row). The opening frame also carries the sampling contract and the chain."""
        start = self.positions if start is None else start
        payload: pb.TokenSpan | pb.TensorBundle
        if tokens is not None:
            payload = pb.TokenSpan(token_ids=list(tokens))
            n = len(tokens)
        elif bundle is not None:
            payload = bundle
            n = 0 if end is None else end - start
        else:
            assert rows is not None
            payload = bundle_mod.boundary_bundle(np.ascontiguousarray(rows, dtype=np.float32))
            n = int(rows.shape[0])
        end = start + n if end is None else end
        frame = pb.StepFrame(header=self.header(phase, start, end, cached=start, payload=payload,
                                                request_id=request_id), sample=sample)
        if tokens is not None:
            frame.tokens.CopyFrom(payload)
        else:
            frame.bundle.CopyFrom(payload)
        if self.step == 0:
            if self.sampling is not None:
                frame.sampling.CopyFrom(self.sampling.to_proto())
            if self.downstream:
                frame.downstream.extend(self.downstream)
        return pb.SessionRequest(step=frame)

    def _input_frame(self, phase: int, tokens: Sequence[int] | None, rows: np.ndarray | None,
                     sample: bool) -> pb.SessionRequest:
        return self.input_frame(phase, tokens, rows=rows, sample=sample)

    def fast_decode(self, token: int | None = None, *, bundle: pb.TensorBundle | None = None,
                    position: int | None = None, request_id: str = "") -> pb.SessionRequest:
        """The compact decode frame: one token id (head) or one boundary row (``bundle``)."""
        fd = pb.FastDecodeFrame(session_id=self.session_id, route_epoch=self.epoch, step=self.step,
                                position=self.positions if position is None else position, request_id=request_id)
        if bundle is not None:
            fd.bundle.CopyFrom(bundle)
        else:
            fd.token_id = token
        return pb.SessionRequest(fast_decode=fd)

    def generate_frame(self, phase: int, tokens: Sequence[int], n: int, *,
                       continue_after_finish: bool = False) -> pb.SessionRequest:
        """A sampling StepFrame (last prefill chunk, or one DECODE row) asking the worker to
        answer ``n`` tokens, feeding each back itself."""
        req = self.input_frame(phase, tokens, sample=True)
        req.step.generate.CopyFrom(pb.GenerateParams(max_tokens=n, continue_after_finish=continue_after_finish))
        return req

    def _applied(self, resp: pb.SessionResponse) -> pb.SessionResponse:
        self.step += 1
        self.positions = resp.header.cached_positions
        return resp

    # -- steps ---------------------------------------------------------------------------
    def _chunk(self, chunk: int | None) -> int:
        return chunk or capacity_limit(self.cap, "max_prefill_chunk_tokens", endpoint=self.target)

    async def prefill_chunk(self, tokens: Sequence[int] | None = None, *, rows: np.ndarray | None = None,
                            sample: bool = True) -> pb.SessionResponse:
        return self._applied(await self.exchange(self.input_frame(pb.PHASE_PREFILL, tokens, rows=rows,
                                                                  sample=sample)))

    async def prefill(self, tokens: Sequence[int], *, chunk: int | None = None) -> int | None:
        """Appends a prompt in chunks of at most max_prefill_chunk_tokens; returns the token
        sampled after it (tail) or None."""
        chunk = self._chunk(chunk)
        resp = None
        for i in range(0, len(tokens), chunk):
            resp = await self.prefill_chunk(tokens[i:i + chunk], sample=i + chunk >= len(tokens))
        return sampled(resp)

    async def decode_step(self, token: int, *, fast: bool = True) -> pb.SessionResponse:
        req = self.fast_decode(token) if fast and self.step > 0 else \
            self.input_frame(pb.PHASE_DECODE, [token], sample=True)
        return self._applied(await self.exchange(req))

    async def decode(self, token: int, *, fast: bool = True) -> int | None:
        return sampled(await self.decode_step(token, fast=fast))

    async def generate(self, first: int, n: int, *, fast: bool = True) -> list[int]:
        """Feeds ``first`` and each sampled token back ``n`` times; returns the n tokens sampled."""
        out: list[int] = []
        tok = first
        for _ in range(n):
            nxt = await self.decode(tok, fast=fast)
            assert nxt is not None
            out.append(nxt)
            tok = nxt
        return out

    async def read_generated(self, n: int, *, continue_after_finish: bool = False,
                             timeout: float | None = None) -> list[pb.SessionResponse]:
        """Reads the answers of a generate frame already sent: ``n`` tokens, fewer when a
        token finishes the generation (unless ``continue_after_finish``). Tracks step and
        positions: afterwards the session holds every position but the last token's."""
        out: list[pb.SessionResponse] = []
        while len(out) < max(1, n):
            resp = await self.next_generated(timeout)
            out.append(resp)
            self.step = resp.header.step + 1
            self.positions = resp.header.cached_positions
            tok = resp.tail.tokens[0] if resp.HasField("tail") and resp.tail.tokens else None
            if tok is None:
                raise ShardError(pb.ShardError(reason=pb.ERROR_REASON_UNSPECIFIED,
                                               message="a generated response carried no token"), resp.header)
            if not continue_after_finish and tok.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                break
        return out

    async def prefill_generate(self, tokens: Sequence[int], n: int, *, continue_after_finish: bool = False,
                               chunk: int | None = None) -> list[int]:
        """Appends a prompt (chunked as :meth:`prefill`); the last chunk asks for ``n`` tokens,
        the first sampled after the prompt. Returns the tokens sampled."""
        chunk = self._chunk(chunk)
        cut = ((len(tokens) - 1) // chunk) * chunk
        head, last = list(tokens[:cut]), list(tokens[cut:])
        for i in range(0, len(head), chunk):
            await self.prefill_chunk(head[i:i + chunk], sample=False)
        await self.send(self.generate_frame(pb.PHASE_PREFILL, last, n, continue_after_finish=continue_after_finish))
        return [sampled(r) for r in await self.read_generated(n, continue_after_finish=continue_after_finish)]

    async def decode_generate(self, token: int, n: int, *, continue_after_finish: bool = False) -> list[int]:
        """Feeds ``token`` (one DECODE row, a full frame) and lets the worker continue: returns
        the ``n`` tokens sampled (fewer at a finish reason unless ``continue_after_finish``)."""
        await self.send(self.generate_frame(pb.PHASE_DECODE, [token], n, continue_after_finish=continue_after_finish))
        return [sampled(r) for r in await self.read_generated(n, continue_after_finish=continue_after_finish)]

    async def truncate(self, position: int) -> pb.SessionResponse:
        req = pb.SessionRequest(step=pb.StepFrame(header=self.header(pb.PHASE_TRUNCATE, position, position)))
        return self._applied(await self.exchange(req))

    async def release(self) -> pb.SessionResponse:
        req = pb.SessionRequest(step=pb.StepFrame(header=self.header(pb.PHASE_RELEASE, self.positions,
                                                                     self.positions)))
        resp = await self.exchange(req)
        self.positions = 0
        return resp
