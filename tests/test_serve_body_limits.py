"""A request body is bounded before `dgr serve` parses it: at most 8 MiB (413) and JSON at most
128 brackets deep (400), each an OpenAI-shaped error counted once, with nothing left in flight.
A deeply nested body once made the JSON parser recurse to the interpreter's limit on the event
loop's thread, where a finalizer that happened to run at that depth failed as well.
"""

from __future__ import annotations

import json
import random
import re
import time

import pytest

httpx = pytest.importorskip("httpx")

from dgr.serve.server import Gateway  # noqa: E402
from fakeroute import start_fake  # noqa: E402

pytestmark = pytest.mark.native

MODEL = "fake-8"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def gw(native_bin):
    ws = [start_fake(native_bin, "--layers", r, "--max-sessions", "4") for r in ("0:4", "4:8")]
    try:
        with Gateway([w.target for w in ws], model_id=MODEL) as g:
            yield g
    finally:
        for w in ws:
            w.kill()


def _gw_metric(gw, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", httpx.get(gw.url + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def _wait_in_flight_zero(gw, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while (v := _gw_metric(gw, "dgr_gateway_in_flight_requests")) != 0:
        assert time.monotonic() < end, f"dgr_gateway_in_flight_requests stays at {v}"
        time.sleep(0.02)


def _is_error_shape(body: dict) -> bool:
    e = body.get("error")
    return isinstance(e, dict) and set(e) == {"message", "type", "param", "code"} and isinstance(e["message"], str)


def _post(gw, path: str, body) -> httpx.Response:
    if not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    return httpx.post(gw.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)


def test_json_nesting_counts_brackets_outside_strings():
    from dgr.serve.app import json_nesting
    rng = random.Random(20261207)

    def value(depth: int):
        r = rng.random()
        if depth > 6 or r < 0.3:
            return rng.choice([1, None, "[{", "]}", '\\"[', "x\\", "", "\u005b"])
        if r < 0.65:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(["a", "[", '"{']): value(depth + 1) for _ in range(rng.randint(0, 3))}

    def depth(v) -> int:
        if isinstance(v, list):
            return 1 + max(map(depth, v), default=0)
        if isinstance(v, dict):
            return 1 + max(map(depth, v.values()), default=0)
        return 0

    for _ in range(300):
        v = value(0)
        assert json_nesting(json.dumps(v).encode()) == depth(v), v
    # text that is not JSON still gets a count (the parser refuses it afterwards)
    assert json_nesting(b"[" * 5000) == 5000
    assert json_nesting(b'["abc\\') == 1 and json_nesting(b'"\\' * 1000) == 0
    assert json_nesting(b"]]]") == 0 and json_nesting(b"") == 0


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("body", [b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000,
                                  b'{"model": "fake-8", "prompt": "x", "x": ' + b"[" * 129 + b"]" * 129 + b"}"])
def test_a_body_nested_too_deep_is_a_400_before_it_is_parsed(gw, path, body):
    from dgr.serve.app import MAX_BODY_NESTING
    before = _gw_metric(gw, "dgr_gateway_requests_total", '{status="400"}')
    r = _post(gw, path, body)
    assert r.status_code == 400, r.text
    assert _is_error_shape(r.json()) and f"at most {MAX_BODY_NESTING}" in r.json()["error"]["message"]
    assert _gw_metric(gw, "dgr_gateway_requests_total", '{status="400"}') == before + 1
    _wait_in_flight_zero(gw)
    # nesting up to the bound is parsed: here the answer is the refusal of the field that nests
    ok = {"model": MODEL, "max_tokens": 2,
          "x_client_field": json.loads("[" * (MAX_BODY_NESTING - 1) + "]" * (MAX_BODY_NESTING - 1))}
    ok.update({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"})
    r = _post(gw, path, ok)
    assert r.status_code == 400 and r.json()["error"]["param"] == "x_client_field", r.text


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_too_large_is_a_413_and_is_not_held(gw, chunked):
    from dgr.serve.app import MAX_BODY_BYTES
    before = _gw_metric(gw, "dgr_gateway_requests_total", '{status="413"}')
    prompt = b"x" * (MAX_BODY_BYTES + 1)
    raw = b'{"model": "fake-8", "max_tokens": 2, "prompt": "' + prompt + b'"}'
    if chunked:   # no Content-Length: the gateway counts what arrives
        def pieces():
            for i in range(0, len(raw), 1 << 20):
                yield raw[i:i + (1 << 20)]
        r = httpx.post(gw.url + COMPLETIONS, content=pieces(), headers={"Content-Type": "application/json"},
                       timeout=60)
    else:
        r = _post(gw, COMPLETIONS, raw)
    assert r.status_code == 413, r.text[:300]
    assert _is_error_shape(r.json()) and r.json()["error"]["code"] == "request_too_large"
    assert _gw_metric(gw, "dgr_gateway_requests_total", '{status="413"}') == before + 1
    _wait_in_flight_zero(gw)
    # a large body within the bound is answered (a prompt past the context is the route's 400)
    r = _post(gw, COMPLETIONS, {"model": MODEL, "max_tokens": 2, "prompt": [1] * 200_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
