"""`dgr serve` over fake-model workers, driven by the official `openai` package and curl.

A 2-shard route (0:4 | 4:8) of fake workers: chat and completions, streaming and not, stop
strings, concurrent requests batched on the workers, cancellation by client disconnect (every
shard back to zero sessions and zero KV), OpenAI-shaped errors, the API key, health and metrics.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
import time

import grpc
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dgr.serve.server import Gateway  # noqa: E402
from dgr.shard.v1 import shard_runtime_pb2 as pb  # noqa: E402
from dgr.shard.v1 import shard_runtime_pb2_grpc as pbg  # noqa: E402
from fakeroute import start_fake  # noqa: E402

pytestmark = pytest.mark.native

KEY = "test-key-123"
MODEL = "fake-8"


@pytest.fixture(scope="module")
def shards(native_bin):
    # a small per-decode delay keeps long answers running while a test cancels or overloads them
    ws = [start_fake(native_bin, "--layers", r, "--max-sessions", "8", "--fake-delay-ms", "2") for r in ("0:4", "4:8")]
    yield ws
    for w in ws:
        w.kill()


@pytest.fixture(scope="module")
def gw(shards):
    with Gateway([w.target for w in shards], model_id=MODEL, api_key=KEY) as g:
        yield g


def _client(gw, **kw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, **kw)


def _aclient(gw):
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)


def _metrics(target: str) -> pb.GetMetricsResponse:
    with grpc.insecure_channel(target) as ch:
        return pbg.ShardRuntimeServiceStub(ch).GetMetrics(pb.GetMetricsRequest(), timeout=5)


def _counter(target: str, name: str) -> float:
    return sum(s.value for s in _metrics(target).samples if s.name == name)


def _wait_idle(shards, deadline_s: float = 10.0) -> None:
    """Every shard holds no session and no KV cell (release is asynchronous: bounded poll)."""
    for w in shards:
        end = time.monotonic() + deadline_s
        while (load := _metrics(w.target).load).active_sessions or load.kv_cells_used:
            assert time.monotonic() < end, f"shard {w.target} still holds {load}"
            time.sleep(0.02)


def _direct(shards, prompt_ids, max_tokens):
    """The same greedy session through the route driver itself (no gateway)."""
    from dgr.route.driver import RouteDriver

    async def main():
        d = await RouteDriver([w.target for w in shards]).connect()
        try:
            r = await d.generate(prompt_ids, max_tokens=max_tokens)
            return r.tokens, (await d.detokenize(r.tokens)).decode("utf-8", errors="replace")
        finally:
            await d.close()
    return asyncio.run(main())


def test_models_lists_the_served_model(gw):
    ids = [m.id for m in _client(gw).models.list()]
    assert ids == [MODEL]


def test_completion_equals_the_route_driver_direct(gw, shards):
    c = _client(gw)
    r = c.completions.create(model=MODEL, prompt="hello world", max_tokens=12, temperature=0)
    # the fake tokenizer: BOS (256) then one token per byte
    toks, text = _direct(shards, [256, *b"hello world"], 12)
    assert r.choices[0].text == text
    assert r.usage.prompt_tokens == 12 and r.usage.completion_tokens == len(toks)
    assert r.usage.total_tokens == 12 + len(toks)
    assert r.choices[0].finish_reason == ("length" if len(toks) == 12 else "stop")


def test_streaming_chat_equals_non_streaming(gw):
    c = _client(gw)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a shard?"}]
    whole = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0)
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 1   # incremental
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    # the prompt went through the model's chat template (the fake model's: ChatML)
    assert whole.usage.prompt_tokens == 1 + len(
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat is a shard?<|im_end|>\n"
        "<|im_start|>assistant\n".encode())


def test_streaming_completion_and_stop_string(gw, shards):
    c = _client(gw)
    full = c.completions.create(model=MODEL, prompt="abc", max_tokens=24, temperature=0).choices[0].text
    stop = full[5:8]
    assert len(stop) == 3 and stop in full
    parts = [ch.choices[0] for ch in c.completions.create(model=MODEL, prompt="abc", max_tokens=24, temperature=0,
                                                          stop=[stop], stream=True)]
    text = "".join(p.text for p in parts)
    assert text == full[:full.index(stop)]
    assert parts[-1].finish_reason == "stop"
    _wait_idle(shards)   # the session stopped early by the stop string is gone from every shard


def _sse_text_events(gw, body: dict) -> tuple[list[str], dict]:
    """The text of every streamed event that carries text, in order, and the usage event."""
    texts, usage = [], {}
    with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[len("data: "):])
            usage = ev.get("usage") or usage
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    texts.append(ch["text"])
    return texts, usage


def test_a_stream_of_n_tokens_is_n_text_events(gw, shards):
    """Every sampled token reaches the client as an event of its own, in order: the worker
    answers each token at once and the gateway never merges tokens that arrive together. The
    only text that waits for the next token is a UTF-8 character whose bytes are split over
    tokens (the fake model's byte vocabulary makes these) or text that may start a stop string
    (none here); a token without text (a special token) makes no event."""
    import codecs

    from dgr.route.driver import RouteDriver, Sampling

    n, prompt = 48, [256, *b"stream me"]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    texts, usage = _sse_text_events(gw, body)

    async def direct():
        d = await RouteDriver([w.target for w in shards]).connect()
        try:
            r = await d.generate(prompt, max_tokens=n, sampling=Sampling(ignore_eog=True))
            return r.tokens, await d.head.client.pieces(r.tokens)
        finally:
            await d.close()
    tokens, pieces = asyncio.run(direct())
    assert len(tokens) == n and usage["completion_tokens"] == n
    # one event per token that completes text: its text, plus what earlier tokens left incomplete
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    expected = [t for t in (dec.decode(p) for p in pieces) if t]
    tail = dec.decode(b"", final=True)
    if tail:
        expected.append(tail)
    assert texts == expected
    # the fake model's answer is mostly single-byte text: most tokens are events of their own
    assert len(texts) > n // 2


def test_concurrent_requests_batch_on_the_workers(gw, shards):
    prompts = [f"prompt number {i} " * (i + 1) for i in range(6)]
    c = _client(gw)
    alone = [c.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0).choices[0].text
             for p in prompts]
    rows0, batches0 = _counter(shards[1].target, "dgr_batch_rows_total"), _counter(shards[1].target, "dgr_batches_total")

    async def main():
        ac = _aclient(gw)

        async def one(p):
            s = await ac.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0, stream=True)
            return "".join([ch.choices[0].text async for ch in s])
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await ac.close()

    together = asyncio.run(main())
    assert together == alone
    rows = _counter(shards[1].target, "dgr_batch_rows_total") - rows0
    batches = _counter(shards[1].target, "dgr_batches_total") - batches0
    assert rows / batches > 1.0, "concurrent requests never shared a worker batch"
    _wait_idle(shards)


def test_client_disconnect_cancels_the_session_on_every_shard(gw, shards):
    before = [_counter(w.target, "dgr_sessions_cancelled_total") for w in shards]
    c = _client(gw)
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go on forever"}],
                                       max_tokens=1500, temperature=0, stream=True)
    got = 0
    for ch in stream:
        got += bool(ch.choices and ch.choices[0].delta.content)
        if got >= 3:
            break
    assert max(_metrics(w.target).load.kv_cells_used for w in shards) > 0   # still generating
    stream.close()                    # the client goes away mid-answer
    _wait_idle(shards)
    after = [_counter(w.target, "dgr_sessions_cancelled_total") for w in shards]
    assert after[0] > before[0], "the head never saw a cancel: the session ran to its end instead"
    # the gateway counted the abandoned stream as finished (499), not as still in flight
    end = time.monotonic() + 10
    while "dgr_gateway_in_flight_requests 0.0" not in (m := httpx.get(gw.url + "/metrics").text):
        assert time.monotonic() < end, m
        time.sleep(0.02)
    assert 'dgr_gateway_requests_total{status="499"}' in m


def test_a_started_generation_that_is_never_read_still_ends_and_frees_its_slot(shards):
    """A stream's session starts before its answer does (the client may leave before reading a
    byte): closing the generation cancels the session on every shard and frees the slot."""
    from dgr.serve.engine import Engine, Params

    async def main():
        eng = await Engine.connect([w.target for w in shards], model_id=MODEL)
        try:
            gen = eng.generation([256, *b"never read"], Params(max_tokens=1500, temperature=0))
            await gen.start()
            await gen.start()                        # once only
            assert eng.admission.running == 1 and gen.session_id in eng.active
            end = time.monotonic() + 10              # the route is generating for nobody once the
            while not _metrics(shards[0].target).load.active_sessions:   # head holds the session (a
                assert time.monotonic() < end          # cancel before that ends it before it begins)
                await asyncio.sleep(0.01)
            await gen.close()
            await gen.close()                        # idempotent
            assert eng.admission.running == 0 and not eng.active
        finally:
            await eng.close()

    before = [_counter(w.target, "dgr_sessions_cancelled_total") for w in shards]
    released = [_counter(w.target, "dgr_sessions_released_total") for w in shards]
    asyncio.run(main())
    _wait_idle(shards)
    # every shard ends it cancelled, once: the head by the driver, the tail by the head and the driver
    assert [_counter(w.target, "dgr_sessions_cancelled_total") for w in shards] == [b + 1 for b in before]
    assert [_counter(w.target, "dgr_sessions_released_total") for w in shards] == released


def test_a_finished_generation_ends_released_on_every_shard(shards):
    """A session that ran to its end is released on every shard, never counted cancelled (the
    head half-closes its stream to the next shard; only a cancel cancels it)."""
    from dgr.serve.engine import Engine, Params

    async def main():
        eng = await Engine.connect([w.target for w in shards], model_id=MODEL)
        try:
            gen = eng.generation([256, *b"to the end"], Params(max_tokens=4, temperature=0))
            assert len([d async for d in gen.deltas()]) >= 1
            await gen.close()
        finally:
            await eng.close()

    for _ in range(5):      # (each round would race a stream cancel against the release)
        cancelled = [_counter(w.target, "dgr_sessions_cancelled_total") for w in shards]
        released = [_counter(w.target, "dgr_sessions_released_total") for w in shards]
        asyncio.run(main())
        _wait_idle(shards)
        assert [_counter(w.target, "dgr_sessions_cancelled_total") for w in shards] == cancelled
        assert [_counter(w.target, "dgr_sessions_released_total") for w in shards] == [r + 1 for r in released]


def test_non_streaming_disconnect_cancels_too(gw, shards):
    """A client that leaves a non-streaming request while its generation runs cancels the
    session on every shard. The client here is a raw socket that closes only once the head holds
    the session (1500 tokens past any end of text take several seconds on these shards), so the
    test does not depend on how fast a loaded machine opens it: a cancel that arrives before the
    session opens ends it before it begins, and nothing is counted cancelled then."""
    import socket
    from urllib.parse import urlsplit

    before = _counter(shards[0].target, "dgr_sessions_cancelled_total")
    u = urlsplit(gw.url)
    body = json.dumps({"model": MODEL, "prompt": "long", "max_tokens": 1500, "temperature": 0,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {u.netloc}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        sock.sendall(head + body)
        end = time.monotonic() + 10
        while not _metrics(shards[0].target).load.active_sessions:
            assert time.monotonic() < end, "the head never opened the session"
            time.sleep(0.01)
        sock.setblocking(False)
        try:
            early = sock.recv(64)
        except BlockingIOError:
            early = None                              # nothing answered yet: still generating
        assert early is None, f"the gateway answered or closed before the client left: {early!r}"
    _wait_idle(shards)
    assert _counter(shards[0].target, "dgr_sessions_cancelled_total") > before
    m = httpx.get(gw.url + "/metrics").text
    assert 'dgr_gateway_requests_total{status="499"}' in m


def test_curl_streams_server_sent_events(gw):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                       "temperature": 0, "stream": True})
    out = subprocess.run([curl, "-sS", "-N", "-H", f"Authorization: Bearer {KEY}", "-H",
                          "Content-Type: application/json", "-d", body, gw.url + "/v1/chat/completions"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    events = [ln[len("data: "):] for ln in out.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def _route_ms(resp) -> float:
    st = resp.headers["server-timing"]
    name, dur, desc = st.split(";")
    assert name == "route" and desc.startswith("desc=")
    return float(dur.removeprefix("dur="))


def test_the_route_share_of_the_first_token_is_reported(gw):
    """A non-streamed answer says in ``Server-Timing`` how long the route took to its first token
    (from the start of the request's handling); a stream says it in its last choice event, since
    its headers leave before the first token. What a client saw beyond that is HTTP's share (what
    `dgr bench serve` reports as overhead)."""
    c = _client(gw)
    msgs = [{"role": "user", "content": "hi"}]
    t = time.perf_counter()
    chunks, first = [], None
    for ch in c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, stream=True):
        chunks.append(ch)
        if first is None and ch.choices and ch.choices[0].delta.content:
            first = time.perf_counter() - t
    last = chunks[-1]
    assert last.choices[0].finish_reason is not None
    route_ms = last.model_extra["server_timing"]["route_ms"]
    assert first is not None and 0 < route_ms <= first * 1e3
    assert all("server_timing" not in (ch.model_extra or {}) for ch in chunks[:-1])
    plain = c.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    assert _route_ms(plain) > 0 and plain.parse().usage.completion_tokens >= 1
    # a refused request never reached the route: no route timing on it
    bad = httpx.post(gw.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400 and "server-timing" not in bad.headers


def test_stream_headers_leave_before_the_first_token_and_refusals_stay_http_errors(gw):
    """The 200 and the opening event come while the route prefills; a prompt the gateway can
    refuse (token ids outside the vocabulary, too long) is still an HTTP 400 when streamed."""
    hdr = {"Authorization": f"Bearer {KEY}"}
    for body in ({"prompt": [256, 10**6]}, {"prompt": "x", "max_tokens": 10**6}):
        r = httpx.post(gw.url + "/v1/completions", headers=hdr,
                       json={"model": MODEL, "stream": True, "max_tokens": 4, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] in ("prompt", "max_tokens"), r.text
    with httpx.stream("POST", gw.url + "/v1/chat/completions", headers=hdr, timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                            "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        opening = json.loads(next(ln for ln in lines if ln.startswith("data: "))[len("data: "):])
        assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_openai_shaped_errors(gw):
    c = _client(gw)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=7)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", max_tokens=10**6)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=[256, 99999], max_tokens=2)     # token ids outside the vocabulary
    assert e.value.body["param"] == "prompt"
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": []},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_over_capacity_is_429_with_retry_after(shards):
    with Gateway([w.target for w in shards], model_id=MODEL, slots=1, queue=0) as g:
        c = openai.OpenAI(base_url=g.url + "/v1", api_key="none", max_retries=0)
        busy = c.completions.create(model=MODEL, prompt="hold", max_tokens=1500, temperature=0, stream=True)
        next(iter(busy))                  # holds the only slot
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.body["code"] == "over_capacity"
        busy.close()
        _wait_idle(shards)


def test_health_metrics_and_route_view(gw, shards):
    h = httpx.get(gw.url + "/health").json()
    assert h["status"] == "ok" and h["shards"] == 2
    _client(gw).completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    m = httpx.get(gw.url + "/metrics").text
    assert 'dgr_gateway_requests_total{status="200"}' in m
    assert "# TYPE dgr_gateway_running_requests gauge" in m
    assert httpx.get(gw.url + "/api/route").status_code == 401      # the key guards /api too
    v = httpx.get(gw.url + "/api/route", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [s["range"] for s in v["shards"]] == [[0, 4], [4, 8]]
    assert [s["endpoint"] for s in v["shards"]] == [w.target for w in shards]
    assert all(s["ok"] and s["kv_cells_total"] > 0 for s in v["shards"])
    assert [(s["device"], s["vram_bytes"]) for s in v["shards"]] == [("cpu", 0), ("cpu", 0)]


def test_tls_and_the_key_when_exposed(shards, tmp_path):
    if not shutil.which("openssl"):
        pytest.skip("openssl CLI missing")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem", "-out",
                    "cert.pem", "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost"], cwd=tmp_path, check=True, capture_output=True,
                   timeout=60)
    with Gateway([w.target for w in shards], model_id=MODEL, tls_cert=tmp_path / "cert.pem",
                 tls_key=tmp_path / "key.pem") as g:
        assert g.url.startswith("https://")
        c = openai.OpenAI(base_url=g.url + "/v1", api_key="none", max_retries=0,
                          http_client=httpx.Client(verify=ssl.create_default_context(cafile=tmp_path / "cert.pem")))
        assert c.completions.create(model=MODEL, prompt="tls", max_tokens=3, temperature=0).usage.completion_tokens
        with pytest.raises(httpx.HTTPError):     # plain HTTP on the TLS port is refused
            httpx.get(g.url.replace("https://", "http://") + "/health", timeout=5).raise_for_status()


@pytest.mark.parametrize("args, message", [
    (["--host", "0.0.0.0"], "without an API key"),
    (["--host", "0.0.0.0", "--api-key", "k"], "without TLS"),
    (["--tls-cert", "/nonexistent.pem"], "--tls-cert and --tls-key go together"),
    (["--shard", "127.0.0.1:1", "--split", "0:4,4:8"], "not both"),
    (["--shard", "127.0.0.1:1"], "unreachable"),
    (["--shard-tls-ca", "/nonexistent.pem"], "go with --shard"),
    (["--shard", "127.0.0.1:1", "--shard-tls-cert", "c.pem"], "need --shard-tls-ca"),
    (["--lab-hosts", "h1,h2"], "goes with --lab"),
    (["--lab-standby"], "--lab-standby goes with --lab"),
    (["--shard", "127.0.0.1:1", "--local-standby"], "--local-standby goes with local workers"),
    (["--lab", "x", "--local-standby"], "use --lab-standby"),
    (["--standby", "127.0.0.1:2"], "--standby goes with --shard"),
    (["--shard", "127.0.0.1:1", "--standby", "127.0.0.1:1"], "already a --shard"),
    (["--lab", "nosuchlab-x", "--fake"], "nosuchlab-x"),
])
def test_cli_refuses_bad_options_in_one_line(args, message):
    import sys

    p = subprocess.run([sys.executable, "-c", "from dgr.main import main; main()", "serve", "--port", "0", *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_the_bench_load_generator_against_the_gateway(gw):
    """`dgr bench serve`'s OpenAI-API load generator (httpx): concurrent streams, the token
    counts the server reports, the route's share of each TTFT, and refusals recorded per request."""
    from dgr.bench.loadgen import run_level

    lv = asyncio.run(run_level(gw.url + "/v1", MODEL, ["hi", "what is a shard?", "yo"], max_tokens=6, api_key=KEY,
                               lane="gw"))
    assert lv.ok and lv.concurrency == 3, [r.error for r in lv.requests]
    for r in lv.requests:
        assert r.completion_tokens == 6 and r.prompt_tokens > 1 and r.text    # ignore_eos: every answer full
        assert r.route_ttft_s is not None and 0 < r.route_ttft_s <= r.ttft_s
        assert 0 < r.send_s < 5            # the clock starts when the request's body is about to be written
        assert 0 <= r.first_s <= r.last_s
    assert lv.aggregate_decode_tok_s > 0
    bad = asyncio.run(run_level(gw.url + "/v1", MODEL, ["hi"], max_tokens=4, api_key="wrong"))
    assert not bad.ok and bad.requests[0].error.startswith("HTTP 401")
    gone = asyncio.run(run_level(gw.url + "/v1", "no-such-model", ["hi"], max_tokens=4, api_key=KEY))
    assert "model_not_found" in gone.requests[0].error
