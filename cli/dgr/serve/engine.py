"""One route session per HTTP request: prompt formatting, admission, incremental text.

Over 500 lines on purpose, for now: admission and the text stream could move out; they are
small and used only here.

The :class:`Engine` owns a connected route driver. A request becomes a :class:`Generation`:
its prompt is formatted with the model's own chat template (the head worker's
``ApplyChatTemplate``) and tokenized by the head; the driver runs the session (many sessions
share the workers' batches); each sampled token's piece is looked up once per token id
(``Detokenize`` with ``include_pieces``, cached) and decoded incrementally. Each token becomes
one delta (one server-sent event) as soon as it arrives; the only text held back is a UTF-8
sequence split across tokens (until its last byte) and text that might start a stop string
(until it cannot): docs/serve.md, "Streaming cadence". Closing a generation early (client gone,
stop string hit) cancels its session on every shard, which frees its KV.

No HTTP here: :mod:`dgr.serve.app` maps :class:`GatewayError` to OpenAI-shaped responses.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import grpc

from dgr.errors import DgrError
from dgr.protocol.client import AsyncWorkerClient
from dgr.protocol.errors import Reason, WorkerError, WorkerUnavailable
from dgr.protocol.limits import capacity_limit
from dgr.route.driver import RouteDriver, RouteSessionError, Sampling
from dgr.route.failover import DEFAULT_MAX_RESTARTS, FailoverRouter, PoolRouteFinder
from dgr.route.text import PieceCache, TextDecoder, chat_prompt_text
from dgr.shard.v1 import shard_runtime_pb2 as pb

CANCEL_WAIT_S = 5.0          # a cancelled session's generate() returns well within this
RETRY_AFTER_S = 1            # Retry-After of an over-capacity answer


class GatewayError(DgrError):
    """A request the gateway answers with an error (``status``: HTTP status; ``kind``/``code``:
    the OpenAI error type and code)."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.retry_after = retry_after


@dataclass
class Params:
    """What one request asks of a generation (already validated)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0              # 0: off
    min_p: float = 0.0          # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; k >= 0: each token's logprob and its k most likely alternatives
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias): added before the choice
    # llama-server's penalties over the last ``repeat_last_n`` tokens, the prompt's included
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_last_n: int = 64
    # constrained sampling (response_format, llama-server's grammar): at most one of them
    grammar: str = ""
    json_schema: str = ""
    constraint_param: str = ""     # the request field that asked for the grammar or schema

    def sampling(self, prompt_ids: Sequence[int] = ()) -> Sampling:
        # the sampled token's own logprob comes with top_logprobs >= 1 (SampledToken.logprob)
        top = 0 if self.logprobs is None else max(1, self.logprobs)
        n = self.repeat_last_n
        common = dict(ignore_eog=self.ignore_eos, top_logprobs=top, logit_bias=self.logit_bias,
                      repeat_penalty=self.repeat_penalty, frequency_penalty=self.frequency_penalty,
                      presence_penalty=self.presence_penalty, penalty_last_n=n,
                      penalty_prompt=tuple(prompt_ids[-n:]) if n else (), grammar=self.grammar,
                      json_schema=self.json_schema)
        if self.temperature <= 0:
            return Sampling(**common)
        seed = self.seed if self.seed is not None else random.randrange(1, 2**31)
        return Sampling(temperature=self.temperature, top_p=self.top_p if self.top_p < 1 else 0.0, top_k=self.top_k,
                        min_p=self.min_p, seed=seed, **common)


@dataclass
class TokenLogprob:
    """One sampled token's log-probability and its most likely alternatives (most likely first);
    ``offset``: where the token's text begins in the answer's text (characters, before it was
    cut at a stop string)."""

    piece: bytes
    logprob: float
    top: list[tuple[bytes, float]]
    offset: int = 0


@dataclass
class Delta:
    """New text of a generation (``text`` may be empty on the final delta)."""

    text: str
    finish_reason: str | None = None   # set on the last delta: "stop" or "length"
    # with Params.logprobs: the tokens consumed since the previous delta (also tokens whose text
    # is held back or cut at a stop string)
    logprobs: list[TokenLogprob] = field(default_factory=list)


class Admission:
    """At most ``slots`` sessions run; up to ``queue`` more wait (first come, first served);
    beyond that a request is refused with 429. Release never awaits, so a cancelled request
    cannot leak its slot."""

    def __init__(self, slots: int, queue: int) -> None:
        self.slots, self.queue = slots, queue
        self.running = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    def take_now(self, k: int) -> None:
        """Takes ``k`` slots at once, now, or refuses (429) without taking any: a request that
        needs several never holds some while it waits for the rest."""
        free = self.slots - self.running
        if self.waiting or k > free:
            raise GatewayError(429, f"over capacity: the request needs {k} sessions at once and {max(0, free)} are "
                               f"free ({self.waiting} requests queued); retry later",
                               kind="rate_limit_exceeded", code="over_capacity", retry_after=RETRY_AFTER_S)
        self.running += k

    async def acquire(self) -> None:
        if self.running < self.slots and not self.waiting:
            self.running += 1
            return
        if self.waiting >= self.queue:
            raise GatewayError(429, f"over capacity: {self.running} requests running, {self.waiting} queued "
                               f"(limits {self.slots} and {self.queue}); retry later",
                               kind="rate_limit_exceeded", code="over_capacity", retry_after=RETRY_AFTER_S)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut          # release() hands its slot over (running stays counted)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()
            else:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1


class _TextStream:
    """Token pieces -> text, with stop strings held back until they cannot match."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self.decoder = TextDecoder()
        self.pending = ""        # decoded, not yet sent (may start a stop string)
        self.text = ""           # sent so far
        self.stopped = False

    def push(self, data: bytes, final: bool = False) -> str:
        """Adds bytes; returns the text that can be sent now."""
        if self.stopped:
            return ""
        self.pending += self.decoder.push(data, final)
        if self.stop:
            hit = min(((i, s) for s in self.stop if (i := self.pending.find(s)) >= 0), default=None)
            if hit is not None:
                out = self.pending[:hit[0]]
                self.pending, self.stopped = "", True
                self.text += out
                return out
            if not final:
                # keep the longest tail that is a prefix of some stop string
                keep = 0
                for s in self.stop:
                    for k in range(min(len(s) - 1, len(self.pending)), keep, -1):
                        if self.pending.endswith(s[:k]):
                            keep = k
                            break
                out = self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(out):]
                self.text += out
                return out
        out, self.pending = self.pending, ""
        self.text += out
        return out


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def to_json(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class Generation:
    """One request's route session; iterate :meth:`deltas`, then read ``usage``/``ttft_s``.

    ``t0`` (``time.perf_counter()``): when the request's handling began, before its prompt was
    formatted and tokenized (default: now). ``ttft_s`` runs from there to the moment the route
    delivered the first token: the route's share of the time to first token, which the gateway
    reports (``Server-Timing``, ``/metrics``) so that what HTTP adds can be told apart from it."""

    _DONE = object()

    def __init__(self, engine: "Engine", prompt_ids: list[int], params: Params, t0: float | None = None) -> None:
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.params = params
        self.session_id = f"gw-{uuid.uuid4().hex[:16]}"
        self.usage = Usage(prompt_tokens=len(prompt_ids))
        self.ttft_s: float | None = None
        self.t0 = time.perf_counter() if t0 is None else t0
        self.finish_reason: str | None = None
        self._q: asyncio.Queue[Any] = asyncio.Queue()
        self._task: asyncio.Task[Any] | None = None
        self._closed = False

    @property
    def started(self) -> bool:
        return self._task is not None

    async def start(self, *, slot_taken: bool = False) -> None:
        """Checks the request against the route's positions, takes an admission slot (429 when
        over capacity; ``slot_taken``: the caller took it, and gives it back when this raises)
        and starts the route session. Raises :class:`GatewayError` before anything runs; once it
        returns, :meth:`deltas` or :meth:`close` must follow (both end the session and free the
        slot). Called by :meth:`deltas` when not yet called."""
        if self._task is not None:
            return
        eng = self.engine
        left = eng.max_positions - len(self.prompt_ids)
        if left < 1:
            raise GatewayError(400, f"the prompt is {len(self.prompt_ids)} tokens; the route holds at most "
                               f"{eng.max_positions} positions per session", code="context_length_exceeded",
                               param="messages")
        max_tokens = self.params.max_tokens or left
        if max_tokens > left:
            raise GatewayError(400, f"max_tokens {max_tokens} + {len(self.prompt_ids)} prompt tokens exceed the "
                               f"{eng.max_positions} positions a session may hold", code="context_length_exceeded",
                               param="max_tokens")
        try:   # checked here, before anything runs: the route would fail on it later
            sampling = self.params.sampling(self.prompt_ids)
            sampling.to_proto()
        except ValueError as exc:
            raise GatewayError(400, f"invalid sampling parameters: {exc}", code="invalid_value") from None
        bad = next((t for t, _ in self.params.logit_bias if eng.n_vocab and t >= eng.n_vocab), None)
        if bad is not None:
            raise GatewayError(400, f"logit_bias token id {bad} is outside the model's vocabulary "
                               f"(0..{eng.n_vocab - 1})", param="logit_bias", code="invalid_value")
        q = self._q
        want_lp = self.params.logprobs is not None
        last: list[pb.SampledToken | None] = [None]

        def on_sampled(st: pb.SampledToken) -> None:
            last[0] = st

        def on_token(tok: int) -> None:
            if self.ttft_s is None:     # stamped on arrival, not when this request's task next runs
                self.ttft_s = time.perf_counter() - self.t0
            q.put_nowait((tok, last[0]) if want_lp else tok)

        if not slot_taken:
            await eng.admission.acquire()
        try:
            task = asyncio.create_task((eng.router or eng.driver).generate(
                self.prompt_ids, max_tokens=max_tokens, sampling=sampling,
                session_id=self.session_id, on_token=on_token, **({"on_sampled": on_sampled} if want_lp else {})))
        except BaseException:
            if not slot_taken:
                eng.admission.release()
            raise
        task.add_done_callback(lambda _t: q.put_nowait(self._DONE))
        self._task = task
        eng.active[self.session_id] = self

    async def close(self) -> None:
        """Ends the session on every shard (when still running) and frees its slot; once, and
        also when the request is being cancelled (the cleanup runs in its own task)."""
        if self._task is None or self._closed:
            return
        self._closed = True
        self.engine.active.pop(self.session_id, None)
        cleanup = asyncio.ensure_future(self.engine.finish(self.session_id, self._task))
        try:
            await asyncio.shield(cleanup)
        except asyncio.CancelledError:
            pass

    async def deltas(self) -> AsyncIterator[Delta]:
        await self.start()
        task, q, eng = self._task, self._q, self.engine
        assert task is not None
        text = _TextStream(self.params.stop)
        try:
            # One token at a time, also when several are queued (the reader fell behind): each
            # token's text is its own delta, so that text leaves as evenly as it was sampled.
            # Only _TextStream holds text back (an incomplete UTF-8 character, a possible stop
            # string's start); held text goes out with the next token that completes it.
            lps: list[TokenLogprob] = []
            while (item := await q.get()) is not self._DONE:
                self.usage.completion_tokens += 1
                tok, st = item if isinstance(item, tuple) else (item, None)
                piece = (await eng.pieces((tok,)))[0]
                if st is not None:
                    lps.append(await self._logprob(piece, st, len(text.text) + len(text.pending)))
                out = text.push(piece)
                if text.stopped:
                    self.finish_reason = "stop"
                    yield Delta(out, "stop", lps)
                    return
                if out:
                    yield Delta(out, logprobs=lps)
                    lps = []
            try:
                res = task.result()
            except (WorkerError, DgrError) as exc:   # e.g. the head refused the stream
                raise GatewayError(502, f"route failure: {exc}", kind="server_error", code="route_error") from None
            if isinstance(res.error, RouteSessionError):
                raise _session_error(res.error, self.params.constraint_param)
            if res.error is not None:   # failover found no route, or gave up after its restarts
                raise GatewayError(502, f"route failure: {res.error}", kind="server_error", code="route_error")
            out = text.push(b"", final=True)
            self.finish_reason = "length" if res.finish_reason == "length" and not text.stopped else "stop"
            yield Delta(out, self.finish_reason, lps)
        finally:
            await self.close()

    async def _logprob(self, piece: bytes, st: pb.SampledToken, offset: int) -> TokenLogprob:
        want = self.params.logprobs or 0
        alts = list(st.top_logprobs)[:want]
        pieces = await self.engine.pieces([t.token_id for t in alts]) if alts else []
        return TokenLogprob(piece, st.logprob, [(p, t.logprob) for p, t in zip(pieces, alts)], offset)

    async def collect(self) -> str:
        parts = [d.text async for d in self.deltas()]
        return "".join(parts)

    async def collect_all(self) -> tuple[str, list[TokenLogprob]]:
        """The whole answer's text, and its tokens' logprobs (with Params.logprobs)."""
        parts, lps = [], []
        async for d in self.deltas():
            parts.append(d.text)
            lps.extend(d.logprobs)
        return "".join(parts), lps


# the sampling fields the tail names when it refuses a constraint (ShardError.field)
_CONSTRAINT_FIELDS = ("sampling.json_schema", "sampling.grammar")


def _session_error(exc: RouteSessionError, constraint_param: str = "") -> GatewayError:
    reason = exc.reason
    if reason in (Reason.OVER_BUDGET, Reason.RESOURCE_EXHAUSTED):
        return GatewayError(429, f"over capacity on shard {exc.shard_endpoint}: {exc.detail}",
                            kind="rate_limit_exceeded", code="over_capacity", retry_after=RETRY_AFTER_S)
    if reason in (Reason.TOKEN_OUT_OF_VOCAB, Reason.BAD_REQUEST, Reason.CHUNK_TOO_LARGE, Reason.INVALID_ARGUMENT):
        if exc.field in _CONSTRAINT_FIELDS and constraint_param:
            return GatewayError(400, f"{constraint_param}: {exc.detail}", param=constraint_param,
                                code="invalid_value")
        return GatewayError(400, f"the route refused the prompt: {exc.detail}", param="prompt", code="invalid_value")
    if reason == Reason.CANCELLED:
        return GatewayError(499, "the request was cancelled", kind="cancelled", code="cancelled")
    return GatewayError(502, f"route failure: {exc}", kind="server_error", code="route_error")


def _head_unavailable(endpoint: str, exc: WorkerError) -> GatewayError:
    """The head shard did not answer (gone, not serving, silent, failed): the route failed, not
    the request."""
    return GatewayError(502, f"route failure: the head shard {endpoint} is unavailable: {exc.code.name}: "
                             f"{exc.details}", kind="server_error", code="route_error")


# what a head answers to text it refuses: the request's fault (400); any other failure is the route's
_REQUEST_FAULTS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                             grpc.StatusCode.OUT_OF_RANGE})
# with standby workers: how many standbys (the newest) a tokenizer call may try when the head does
# not answer, all asked at once, and how long that may take
MAX_TOKENIZER_FALLBACKS = 16
TOKENIZER_FALLBACK_TIMEOUT_S = 2.0


def _unavailable(exc: WorkerError) -> bool:
    """The worker did not answer (gone, silent, failing), as opposed to refusing the request."""
    return isinstance(exc, WorkerUnavailable) or exc.code not in _REQUEST_FAULTS


class Engine:
    """The gateway's view of one route: a connected driver plus what requests need of it."""

    def __init__(self, driver: RouteDriver, *, model_id: str, slots: int | None = None, queue: int = 64,
                 router: FailoverRouter | None = None) -> None:
        self._driver = driver
        # with standby workers: sessions whose shard fails restart on a route without it
        # (dgr.route.failover); the client's stream goes on, the tokens it has are not resent
        self.router = router
        self.restarts = 0          # requests restarted on a new route (with standby workers)
        if router is not None:
            router.on_event = self._on_failover_event
        self.model_id = model_id
        # the workers' own limits (GetCapability); a worker without one is refused, not guessed at
        self.max_positions = min(capacity_limit(s.capability, "max_session_positions", endpoint=s.endpoint)
                                 for s in driver.shards)
        self.worker_slots = min(capacity_limit(s.capability, "max_sessions", endpoint=s.endpoint)
                                for s in driver.shards)
        self.n_vocab = driver.shards[0].capability.identity.n_vocab
        self.admission = Admission(slots or self.worker_slots, queue)
        self.created = int(time.time())
        self.active: dict[str, Generation] = {}
        self._pieces = PieceCache(driver.head.client, timeout=driver.timeout)

    @classmethod
    async def connect(cls, endpoints: Sequence[str], *, model_id: str | None = None, slots: int | None = None,
                      queue: int = 64, timeout: float = 60.0, tls: Any = None, standby: Sequence[str] = (),
                      max_restarts: int = DEFAULT_MAX_RESTARTS, hops: Sequence[str] | None = None) -> "Engine":
        router = None
        if standby and hops and any(hops):
            raise DgrError("a relayed route's hops do not go with standby workers (a route formed after a "
                           "failure has no relay egress)")
        if standby:
            router = await FailoverRouter(list(endpoints), max_restarts=max_restarts, timeout=timeout,
                                          tls=tls).connect()
            assert router.route is not None and isinstance(router.finder, PoolRouteFinder)
            router.finder.endpoints += [e for e in standby if e not in router.finder.endpoints]
            driver = router.route
        else:
            driver = await RouteDriver(list(endpoints), timeout=timeout, tls=tls, hops=hops).connect()
        try:
            ident = driver.shards[0].capability.identity
            eng = cls(driver, model_id=model_id or ident.artifact_id or "dgr", slots=slots, queue=queue,
                      router=router)
            await eng._pieces.prefetch(ident.n_vocab)
        except BaseException:
            await (router.close() if router is not None else driver.close())
            raise
        return eng

    @property
    def driver(self) -> RouteDriver:
        """The route requests run on now: after a failover, the route without the failed shard."""
        if self.router is not None and self.router.route is not None:
            return self.router.route
        return self._driver

    def _on_failover_event(self, kind: str, _data: dict) -> None:
        if kind == "restart":
            self.restarts += 1

    @property
    def failovers(self) -> int:
        """Routes formed after a shard failed (0 without standby workers)."""
        return len(self.router.routes) - 1 if self.router is not None else 0

    async def close(self) -> None:
        await (self.router.close() if self.router is not None else self._driver.close())

    @property
    def head(self) -> AsyncWorkerClient:
        """The head shard's protocol client (tokenizer, chat template, token pieces)."""
        return self.driver.head.client

    async def pieces(self, toks: Sequence[int]) -> list[bytes]:
        """Each token's text bytes (a token id's piece never changes: looked up once)."""
        return await self._pieces.pieces(toks)

    async def _tokenizer_call(self, call: Callable[[AsyncWorkerClient], Awaitable[Any]]) -> Any:
        """``call(client)`` on the head. With standby workers, a head that does not answer (it
        may have failed a moment ago, before any session noticed) is not the end: the call goes
        to the next worker that answers, the route's other shards first, then the standbys that
        serve the same recipe (equal fingerprints: the same tokenizer and chat template).
        Raises the head's own error when none answers, or at once for a request fault."""
        try:
            return await call(self.head)
        except WorkerError as exc:
            if self.router is None or not _unavailable(exc):
                raise
            first = exc
        route = self.driver
        fp = route.head.capability.identity.compatibility_fingerprint
        for sh in route.shards[1:]:
            try:
                return await call(sh.client)
            except WorkerError as exc:
                if not _unavailable(exc):
                    raise
        tried = {s.endpoint for s in route.shards} | set(self.router.failed)
        tls = self.router.finder.tls
        creds = tls.grpc_credentials() if tls else None
        pool = [e for e in self.router.finder.endpoints if e not in tried][-MAX_TOKENIZER_FALLBACKS:]
        clients = [AsyncWorkerClient(ep, timeout=TOKENIZER_FALLBACK_TIMEOUT_S, credentials=creds) for ep in pool]

        async def same_recipe(c: AsyncWorkerClient) -> bool:
            try:
                return (await c.capability()).identity.compatibility_fingerprint == fp
            except Exception:   # noqa: BLE001 - a standby that does not answer is skipped
                return False
        try:
            # every standby asked at once (dead ones cost one timeout together, not one each);
            # the newest first: standbys that died idle are never excluded and pile up in front
            ok = await asyncio.gather(*(same_recipe(c) for c in clients))
            for c, good in reversed(list(zip(clients, ok))):
                if not good:
                    continue
                try:
                    return await call(c)
                except WorkerError as exc:
                    if not _unavailable(exc):
                        raise
        finally:
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        raise first

    async def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        try:
            text = await self._tokenizer_call(lambda c: chat_prompt_text(c, messages, timeout=self.driver.timeout))
        except WorkerError as exc:
            if isinstance(exc, WorkerUnavailable) or exc.code not in _REQUEST_FAULTS:
                raise _head_unavailable(self.driver.head.endpoint, exc) from None
            raise GatewayError(400, f"cannot format the messages: {exc.details}", param="messages") from None
        except UnicodeEncodeError as exc:   # a lone surrogate: JSON carries it, protobuf strings cannot
            raise GatewayError(400, f"the messages are not valid Unicode text: {exc.reason}", param="messages",
                               code="invalid_value") from None
        return await self.tokenize(text, special=True)

    async def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        try:
            return await self._tokenizer_call(lambda c: c.tokenize(text, add_special=True, parse_special=special,
                                                                   timeout=self.driver.timeout))
        except WorkerError as exc:
            if isinstance(exc, WorkerUnavailable) or exc.code not in _REQUEST_FAULTS:
                raise _head_unavailable(self.driver.head.endpoint, exc) from None
            raise GatewayError(400, f"cannot tokenize the prompt: {exc.details}", param="prompt") from None
        except UnicodeEncodeError as exc:
            raise GatewayError(400, f"the prompt is not valid Unicode text: {exc.reason}", param="prompt",
                               code="invalid_value") from None

    def generation(self, prompt_ids: list[int], params: Params, t0: float | None = None) -> Generation:
        return Generation(self, prompt_ids, params, t0)

    async def finish(self, session_id: str, task: "asyncio.Task[Any]") -> None:
        """Ends a request's session: cancels it on every shard when still running (bounded
        wait), then frees its admission slot."""
        try:
            if not task.done():
                try:
                    await (self.router or self.driver).cancel(session_id)
                    await asyncio.wait_for(asyncio.shield(task), CANCEL_WAIT_S)
                except BaseException:   # noqa: BLE001 - cleanup: the task must not outlive the request
                    task.cancel()
            if task.done() and not task.cancelled():
                task.exception()        # retrieved (a failure was already reported or is moot)
        finally:
            self.admission.release()

    def add_standby(self, endpoint: str) -> None:
        """Adds a worker to the standby pool that failover forms new routes from (a route served
        with standby workers only). Refused for an endpoint failover has excluded: it is never
        taken back. Safe to call from another thread (one list append)."""
        if self.router is None or not isinstance(self.router.finder, PoolRouteFinder):
            raise DgrError("this route has no standby pool: serve it with standby workers")
        if endpoint in self.router.failed:
            raise DgrError(f"{endpoint} was excluded after a failure and is not taken back")
        if endpoint not in self.router.finder.endpoints:
            self.router.finder.endpoints.append(endpoint)
