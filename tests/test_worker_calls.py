"""The protocol client's unary calls that the gateway and the route driver use (tokenize,
detokenize, token pieces, chat template, metrics, capability): their answers from a fake
worker, their error types (a refused request: WorkerError; a killed worker: WorkerUnavailable),
and what the gateway answers when its head shard is gone (502 route_error, docs/serve.md)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from dgr.protocol.client import AsyncWorkerClient, WorkerClient
from dgr.protocol.errors import WorkerError, WorkerUnavailable
from fakeroute import start_fake

pytestmark = pytest.mark.native


def _calls(c: WorkerClient) -> dict:
    return {"tokenize": lambda: c.tokenize("x"), "detokenize": lambda: c.detokenize([104]),
            "pieces": lambda: c.pieces([104]), "apply_chat_template": lambda: c.apply_chat_template([("user", "x")]),
            "metrics": lambda: c.metrics(), "capability": lambda: c.capability(refresh=True)}


def test_sync_calls_answer_and_a_killed_worker_is_unavailable(native_bin):
    w = start_fake(native_bin)
    try:
        with WorkerClient(w.target, timeout=10) as c:
            ids = c.tokenize("hi there", add_special=True)
            assert ids[1:] == list(b"hi there") and ids[0] != ids[1]          # the fake model: BOS, then bytes
            assert c.detokenize(ids[1:]) == b"hi there"
            assert c.pieces(ids[1:]) == [bytes([b]) for b in b"hi there"]
            assert c.apply_chat_template([("user", "hello")]).endswith("assistant\n")
            assert "hello" in c.apply_chat_template([("user", "hello")], add_assistant=False)
            assert c.metrics().load.kv_cells_total > 0
            with pytest.raises(WorkerError) as refused:                     # refused, not unavailable
                c.pieces([10**6])
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert not isinstance(refused.value, WorkerUnavailable)
            w.kill()
            for name, call in _calls(c).items():
                with pytest.raises(WorkerUnavailable) as gone:
                    call()
                assert gone.value.code == grpc.StatusCode.UNAVAILABLE, name
    finally:
        w.kill()


def test_async_calls_raise_the_client_error_types(native_bin):
    w = start_fake(native_bin)

    async def main() -> None:
        async with AsyncWorkerClient(w.target, timeout=10) as c:
            assert await c.pieces([104, 105]) == [b"h", b"i"]
            text = await c.apply_chat_template([("system", "be brief"), ("user", "hello")])
            assert "be brief" in text and "hello" in text
            with pytest.raises(WorkerError) as refused:
                await c.detokenize([10**6])
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            w.kill()
            for call in (c.tokenize("x"), c.pieces([1]), c.apply_chat_template([("user", "x")]), c.metrics(),
                         c.capability(refresh=True)):
                with pytest.raises(WorkerUnavailable):
                    await call

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        w.kill()


def test_gateway_answers_502_when_its_head_is_gone(native_bin):
    """The head's chat template and tokenizer calls fail with WorkerUnavailable: the gateway
    answers 502 route_error (a shard failed), not a 400 blaming the request; a token-id prompt
    fails in the session, also 502. The console's route view shows the shard as down."""
    httpx = pytest.importorskip("httpx")
    from dgr.serve.server import Gateway

    ws = [start_fake(native_bin, "--layers", r) for r in ("0:4", "4:8")]
    try:
        with Gateway([w.target for w in ws], model_id="fake-8") as gw:
            ok = httpx.post(gw.url + "/v1/completions", json={"model": "fake-8", "prompt": "hi", "max_tokens": 2},
                            timeout=30)
            assert ok.status_code == 200, ok.text
            ws[0].kill()
            for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                               ("/v1/completions", {"prompt": "hi"}),
                               ("/v1/completions", {"prompt": [256, 104, 105]})):
                r = httpx.post(gw.url + path, json={"model": "fake-8", "max_tokens": 2, **body}, timeout=30)
                assert r.status_code == 502, (path, body, r.text)
                err = r.json()["error"]
                assert err["code"] == "route_error" and err["type"] == "server_error", err
                assert ws[0].target in err["message"], err
            view = httpx.get(gw.url + "/api/route", timeout=30).json()
            head = next(s for s in view["shards"] if s["endpoint"] == ws[0].target)
            assert head["ok"] is False and head["error"], head
    finally:
        for w in ws:
            w.kill()



@pytest.mark.parametrize("code,status", [(grpc.StatusCode.DEADLINE_EXCEEDED, 502), (grpc.StatusCode.INTERNAL, 502),
                                         (grpc.StatusCode.UNKNOWN, 502), (grpc.StatusCode.CANCELLED, 502),
                                         (grpc.StatusCode.INVALID_ARGUMENT, 400),
                                         (grpc.StatusCode.FAILED_PRECONDITION, 400)])
def test_a_head_failure_is_the_routes_and_a_refusal_is_the_requests(code, status):
    """The head's tokenizer or chat template failing for any reason but refusing the text (a
    deadline run out, an internal fault) is the route's failure: 502 route_error naming the head.
    Only a refusal of the text itself (INVALID_ARGUMENT, FAILED_PRECONDITION) is the request's: 400."""
    from types import SimpleNamespace

    from dgr.serve.engine import Engine, GatewayError

    async def fail(*_a, **_k):
        raise WorkerError(code, "boom")

    eng = Engine.__new__(Engine)
    head = SimpleNamespace(endpoint="127.0.0.1:9", client=SimpleNamespace(tokenize=fail))
    eng._driver, eng.router = SimpleNamespace(head=head, timeout=1.0), None
    with pytest.raises(GatewayError) as ei:
        asyncio.run(eng.tokenize("hi"))
    assert ei.value.status == status, ei.value
    if status == 502:
        assert "127.0.0.1:9" in str(ei.value) and code.name in str(ei.value), ei.value
