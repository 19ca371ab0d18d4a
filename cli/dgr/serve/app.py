"""The HTTP application: OpenAI-compatible endpoints, the console, health and metrics.

One gateway serves one or more routes (:mod:`dgr.serve.pool`): a request runs on a route of
the model it names.

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``
(streaming as server-sent events, or one JSON answer), ``GET /health``, ``GET /metrics``
(Prometheus text), ``GET /`` (the console) and ``GET /api/route`` (the routes' view it polls).
Errors have OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

FastAPI (on Starlette) gives request validation from typed models and streaming responses;
uvicorn serves it (:mod:`dgr.serve.server`).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import re
import time
import uuid
from importlib import resources
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .api_fields import ApiRequest, ChatRequest, CompletionRequest, logprobs_json, text_field
from .choices import Choices
from .engine import Engine, GatewayError, TokenLogprob
from .metrics import GatewayMetrics
from .pool import Routes, RouteState
from .routeview import RouteView

_log = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_BODY_BYTES = 8 << 20    # a request body (a prompt of 100k tokens, as text or as ids, is ~1 MiB)
MAX_BODY_NESTING = 128      # JSON brackets deep (a JSON schema may nest MAX_GRAMMAR_NESTING inside the body)


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends, also when
    the client disconnected, and whose generation is always closed too (that cancels its route
    session and frees its slot, also when the generator never started)."""

    def __init__(self, content: Any, gen: Choices, on_end: Any, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.gen, self.on_end = gen, on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            pass
        finally:
            try:
                await self.body_iterator.aclose()   # type: ignore[attr-defined]
            finally:
                try:
                    await self.gen.close()
                finally:
                    self.on_end()


class _Json(JSONResponse):
    """JSON in ASCII (``\\uXXXX`` escapes): an error message that quotes a client's text stays
    encodable whatever that text holds (Starlette's own JSONResponse encodes UTF-8, which a lone
    surrogate cannot be)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def _error_body(exc: GatewayError) -> dict[str, Any]:
    return {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.code}}


def _error(exc: GatewayError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return _Json(_error_body(exc), status_code=exc.status, headers=headers)


def _internal(exc: BaseException) -> GatewayError:
    """An unexpected failure on a request path, as the API's error (the traceback is logged)."""
    return GatewayError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error",
                        code="internal_error")


def _server_timing(gen: Choices) -> dict[str, str]:
    """``Server-Timing: route;dur=<ms>``: from the start of the request's handling (before its
    prompt is formatted) to the route's first token. A client's time to first token minus this
    is what HTTP, the gateway's framework and the client itself added (``dgr bench serve``)."""
    if gen.ttft_s is None:
        return {}
    return {"Server-Timing": f'route;dur={gen.ttft_s * 1e3:.3f};desc="request handled to first token"'}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _BearerAuth:
    """``Authorization: Bearer <key>`` on ``/v1/`` and ``/api/``, as plain ASGI middleware.

    Not Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``): that one pipes every
    chunk of a streamed answer through an extra task and memory stream, which was about 14% of
    the gateway's CPU samples at 8 concurrent streams (py-spy), CPU the workers need on a
    small host. The key is compared in constant time."""

    def __init__(self, app: Any, *, api_key: str) -> None:
        self.app = app
        self.expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(("/v1/", "/api/")):
            got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(got, self.expected):
                resp = _error(GatewayError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                           kind="invalid_request_error", code="invalid_api_key"))
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


# a string to its closing quote, or to the text's end (so a scan never starts again inside it)
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
_BRACKET_STEP = tuple(1 if c in b"[{" else -1 if c in b"]}" else 0 for c in range(256))


def json_nesting(raw: bytes) -> int:
    """How deep the brackets of a JSON text nest, outside its strings (a text that is not JSON
    gets some count; the parser refuses it afterwards). Linear in the text's length: about 50 ms
    for 8 MiB of text, 0.4 s for 8 MiB of nothing but brackets."""
    brackets = _NOT_BRACKET.sub(b"", _JSON_STRING.sub(b"", raw))
    return max(itertools.chain((0,), itertools.accumulate(map(_BRACKET_STEP.__getitem__, brackets))))


class _BodyGuard:
    """Bounds a ``POST`` body before the framework parses it, as plain ASGI middleware: at most
    :data:`MAX_BODY_BYTES` (else ``413``), and JSON nested at most :data:`MAX_BODY_NESTING`
    deep (else ``400``). Without it, a body of any size is held in memory, and a deeply nested
    one makes the JSON parser recurse to the interpreter's limit on the event loop's thread
    (a ``RecursionError`` there, and whatever else runs at that depth, such as a finalizer,
    fails too). The body read here is handed on to the application unchanged."""

    def __init__(self, app: Any, *, on_refused: Any) -> None:
        self.app, self.on_refused = app, on_refused

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":   # the client went away while sending
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                await self._refuse(scope, receive, send, GatewayError(
                    413, f"request body larger than {MAX_BODY_BYTES} bytes", kind="invalid_request_error",
                    code="request_too_large"))
                return
            chunks.append(chunk)
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        if (depth := json_nesting(body)) > MAX_BODY_NESTING:
            await self._refuse(scope, receive, send, GatewayError(
                400, f"request body nests {depth} levels deep, at most {MAX_BODY_NESTING}",
                code="invalid_value"))
            return
        sent = False

        async def replay() -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()      # then what the client does next (its disconnect)

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Any, receive: Any, send: Any, exc: GatewayError) -> None:
        if scope["path"] in GENERATION_PATHS:
            self.on_refused(exc.status)
        await _error(exc)(scope, receive, send)


class _Outcome:
    """One generation request's account in the metrics: in flight from its start, then counted
    once by its final status (whichever path ends it: an answer, an error, a disconnect); and
    its route's, from the moment one is picked for it to that same end."""

    def __init__(self, metrics: GatewayMetrics, routes: Routes) -> None:
        self.metrics, self.routes = metrics, routes
        self.gen: Choices | None = None
        self.route: RouteState | None = None
        self.done = False
        metrics.started()

    def pick(self, model: str) -> Engine:
        """The route this request runs on (404 for a model this gateway does not serve)."""
        self.route = self.routes.take(self.routes.pick(model))
        return self.route.engine

    def end(self, status: int) -> None:
        if not self.done:
            self.done = True
            if self.route is not None:
                self.routes.give_back(self.route)
            self.metrics.finished(self.gen, status)


def create_app(routes: Engine | Routes, *, api_key: str | None = None) -> FastAPI:
    """The gateway application over one connected :class:`Engine` (one route) or several
    (:class:`Routes`)."""
    app = FastAPI(title="dgr gateway", docs_url=None, redoc_url=None, openapi_url=None)
    if not isinstance(routes, Routes):
        routes = Routes([routes])
    engine = routes.first
    metrics = GatewayMetrics(routes)
    views = {r.name: RouteView(r.engine) for r in routes.routes}
    app.state.engine, app.state.routes, app.state.metrics = engine, routes, metrics

    @app.exception_handler(GatewayError)
    async def _gateway_error(_req: Request, exc: GatewayError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(req: Request, exc: RequestValidationError) -> JSONResponse:
        e = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if req.url.path in GENERATION_PATHS:
            metrics.refused(400)
        return _error(GatewayError(400, f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid request')}",
                                   param=loc[0] if loc else None, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(req: Request, exc: StarletteHTTPException) -> JSONResponse:
        # the framework's own refusals (a body it cannot parse, an unknown path or method)
        if req.url.path in GENERATION_PATHS:
            metrics.refused(exc.status_code)
        return _error(GatewayError(exc.status_code, str(exc.detail), kind="invalid_request_error" if
                                   exc.status_code < 500 else "server_error"))

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, exc: Exception) -> JSONResponse:
        # the last resort (a request path below answers its own failures): still OpenAI-shaped
        _log.error("unexpected error answering %s: %s", _req.url.path, exc, exc_info=exc)
        return _error(_internal(exc))

    app.add_middleware(_BodyGuard, on_refused=metrics.refused)
    if api_key:   # outermost: a client without the key is refused before its body is read
        app.add_middleware(_BearerAuth, api_key=api_key)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        # the first route's figures at the top (a gateway of one route), then every route
        out: dict[str, Any] = {"status": "ok", "model": engine.model_id, "shards": len(engine.driver.shards),
                               "running": sum(r.engine.admission.running for r in routes.routes),
                               "queued": sum(r.engine.admission.waiting for r in routes.routes)}
        if engine.router is not None:   # with standby workers: the route requests run on now
            out["route"] = list(engine.driver.endpoints)
            out["failovers"] = engine.failovers
            out["failed_shards"] = sorted(engine.router.failed)
        out["models"] = routes.models
        out["routes"] = routes.view()
        if not any(r.healthy for r in routes.routes):
            out["status"] = "degraded"
        return out

    @app.get("/metrics")
    async def prom() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": m, "object": "model", "created": rs[0].engine.created,
                                            "owned_by": "dgr"} for m, rs in routes.by_model.items()]}

    @app.get("/api/route")
    async def route() -> dict[str, Any]:
        # the first route's view at the top (a gateway of one route), then every route's
        snaps = await asyncio.gather(*(views[r.name].snapshot(r.engine) for r in routes.routes))
        states = routes.view()
        out = dict(snaps[0])
        out["routes"] = [{**st, **snap} for st, snap in zip(states, snaps)]
        return out

    @app.get("/", response_class=HTMLResponse)
    async def console() -> HTMLResponse:
        html = resources.files("dgr.serve").joinpath("static/console.html").read_text(encoding="utf-8")
        return HTMLResponse(html)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Any:
        return await _answer(request, req, chat=True)

    @app.post("/v1/completions")
    async def complete(req: CompletionRequest, request: Request) -> Any:
        return await _answer(request, req, chat=False)

    async def _prompt(engine: Engine, req: ApiRequest, chat: bool) -> tuple[list[int], str]:
        """The request's prompt token ids, and the text a completion echoes."""
        if chat:
            assert isinstance(req, ChatRequest)
            return await engine.chat_prompt([(m.role if m.role != "developer" else "system", m.text(i))
                                             for i, m in enumerate(req.messages)]), ""
        assert isinstance(req, CompletionRequest)
        p = req.prompt
        if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            ids = [int(x) for x in p]
            bad = next((x for x in ids if x < 0 or 0 < engine.n_vocab <= x), None)   # n_vocab 0: not known
            if bad is not None:   # refused here, before any answer starts (streamed or not)
                raise GatewayError(400, f"token id {bad} is outside the model's vocabulary (0..{engine.n_vocab - 1})",
                                   param="prompt", code="invalid_value")
        elif isinstance(p, list):
            if len(p) != 1:
                raise GatewayError(400, "one prompt per request (a list of several prompts is not supported)",
                                   param="prompt")
            ids = await engine.tokenize(text_field(str(p[0]), "prompt"))
        else:
            ids = await engine.tokenize(text_field(p, "prompt"))
        if not ids:
            raise GatewayError(400, "the prompt is empty", param="prompt")
        return ids, p if req.echo and isinstance(p, str) else ""

    async def _answer(request: Request, req: ApiRequest, *, chat: bool) -> Any:
        """One generation request, start to end. Whatever happens on the way (a refusal, a route
        failure, an unexpected exception, the client leaving) ends as an OpenAI-shaped answer,
        the request counted once by its final status and its session closed."""
        t0 = time.perf_counter()
        out = _Outcome(metrics, routes)
        try:
            eng = out.pick(req.model)
            params = req.params()
            ids, echo = await _prompt(eng, req, chat)
            out.gen = Choices(eng, ids, params, req.n or 1, t0)
            return await _respond(request, out, req, chat=chat, echo=echo)
        except GatewayError as exc:
            out.end(exc.status)
            return _error(exc)
        except Exception as exc:  # noqa: BLE001 - any failure is an answer, never a dropped request
            _log.error("request failed: %s", exc, exc_info=exc)
            if out.gen is not None:
                await out.gen.close()
            out.end(500)
            return _error(_internal(exc))
        except BaseException:       # cancelled (the server is stopping): the session must not outlive it
            if out.gen is not None:
                await out.gen.close()
            out.end(499)
            raise

    async def _respond(request: Request, out: _Outcome, req: ApiRequest, *, chat: bool, echo: str = "") -> Any:
        gen = out.gen
        assert gen is not None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if req.stream:
            # The prompt's checks and the admission slot come before the 200, so they stay HTTP
            # errors (400, 429 with Retry-After); the headers and the opening event then go out
            # while the route prefills, and the first token is one event away from the client
            # (measured: about 1.3 ms less time to first token than answering at the first token).
            # A failure from here on is an error event in the stream, followed by [DONE].
            await gen.start()
            status = [499]   # the stream's final status (499 unless it completes); counted once it ends
            return _EventStream(_stream(gen, status, rid, created, obj + ".chunk" if chat else obj, chat,
                                        req.include_usage, echo), gen, lambda: out.end(status[0]),
                                media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        collect = asyncio.ensure_future(gen.collect_all())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            collect.cancel()
            raise
        finally:
            gone.cancel()
        if not collect.done():   # the client went away: cancel its session
            collect.cancel()
            try:
                await collect
            except BaseException:  # noqa: BLE001
                pass
            await gen.close()      # also when collect was cancelled before it began
            out.end(499)
            return PlainTextResponse("", status_code=499)
        results = collect.result()   # a GatewayError or any other failure: answered by _answer
        out.end(200)
        choices = []
        for i, (text, lps) in enumerate(results):
            choice: dict[str, Any] = {"index": i, "finish_reason": gen.finish_reason(i),
                                      "logprobs": logprobs_json(lps, chat, len(echo))
                                      if gen.params.logprobs is not None else None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = echo + text
            choices.append(choice)
        return _Json({"id": rid, "object": obj, "created": created, "model": gen.engine.model_id,
                      "choices": choices, "usage": gen.usage.to_json()}, headers=_server_timing(gen))

    async def _stream(gen: Choices, status: list[int], rid: str, created: int, obj: str, chat: bool,
                      include_usage: bool, echo: str) -> AsyncIterator[bytes]:
        it = gen.deltas()
        try:
            want_lp = gen.params.logprobs is not None

            def chunk(text: str | None, finish: str | None, role: bool = False,
                      lps: list[TokenLogprob] | None = None, index: int = 0) -> dict[str, Any]:
                c: dict[str, Any] = {"index": index, "finish_reason": finish,
                                     "logprobs": logprobs_json(lps, chat, len(echo)) if want_lp and lps else None}
                if chat:
                    c["delta"] = ({"role": "assistant", "content": text or ""} if role else
                                  ({"content": text} if text else {}))
                else:
                    c["text"] = text or ""
                out = {"id": rid, "object": obj, "created": created, "model": gen.engine.model_id, "choices": [c]}
                if include_usage:
                    out["usage"] = None
                if finish is not None and gen.ttft_s is not None:
                    # what the Server-Timing header says on a non-streamed answer (the headers of
                    # a stream leave before the first token)
                    out["server_timing"] = {"route_ms": round(gen.ttft_s * 1e3, 3)}
                return out

            for i in range(len(gen.gens)):
                if chat:
                    yield _sse(chunk("", None, role=True, index=i))
                elif echo:
                    yield _sse(chunk(echo, None, index=i))
            async for i, d in it:
                if d.text or d.finish_reason or d.logprobs:
                    yield _sse(chunk(d.text, d.finish_reason, lps=d.logprobs, index=i))
            if include_usage:
                yield _sse({"id": rid, "object": obj, "created": created, "model": gen.engine.model_id, "choices": [],
                            "usage": gen.usage.to_json()})
            yield b"data: [DONE]\n\n"
            status[0] = 200
        except Exception as exc:   # noqa: BLE001 - after the 200: the error travels as an event, then [DONE]
            if not isinstance(exc, GatewayError):
                _log.error("stream failed: %s", exc, exc_info=exc)
                exc = _internal(exc)
            status[0] = exc.status
            yield _sse(_error_body(exc))
            yield b"data: [DONE]\n\n"
        finally:
            await it.aclose()

    return app


async def _disconnected(request: Request) -> None:
    """Returns when the client of a (fully read) request disconnects."""
    while True:
        msg = await request.receive()
        if msg.get("type") == "http.disconnect":
            return
