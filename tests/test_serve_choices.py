"""`dgr serve` with `n` > 1: n route sessions of one prompt side by side, through the official
`openai` client, over a 2-shard fake-model route.

Seeded choices are reproducible and differ (choice i samples with seed + i, choice 0 is the n=1
answer); greedy choices are equal; a stream carries every choice's deltas under its index and
the same texts as the whole answer; usage counts the prompt once; the n admission slots are
taken together or the request is a 429 (nothing held, nothing leaked); a client that leaves a
stream of n choices ends all n sessions.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import grpc
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dgr.serve.server import Gateway  # noqa: E402
from dgr.shard.v1 import shard_runtime_pb2 as pb  # noqa: E402
from dgr.shard.v1 import shard_runtime_pb2_grpc as pbg  # noqa: E402
from fakeroute import start_fake  # noqa: E402

pytestmark = pytest.mark.native

KEY = "test-key-n"
MODEL = "fake-8"
MSG = [{"role": "user", "content": "several answers please"}]


@pytest.fixture(scope="module")
def shards(native_bin):
    ws = [start_fake(native_bin, "--layers", r, "--max-sessions", "8", "--fake-delay-ms", "2") for r in ("0:4", "4:8")]
    yield ws
    for w in ws:
        w.kill()


@pytest.fixture(scope="module")
def gw(shards):
    with Gateway([w.target for w in shards], model_id=MODEL, api_key=KEY, slots=4, queue=4) as g:
        yield g


def _client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)


def _load(target: str) -> pb.LoadReport:
    with grpc.insecure_channel(target) as ch:
        return pbg.ShardRuntimeServiceStub(ch).GetMetrics(pb.GetMetricsRequest(), timeout=5).load


def _idle(gw, shards, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    for w in shards:
        while (ld := _load(w.target)).active_sessions or ld.kv_cells_used:
            assert time.monotonic() < end, f"shard {w.target} still holds {ld}"
            time.sleep(0.02)
    while "dgr_gateway_in_flight_requests 0.0" not in (m := httpx.get(gw.url + "/metrics").text):
        assert time.monotonic() < end, m
        time.sleep(0.02)


def test_seeded_choices_are_reproducible_and_differ(gw, shards):
    c = _client(gw)
    kw = dict(model=MODEL, messages=MSG, max_tokens=12, temperature=1.5, seed=42)
    r = c.chat.completions.create(n=3, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    texts = [ch.message.content for ch in r.choices]
    assert len(set(texts)) > 1, texts
    assert [ch.message.content for ch in c.chat.completions.create(n=3, **kw).choices] == texts
    one = c.chat.completions.create(**kw)
    assert one.choices[0].message.content == texts[0]
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * 12 and r.usage.total_tokens == r.usage.prompt_tokens + 36
    _idle(gw, shards)


def test_greedy_choices_are_equal_and_completions_carry_logprobs(gw, shards):
    c = _client(gw)
    r = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, temperature=0, n=2)
    assert r.choices[0].message.content == r.choices[1].message.content
    cr = c.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0.9, seed=7, n=2, logprobs=1)
    assert [ch.index for ch in cr.choices] == [0, 1]
    assert all(len(ch.logprobs.tokens) == 5 and "".join(ch.logprobs.tokens) == ch.text for ch in cr.choices)
    _idle(gw, shards)


def test_a_stream_carries_every_choice_under_its_index(gw, shards):
    c = _client(gw)
    kw = dict(model=MODEL, messages=MSG, max_tokens=10, temperature=1.2, seed=5, n=3)
    whole = c.chat.completions.create(**kw)
    texts, roles, finish = {}, {}, {}
    usage = None
    for ch in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage = ch.usage
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.delta.role:
                roles[choice.index] = choice.delta.role
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert texts == {i: ch.message.content for i, ch in enumerate(whole.choices)}
    assert set(finish) == {0, 1, 2}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    _idle(gw, shards)


def test_n_slots_are_taken_together_or_the_request_is_refused(gw, shards):
    c = _client(gw)
    with pytest.raises(openai.BadRequestError) as e:     # more choices than the gateway runs at once
        c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, n=5)
    assert e.value.body["param"] == "n"
    # two of the four slots busy with long streams: a request for three choices is a 429 at once
    busy = [c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1500, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True}) for _ in range(2)]
    try:
        for s in busy:
            next(iter(s))
        with pytest.raises(openai.RateLimitError):
            c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, n=3)
        r = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, n=2)   # two fit
        assert len(r.choices) == 2
    finally:
        for s in busy:
            s.close()
    _idle(gw, shards)
    assert 'dgr_gateway_requests_total{status="429"}' in httpx.get(gw.url + "/metrics").text


def test_a_client_leaving_a_stream_of_choices_ends_every_session(gw, shards):
    u = urlsplit(gw.url)
    body = json.dumps({"model": MODEL, "messages": MSG, "max_tokens": 1500, "temperature": 0, "n": 3,
                       "stream": True, "ignore_eos": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        sock.sendall(head + body)
        end = time.monotonic() + 10
        while _load(shards[0].target).active_sessions < 3:
            assert time.monotonic() < end, "the head never held the three sessions"
            time.sleep(0.01)
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
    _idle(gw, shards)
