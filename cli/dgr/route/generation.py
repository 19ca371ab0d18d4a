"""One Route Session's generation, in the route driver's two modes (see :mod:`dgr.route.driver`):

- :func:`run_stepwise`: one Session stream per Shard; each step goes hop by hop (the head takes
  token ids, every next Shard the previous one's boundary bundle as received), the tail samples;
- :func:`run_chained`: one stream to the head, which forwards along the chain and generates
  itself; the driver reads one answer per token (or per ``tokens_per_answer`` tokens).

Both feed :class:`Collector` (the tokens, top logprobs, finish reason, the caller's ``on_token``)
and fill the session's :class:`~dgr.route.telemetry.GenerationTelemetry` timings. Every stream
failure leaves as :class:`~dgr.route.shards.RouteSessionError` naming the Shard.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

from ..protocol.errors import Reason
from ..protocol.stream import AsyncSessionStream
from ..shard.v1 import shard_runtime_pb2 as pb
from .shards import STREAM_ERRORS, RouteSessionError, ShardHandle, route_error
from .telemetry import GenerationTelemetry

FrameFor = Callable[[AsyncSessionStream, "pb.TensorBundle | None"], pb.SessionRequest]


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


class Collector:
    """What one generation collected so far (shared by both modes)."""

    def __init__(self, max_tokens: int, stop_on_eog: bool, top_logprobs: bool,
                 on_token: Callable[[int], Awaitable[None] | None] | None,
                 on_sampled: Callable[[pb.SampledToken], None] | None = None) -> None:
        self.max_tokens = max_tokens
        self.stop_on_eog = stop_on_eog
        self.want_top = top_logprobs
        self.on_token = on_token
        self.on_sampled = on_sampled   # the whole SampledToken (its logprobs), just before on_token
        self.out: list[int] = []
        self.top: list[list[tuple[int, float]]] = []
        self.forced: list[int] | None = None   # teacher forcing (stepwise): the tokens fed back
        self.finish = "length"
        # raises RouteSessionError (CANCELLED) once the session was cancelled through the driver:
        # checked before each prefill chunk and each token, so that a cancel that reached the
        # workers before the session existed there (and so found nothing) still ends it
        self.check: Callable[[], None] = lambda: None

    async def emit(self, tok: pb.SampledToken) -> bool:
        """Records one sampled token; True when the generation is complete."""
        self.check()
        self.out.append(tok.token_id)
        if self.want_top:
            self.top.append([(t.token_id, t.logprob) for t in tok.top_logprobs])
        if self.on_sampled is not None:
            self.on_sampled(tok)
        if self.on_token is not None:
            r = self.on_token(tok.token_id)
            if asyncio.iscoroutine(r):
                await r
        if self.stop_on_eog and tok.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish = pb.FinishReason.Name(tok.finish_reason).removeprefix("FINISH_REASON_").lower()
            return True
        return len(self.out) >= self.max_tokens

    async def emit_all(self, tokens: Sequence[pb.SampledToken]) -> bool:
        """Emits tokens in order; True once the generation is done (the rest is not emitted)."""
        for t in tokens:
            if await self.emit(t):
                return True
        return False


def bundle_bytes(b: pb.TensorBundle) -> int:
    return sum(len(f.data) for t in b.tensors for f in t.fragments)


# ---- stepwise ----------------------------------------------------------------------------------

async def _through(route: list[tuple[ShardHandle, AsyncSessionStream]], frame: FrameFor) -> pb.SessionResponse:
    """One route step hop by hop: each Shard's frame (``frame(stream, boundary)``) carries the
    previous Shard's boundary output (None for the head); the tail's answer."""
    boundary: pb.TensorBundle | None = None
    last = len(route) - 1
    resp = None
    for i, (sh, st) in enumerate(route):
        req = frame(st, boundary)
        if boundary is not None:
            st.seam_bytes_in += bundle_bytes(boundary)
        try:
            resp = await st.exchange(req)
        except STREAM_ERRORS as exc:
            raise route_error(sh, exc) from None
        st.step += 1
        if i < last:
            boundary = resp.boundary
    assert resp is not None
    return resp


async def run_stepwise(route: list[tuple[ShardHandle, AsyncSessionStream]], prompt_tokens: Sequence[int], *,
                       chunk: int, tel: GenerationTelemetry, g: Collector, t0: float) -> None:
    """Prefill in chunks of ``chunk`` tokens through every Shard, then one FastDecodeFrame per
    token per Shard (the sampled token, or under teacher forcing ``g.forced[k]``)."""
    n = len(prompt_tokens)
    tail = route[-1][0]
    tok_out: Sequence[pb.SampledToken] = []
    for ci, a in enumerate(range(0, n, chunk)):
        b = min(n, a + chunk)
        last = b == n
        g.check()
        step_id = f"{tel.request_id}/p{ci}"   # work id of this route step, same on every seam

        def prefill(st: AsyncSessionStream, boundary: pb.TensorBundle | None) -> pb.SessionRequest:
            if boundary is None:    # the head takes token ids, every next Shard the boundary as received
                return st.input_frame(pb.PHASE_PREFILL, prompt_tokens[a:b], sample=last, start=a, end=b,
                                      request_id=step_id)
            return st.input_frame(pb.PHASE_PREFILL, bundle=boundary, sample=last, start=a, end=b, request_id=step_id)

        tok_out = (await _through(route, prefill)).tail.tokens
    tel.ttft_s = time.perf_counter() - t0
    tel.prefill_s = tel.ttft_s
    if not tok_out:
        raise RouteSessionError(tail, Reason.BAD_RESPONSE, "the tail returned no token after prefill")
    pos = n
    t_dec = time.perf_counter()
    try:
        while not await g.emit(tok_out[0]):
            k = pos - n
            token = g.forced[k] if g.forced is not None and k < len(g.forced) else tok_out[0].token_id
            step_id = f"{tel.request_id}/d{pos}"

            def decode(st: AsyncSessionStream, boundary: pb.TensorBundle | None) -> pb.SessionRequest:
                if boundary is None:
                    return st.fast_decode(token, position=pos, request_id=step_id)
                return st.fast_decode(bundle=boundary, position=pos, request_id=step_id)

            tok_out = (await _through(route, decode)).tail.tokens
            if not tok_out:
                raise RouteSessionError(tail, Reason.BAD_RESPONSE, "the tail returned no token")
            pos += 1
    finally:
        tel.decode_s = time.perf_counter() - t_dec


# ---- chained ----------------------------------------------------------------------------------

def check_chained(head: ShardHandle, resp: pb.SessionResponse, step: int, phase: int, start: int) -> None:
    """A chained head answers each step with the tail's output, in order."""
    h = resp.header
    kind = resp.WhichOneof("result")
    if kind != "tail" or h.step != step or h.phase != phase or h.positions.start != start:
        raise RouteSessionError(
            head, Reason.BAD_RESPONSE,
            f"chained head answered {kind or 'no result'} for step {h.step} ({pb.Phase.Name(h.phase)}, "
            f"positions [{h.positions.start}:{h.positions.end})); expected a tail output for step {step} "
            f"({pb.Phase.Name(phase)}) at position {start}")


async def run_chained(head: ShardHandle, tail: ShardHandle, st: AsyncSessionStream, prompt_tokens: Sequence[int], *,
                      chunk: int, tokens_per_answer: int, tel: GenerationTelemetry, g: Collector,
                      t0: float) -> None:
    """One stream to the head: prefill chunks (the opening one names the chain), the last one
    asks the head to generate; then read one answer per token (or per ``tokens_per_answer``)."""
    n = len(prompt_tokens)
    resp: pb.SessionResponse | None = None
    for ci, a in enumerate(range(0, n, chunk)):   # the head forwards each chunk as is: it fits every Shard
        b = min(n, a + chunk)
        last = b == n
        g.check()
        req = st.input_frame(pb.PHASE_PREFILL, prompt_tokens[a:b], sample=last, start=a, end=b,
                             request_id=f"{tel.request_id}/p{ci}")
        if last:
            req.step.generate.CopyFrom(pb.GenerateParams(max_tokens=max(1, g.max_tokens),
                                                         continue_after_finish=not g.stop_on_eog,
                                                         tokens_per_answer=tokens_per_answer))
        try:
            resp = await st.exchange(req)
        except STREAM_ERRORS as exc:
            raise route_error(head, exc) from None
        check_chained(head, resp, st.step, pb.PHASE_PREFILL, a)
        st.step += 1
    assert resp is not None
    tel.ttft_s = time.perf_counter() - t0
    tel.prefill_s = tel.ttft_s
    tok_out = resp.tail.tokens
    if not tok_out:
        raise RouteSessionError(tail, Reason.BAD_RESPONSE, "the tail returned no token after prefill")
    pos = n
    t_dec = time.perf_counter()
    try:
        # an answer holds one token, or several in order (tokens_per_answer), one step each
        pending = list(tok_out[:1])
        while not await g.emit_all(pending):
            try:
                resp = await st.next_generated()
            except STREAM_ERRORS as exc:
                raise route_error(head, exc) from None
            pending = list(resp.tail.tokens)
            check_chained(head, resp, st.step + max(0, len(pending) - 1), pb.PHASE_DECODE, pos)
            if not pending:
                raise RouteSessionError(tail, Reason.BAD_RESPONSE, "the tail returned no token")
            if resp.header.positions.end != pos + len(pending):
                raise RouteSessionError(
                    head, Reason.BAD_RESPONSE,
                    f"chained head answered {len(pending)} token(s) for positions "
                    f"[{resp.header.positions.start}:{resp.header.positions.end})")
            st.step += len(pending)
            pos += len(pending)
    finally:
        tel.decode_s = time.perf_counter() - t_dec
