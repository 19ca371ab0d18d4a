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
import time
import uuid
from typing import Any, Awaitable, Callable, Sequence

import grpc

from ..protocol.client import AsyncWorkerClient
from ..protocol.errors import Reason, WorkerError
from ..protocol.limits import CapabilityError, capacity_limit, check_capacity
from ..protocol.stream import AsyncSessionStream
from ..protocol.stream import Sampling  # re-exported: one Sampling class for the client and the route driver
from ..protocol.tls import TlsFiles  # noqa: F401  (RouteDriver(tls=…))
from ..shard.v1 import shard_runtime_pb2 as pb
from .generation import Collector, GenerationResult, run_chained, run_stepwise
from .shards import RouteError, RouteSessionError, ShardHandle, ShardUnreachable, route_error  # noqa: F401  (re-exported)
from .telemetry import GenerationTelemetry, NodeTiming

__all__ = ["DEFAULT_TIMEOUT_S", "DEFAULT_TOKENS_PER_ANSWER", "GenerationResult", "RouteDriver", "RouteError",
           "RouteSessionError", "Sampling", "ShardHandle", "route_error"]

DEFAULT_TIMEOUT_S = 60.0
# generated tokens per answer from a chained head (GenerateParams.tokens_per_answer): one, so
# that every token reaches the caller as soon as it is sampled (docs/serve.md, "Streaming cadence")
DEFAULT_TOKENS_PER_ANSWER = 1
RELEASE_TIMEOUT_S = 2.0
PROBE_TIMEOUT_S = 2.0      # chained mode: capability probe that finds a silent shard after a failure
# head-stream failures that name no shard and may come from any shard of the chain: probe them
_UNEXPLAINED = frozenset({Reason.UNAVAILABLE, Reason.DEADLINE_EXCEEDED, Reason.STREAM_CLOSED, Reason.INTERNAL,
                          Reason.UNKNOWN})


def exc_shard(driver: "RouteDriver", exc: RouteSessionError) -> ShardHandle:
    return next(s for s in driver.shards if s.endpoint == exc.shard_endpoint)


class RouteDriver:
    """Drives sessions over an ordered list of worker endpoints covering [0, n_layer).

    ``chain``: None (default) uses the chained mode when every shard supports it and no hop
    is relayed, else stepwise; False always stepwise; True requires the chained mode
    (:class:`RouteError` when a shard lacks it).

    ``hops``: per shard, the address the previous shard dials for it in the chained mode ("" or
    None: its endpoint). A relayed shard (``relay+tcp://``) with a hop, a relay egress on the
    previous shard's node (:mod:`dgr.protocol.relay_egress`), keeps the chained mode.

    ``tokens_per_answer`` (chained mode): 1 (default) answers every token as soon as it is
    sampled. N > 1 lets the head send up to N generated tokens in one answer while they come
    less than 50 ms apart, none held longer than 50 ms (``GenerateParams.tokens_per_answer``):
    fewer answers cost this process a little less CPU, but the tokens reach the caller in
    bursts, so a streaming caller (``dgr serve``) must not ask for it."""

    def __init__(self, endpoints: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT_S,
                 chain: bool | None = None, tokens_per_answer: int = DEFAULT_TOKENS_PER_ANSWER,
                 tls: "TlsFiles | None" = None, hops: Sequence[str | None] | None = None) -> None:
        if not endpoints:
            raise RouteError("a route needs at least one shard endpoint")
        if hops is not None and len(hops) != len(endpoints):
            raise RouteError(f"{len(hops)} hops for {len(endpoints)} shard endpoints")
        self.hops = [h or "" for h in hops] if hops is not None else [""] * len(endpoints)
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
        for ep, hop in zip(self.endpoints, self.hops):   # relay+tcp://: a hop through a byte relay (same frames)
            client = AsyncWorkerClient(ep, timeout=self.timeout, tls=self.tls)
            try:
                cap = await client.capability(timeout=self.timeout)
            except WorkerError as exc:
                await client.close()
                raise ShardUnreachable(ep, f"shard {ep} is unreachable: {exc.code.name}: {exc.details}") from None
            try:
                check_capacity(cap, endpoint=ep)   # every limit reported: none is assumed below
            except CapabilityError as exc:
                await client.close()
                raise RouteError(exc.one_line()) from None
            self.shards.append(ShardHandle(ep, client, cap, hop))
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
        for i, s in enumerate(self.shards):
            if i > 0 and is_relay_endpoint(s.dialled_as):
                return f"{s.endpoint} is a relayed hop without a relay egress (the previous shard cannot dial it)"
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
        return min(capacity_limit(s.capability, "max_prefill_chunk_tokens", endpoint=s.endpoint) for s in self.shards)

    @property
    def head(self) -> ShardHandle:
        return self.shards[0]

    async def close(self) -> None:
        if self._releasing:
            await asyncio.wait(list(self._releasing), timeout=RELEASE_TIMEOUT_S + 1)
        for s in self.shards:
            await s.client.close()

    async def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` by the head's tokenizer (raises the client's WorkerError)."""
        return await self.head.client.tokenize(text, add_special=add_special, parse_special=parse_special,
                                               timeout=self.timeout)

    async def detokenize(self, ids: Sequence[int]) -> bytes:
        """The text bytes of ``ids`` by the head's tokenizer (raises the client's WorkerError)."""
        return await self.head.client.detokenize(ids, timeout=self.timeout)

    async def open_stream(self, shard: ShardHandle, sid: str, epoch: int, *, sampling: Sampling | None = None,
                          downstream: Sequence[pb.ChainHop] = ()) -> AsyncSessionStream:
        """A Session stream of session ``sid`` to one shard (the protocol client's stream, with
        this driver's step deadline; its failures map to RouteSessionError by :func:`route_error`)."""
        return await shard.client.open_session(sid, epoch, sampling=sampling, downstream=downstream,
                                               step_timeout=self.timeout, effective_start=shard.start)

    def chain_hops(self) -> list[pb.ChainHop]:
        """The ``StepFrame.downstream`` of a chained session's opening frame."""
        return [pb.ChainHop(endpoint=s.dialled_as, range=pb.ShardRange(start=s.start, end=s.end),
                            compatibility_fingerprint=s.capability.identity.compatibility_fingerprint)
                for s in self.shards[1:]]

    async def generate(self, prompt_tokens: Sequence[int], *, max_tokens: int = 32,
                       sampling: Sampling = Sampling(), session_id: str | None = None, epoch: int = 1,
                       on_token: Callable[[int], Awaitable[None] | None] | None = None,
                       stop_on_eog: bool = True, forced_tokens: Sequence[int] | None = None,
                       on_sampled: Callable[[pb.SampledToken], None] | None = None) -> GenerationResult:
        """One Route Session. ``on_sampled``: called with each sampled token whole (its logprobs
        when ``sampling.top_logprobs``), just before ``on_token`` gets its id.
        ``forced_tokens`` (stepwise mode only): teacher forcing, the
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
        if sid in self._cancelled:   # cancelled before it began: nothing is opened on any shard
            self._cancelled.discard(sid)
            err = RouteSessionError(self.head, Reason.CANCELLED, "cancelled by the driver before it began",
                                    grpc_code=1)
            tel.status, tel.error = "cancelled", str(err)
            return GenerationResult(sid, list(prompt_tokens), [], "error", tel, error=err)
        if chained:   # one stream, to the head; the opening frame names the chain and the sampling
            shards = [self.head]
            streams = [await self.open_stream(self.head, sid, epoch, sampling=sampling, downstream=self.chain_hops())]
        else:         # one stream per shard; the tail's opening frame carries the sampling contract
            shards = list(self.shards)
            streams = [await self.open_stream(s, sid, epoch, sampling=sampling if s is self.shards[-1] else None)
                       for s in shards]
        self._active[sid] = epoch
        g = Collector(max_tokens, stop_on_eog, bool(sampling.top_logprobs), on_token, on_sampled)
        g.forced = list(forced_tokens) if forced_tokens is not None else None

        def check_cancelled() -> None:
            # a cancel may reach the shards before this session exists there (CancelSession then
            # finds nothing): the driver remembers it and ends the session at its next step
            if sid in self._cancelled:
                raise RouteSessionError(self.head, Reason.CANCELLED, "cancelled by the driver", grpc_code=1)
        g.check = check_cancelled
        t0 = time.perf_counter()
        try:
            if not prompt_tokens:
                raise RouteError("the prompt is empty")
            if chained:
                await run_chained(self.head, self.shards[-1], streams[0], prompt_tokens, chunk=self.chunk_tokens,
                                  tokens_per_answer=self.tokens_per_answer, tel=tel, g=g, t0=t0)
            else:
                await run_stepwise(list(zip(shards, streams)), prompt_tokens, chunk=self.chunk_tokens, tel=tel,
                                   g=g, t0=t0)
            tel.status = "completed"
            return GenerationResult(sid, list(prompt_tokens), g.out, g.finish, tel, top_logprobs=g.top)
        except RouteSessionError as exc:
            if sid in self._cancelled and exc.reason != Reason.CANCELLED:
                # the stream may end before the CANCELLED frame is read (write on a closed call)
                exc = RouteSessionError(exc_shard(self, exc), Reason.CANCELLED,
                                        f"cancelled by the driver ({exc.reason})", grpc_code=1)
            elif chained and sid not in self._cancelled:
                exc = await self._attribute(exc)
            # cancelled only when this driver was asked to cancel it: a worker that ends the stream
            # CANCELLED on its own (it is stopping, SIGTERM) failed the session, and failover may
            # restart it elsewhere (found by the chaos soak: a draining head's CANCELLED read as a
            # client's cancel, answered 499)
            tel.status = "cancelled" if exc.reason == Reason.CANCELLED and sid in self._cancelled else "failed"
            tel.error = str(exc)
            return GenerationResult(sid, list(prompt_tokens), g.out, "error", tel, error=exc, top_logprobs=g.top)
        except asyncio.CancelledError:
            tel.status = "cancelled"
            raise
        finally:
            tel.completion_tokens = len(g.out)
            tel.total_s = time.perf_counter() - t0
            tel.nodes = [NodeTiming(f"{sh.endpoint}[{sh.start}:{sh.end})", st.busy_s,
                                    st.step, st.seam_bytes_in, decode_busy_s=st.decode_busy_s,
                                    decode_steps=st.decode_steps, frame_bytes_in=st.frame_bytes_in,
                                    frame_bytes_out=st.frame_bytes_out,
                                    decode_frame_bytes_in=st.decode_frame_bytes_in) for sh, st in zip(shards, streams)]
            if chained:
                # the other shards ran the same steps, driven by the head (the driver never waited on them)
                h = streams[0]
                tel.nodes += [NodeTiming(f"{s.endpoint}[{s.start}:{s.end})", 0.0, h.step,
                                         decode_steps=h.decode_steps) for s in self.shards[1:]]
            self._active.pop(sid, None)
            self._cancelled.discard(sid)
            if tel.status == "completed":
                # one round: the half-close ends the session on each stream's worker (and, in
                # chained mode, the head ends its downstream streams), so a normal finish sends no
                # ReleaseSession or CancelSession and returns at once. The streams' end is awaited
                # in the background (close() waits for it); one that does not end cleanly in time
                # gets the full release there.
                for st in streams:
                    await st.close()
                self._background(self._settle(list(zip(shards, streams)), sid, epoch, chained))
            else:
                # bounded: a hung shard must not hold the caller (its session TTL frees it later). In
                # chained mode the head closes its downstream streams; releasing them too is harmless.
                # a cancelled session ends cancelled on the shards too (their dgr_sessions_cancelled_total),
                # also when the cancel came before the session opened there and ended it at its next step
                cancelled = tel.status == "cancelled"
                tail_end = self._cancel_shard if cancelled else self._release_shard
                extra = [tail_end(s, sid, epoch) for s in self.shards[1:]] if chained else []
                end = self._end_cancelled if cancelled else self._release
                release = asyncio.wait_for(asyncio.gather(*(end(sh, st, sid, epoch)
                                                            for sh, st in zip(shards, streams)), *extra,
                                                          return_exceptions=True), RELEASE_TIMEOUT_S)
                if tel.status == "failed":
                    # a failed shard may be silent: release in the background so that the caller
                    # (failover, dgr/route/failover.py) moves on at once; close() waits for it
                    self._background(release)
                else:
                    try:
                        await release
                    except asyncio.TimeoutError:
                        pass

    def _background(self, aw: Awaitable[Any]) -> None:
        """Runs a session's cleanup off the caller's path; :meth:`close` waits for it."""
        t = asyncio.ensure_future(aw)
        self._releasing.add(t)
        t.add_done_callback(lambda f: (self._releasing.discard(f), f.cancelled() or f.exception()))

    async def _settle(self, pairs: list[tuple[ShardHandle, AsyncSessionStream]], sid: str, epoch: int,
                      chained: bool) -> None:
        """After a normal finish: waits (bounded) for each half-closed stream to end. A worker
        that ends it with OK has dropped the session; otherwise (an error status, no end in time)
        the session is released as before, with ReleaseSession on every shard of the route."""
        async def ended(st: AsyncSessionStream) -> bool:
            try:
                return await st.wait_closed(RELEASE_TIMEOUT_S) == grpc.StatusCode.OK
            except Exception:   # noqa: BLE001 - no clean end in time: released below
                return False
        ok = await asyncio.gather(*(ended(st) for _, st in pairs))
        if all(ok):
            return
        extra = [self._release_shard(s, sid, epoch) for s in self.shards[1:]] if chained else []
        await asyncio.wait_for(asyncio.gather(*(self._release(sh, st, sid, epoch) for sh, st in pairs), *extra,
                                              return_exceptions=True), RELEASE_TIMEOUT_S)

    def _named_shard(self, exc: RouteSessionError) -> ShardHandle | None:
        """The downstream shard the head named as the one that failed (ShardError's
        ``failed_endpoint`` and range), None when it named none or one not on this route."""
        if exc.failed_endpoint is None:
            return None
        return next((s for s in self.shards[1:]
                     # the head names what it dialled: the endpoint, or a relayed shard's egress
                     if exc.failed_endpoint in (s.endpoint, getattr(s, "hop", "") or s.endpoint)
                     and (s.start, s.end) == exc.failed_range), None)

    async def _silent_shard(self) -> ShardHandle | None:
        """The first shard (route order) that does not answer a capability probe."""
        async def alive(s: ShardHandle) -> bool:
            try:
                await s.client.capability(refresh=True, timeout=min(PROBE_TIMEOUT_S, self.timeout))
                return True
            except Exception:   # noqa: BLE001 - a liveness probe: any failure to answer (also a relayed
                return False    # hop's socket error) is "not answering", never an error of the request
        res = await asyncio.gather(*(alive(s) for s in self.shards))
        return next((s for s, ok in zip(self.shards, res) if not ok), None)

    async def _attribute(self, exc: RouteSessionError) -> RouteSessionError:
        """Chained mode: a failure reported by (or seen on) the head stream, attributed to the
        shard it came from: the one the head named, else (when the head's own stream broke or
        went silent without naming one) the first shard that does not answer a probe."""
        if len(self.shards) == 1 or exc.shard_endpoint != self.head.endpoint:
            return exc
        shard = self._named_shard(exc)
        if shard is None and exc.reason == Reason.KEEPALIVE:
            return exc      # the driver's own connection to the head went silent: the head it is
        if shard is None and exc.reason in _UNEXPLAINED:
            shard = await self._silent_shard()
        if shard is None or shard is self.head:
            return exc
        return RouteSessionError(shard, exc.reason, exc.detail, grpc_code=exc.grpc_code, field=exc.field)

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
                return (await s.client.cancel(session_id, epoch, timeout=5)).cancelled
            except WorkerError:
                return False
        self._cancelled.add(session_id)
        first = await one(self.head)
        return [first, *await asyncio.gather(*(one(s) for s in self.shards[1:]))]

    async def _release(self, shard: ShardHandle, st: AsyncSessionStream, sid: str, epoch: int) -> None:
        await st.close()
        st.cancel()
        await self._release_shard(shard, sid, epoch)

    async def _end_cancelled(self, shard: ShardHandle, st: AsyncSessionStream, sid: str, epoch: int) -> None:
        # CancelSession before the stream's own cancel: the shard ends the session as cancelled
        # whichever of the two it sees first (a stream cancel alone may look like a half-close)
        try:
            await self._cancel_shard(shard, sid, epoch)
        finally:
            st.cancel()

    async def _cancel_shard(self, shard: ShardHandle, sid: str, epoch: int) -> None:
        try:
            await shard.client.cancel(sid, epoch, timeout=RELEASE_TIMEOUT_S)
        except WorkerError:
            pass

    async def _release_shard(self, shard: ShardHandle, sid: str, epoch: int) -> None:
        try:
            await shard.client.release(sid, epoch, timeout=RELEASE_TIMEOUT_S)
        except WorkerError:
            pass
