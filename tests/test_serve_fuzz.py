"""Arbitrary JSON at `dgr serve`'s generation endpoints: never a 500, always an OpenAI-shaped
answer, and afterwards nothing in flight and nothing held on the workers.

A seeded generator (bounded count, reproducible: the seed and the body are in every failure)
mutates valid bodies: fields of every JSON type and of surprising values (huge and negative
numbers, lone surrogates, nesting, unknown fields), plus bodies that are not objects or not
JSON at all. Fake-model workers with 64 positions per session keep every answer short.
"""

from __future__ import annotations

import collections
import json
import random
import re
import time

import grpc
import pytest

httpx = pytest.importorskip("httpx")

from dgr.serve.server import Gateway  # noqa: E402
from dgr.shard.v1 import shard_runtime_pb2 as pb  # noqa: E402
from dgr.shard.v1 import shard_runtime_pb2_grpc as pbg  # noqa: E402
from fakeroute import start_fake  # noqa: E402

pytestmark = pytest.mark.native

MODEL = "fake-8"
SEED = 20261205
BODIES_PER_ENDPOINT = 150

FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
          "stop", "n", "stream", "stream_options", "ignore_eos", "echo", "logprobs", "top_logprobs", "top_k",
          "min_p", "response_format", "logit_bias", "frequency_penalty", "presence_penalty", "user", "tools",
          "suffix", "best_of", "cache_prompt", "no_such_field"]


def _scalar(rng: random.Random):
    return rng.choice([
        None, True, False, 0, 1, -1, 2, 7, 2**31, 2**63, 2**64, -(2**64), 10**30, 0.5, -0.0, 1e308, -1e-308, 2.0000001,
        "", "x", MODEL, "a\ud800b", "\udfff", "\x00", "é€😀", "<|im_start|>", "data: [DONE]\n\n", "9" * 50,
    ])


def _value(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if depth > 2 or kind < 0.6:
        return _scalar(rng)
    if kind < 0.8:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["type", "text", "role", "content", "include_usage", "x"]): _value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def _message(rng: random.Random):
    r = rng.random()
    if r < 0.5:
        return {"role": rng.choice(["user", "system", "assistant", "developer", "tool"]),
                "content": rng.choice(["hi", "", "a\ud800b", None, [{"type": "text", "text": "part"}]])}
    if r < 0.7:
        return {"role": "user", "content": [{"type": rng.choice(["text", "image_url", None, 3]),
                                             "text": _value(rng, 2)}]}
    return _value(rng, 1)


def _body(rng: random.Random, chat: bool):
    r = rng.random()
    if r < 0.04:
        return rng.choice([b"", b"{", b"nul", b"[1,2]", b"42", b'"text"', b"\xff\xfe{}", b'{"model": NaN}',
                           b'{"model": "fake-8", "max_tokens": Infinity}', b"[" * 5000 + b"]" * 5000,
                           b'{"a":' * 3000 + b"1" + b"}" * 3000])
    body: dict = {"model": MODEL, "max_tokens": rng.choice([1, 4, 16, None]), "temperature": rng.choice([0, 0.8]),
                  "stream": rng.random() < 0.4}
    if chat:
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = rng.choice(["hello", [256, 104, 105], ["one"], []])
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3, 4])):
        field = rng.choice(FIELDS)
        if field == "messages" and rng.random() < 0.7:
            body[field] = [_message(rng) for _ in range(rng.randint(0, 3))]
        elif field == "prompt" and rng.random() < 0.5:
            body[field] = [rng.choice([0, 1, 255, 256, 257, -1, 10**9, 2**64]) for _ in range(rng.randint(0, 5))]
        elif field == "stream" and rng.random() < 0.7:
            body[field] = True
        else:
            body[field] = _value(rng)
    if rng.random() < 0.1:
        body.pop(rng.choice(list(body)))
    return body


def _metrics(target: str) -> pb.GetMetricsResponse:
    with grpc.insecure_channel(target) as ch:
        return pbg.ShardRuntimeServiceStub(ch).GetMetrics(pb.GetMetricsRequest(), timeout=5)


@pytest.fixture(scope="module")
def shards(native_bin):
    ws = [start_fake(native_bin, "--layers", r, "--max-sessions", "4", "--ctx-per-session", "64")
          for r in ("0:4", "4:8")]
    yield ws
    for w in ws:
        w.kill()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_arbitrary_json_never_gets_a_500_and_leaves_nothing_behind(shards, path):
    rng = random.Random(f"{SEED}{path}")
    chat = path.endswith("chat/completions")
    seen: collections.Counter = collections.Counter()
    with Gateway([w.target for w in shards], model_id=MODEL) as gw, httpx.Client(timeout=60) as client:
        for i in range(BODIES_PER_ENDPOINT):
            body = _body(rng, chat)
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()   # ASCII JSON: "\ud800" escapes
            where = f"body #{i} (seed {SEED}): {raw[:300]!r}"
            r = client.post(gw.url + path, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code < 500 or r.status_code in (502, 503), f"{r.status_code} for {where}: {r.text[:300]}"
            seen[r.status_code] += 1
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                seen["streamed"] += 1
                events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                assert events and events[-1] == "[DONE]", f"stream cut for {where}: {events[-3:]}"
                for ev in events[:-1]:
                    json.loads(ev)
            else:
                answer = r.json()
                if r.status_code >= 400:
                    e = answer.get("error")
                    assert isinstance(e, dict) and set(e) == {"message", "type", "param", "code"}, where
                else:
                    assert answer["choices"] and "usage" in answer, where
        end = time.monotonic() + 10
        while True:
            m = client.get(gw.url + "/metrics").text
            in_flight = float(re.search(r"^dgr_gateway_in_flight_requests (\S+)$", m, re.M).group(1))
            if in_flight == 0 or time.monotonic() > end:
                break
            time.sleep(0.02)
        assert in_flight == 0, m
        # the bodies reached every path: answers, streams, refusals
        assert seen[200] >= 20 and seen["streamed"] >= 10 and seen[400] >= 20, seen
        assert 'dgr_gateway_requests_total{status="500"}' not in m
        total = sum(float(v) for v in re.findall(r'^dgr_gateway_requests_total\{status="\d+"\} (\S+)$', m, re.M))
        assert total == BODIES_PER_ENDPOINT, f"{total} requests counted of {BODIES_PER_ENDPOINT}"
    for w in shards:
        end = time.monotonic() + 10
        while (load := _metrics(w.target).load).active_sessions or load.kv_cells_used:
            assert time.monotonic() < end, f"shard {w.target} still holds {load}"
            time.sleep(0.02)
