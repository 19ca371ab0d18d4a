"""`dgr serve` tried as an attacker and a careless client would try it, over fake-model workers.

Out-of-range seeds, text that is not Unicode, unexpected exceptions anywhere on a request path,
clients that leave before their session began, fields the gateway does not implement: each ends
as an OpenAI-shaped answer (a stream: an error event, then ``[DONE]``), with the in-flight gauge
back to zero, the request counted once, and nothing left on the workers. Then the process side:
the model name `--shard` prints, and SIGTERM / SIGKILL of `dgr serve` leaving no worker behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dgr.serve.server import Gateway, free_port  # noqa: E402
from dgr.shard.v1 import shard_runtime_pb2 as pb  # noqa: E402
from dgr.shard.v1 import shard_runtime_pb2_grpc as pbg  # noqa: E402
from fakeroute import start_fake  # noqa: E402

pytestmark = pytest.mark.native

MODEL = "fake-8"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def shards(native_bin):
    ws = [start_fake(native_bin, "--layers", r, "--max-sessions", "8", "--fake-delay-ms", "2") for r in ("0:4", "4:8")]
    yield ws
    for w in ws:
        w.kill()


@pytest.fixture(scope="module")
def gw(shards):
    with Gateway([w.target for w in shards], model_id=MODEL) as g:
        yield g


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


def _post(gw, path: str, body, **kw) -> httpx.Response:
    kw.setdefault("timeout", 60)
    if not isinstance(body, (bytes, str)):
        body = json.dumps(body)   # ASCII: a lone surrogate goes as the JSON escape "\ud800"
    return httpx.post(gw.url + path, content=body, headers={"Content-Type": "application/json"}, **kw)


def _events(r: httpx.Response) -> list[str]:
    return [ln[len("data: "):] for ln in r.text.splitlines() if ln.startswith("data: ")]


# ---- bad values -------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [-1, 2**64, -(2**70)])
@pytest.mark.parametrize("stream", [False, True])
def test_a_seed_out_of_range_is_a_400_naming_it(gw, shards, seed, stream):
    before = _gw_metric(gw, "dgr_gateway_requests_total", '{status="400"}')
    r = _post(gw, COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 4, "temperature": 0.7, "seed": seed,
                                "stream": stream})
    assert r.status_code == 400, r.text
    assert _is_error_shape(r.json()) and r.json()["error"]["param"] == "seed"
    assert _gw_metric(gw, "dgr_gateway_requests_total", '{status="400"}') == before + 1
    _wait_in_flight_zero(gw)
    # the edges of the range are seeds
    for ok in (0, 2**64 - 1):
        r = _post(gw, COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 0.7, "seed": ok})
        assert r.status_code == 200, r.text


def test_the_engine_refuses_sampling_the_route_cannot_carry(shards):
    """Below the API: a seed the sampling contract cannot carry is a GatewayError (400) before
    any session or slot is taken, not a ValueError inside the route session."""
    from dgr.serve.engine import Engine, GatewayError, Params

    async def main():
        eng = await Engine.connect([w.target for w in shards], model_id=MODEL)
        try:
            gen = eng.generation([256, 1, 2], Params(max_tokens=4, temperature=0.5, seed=-1))
            with pytest.raises(GatewayError) as e:
                await gen.start()
            assert e.value.status == 400
            assert eng.admission.running == 0 and not eng.active
        finally:
            await eng.close()
    asyncio.run(main())


LONE = "a\ud800b"


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"messages": [{"role": "user", "content": LONE}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]}, "messages"),
    (COMPLETIONS, {"prompt": LONE}, "prompt"),
    (COMPLETIONS, {"prompt": [LONE]}, "prompt"),
    (COMPLETIONS, {"prompt": "x", "stop": [LONE]}, "stop"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_text_that_is_not_unicode_is_a_400(gw, path, body, param, stream):
    # the lone surrogate travels as the JSON escape "\ud800" (valid JSON, not valid UTF-8)
    r = _post(gw, path, {"model": MODEL, "max_tokens": 4, "stream": stream, **body})
    assert r.status_code == 400, r.text
    assert _is_error_shape(r.json()) and r.json()["error"]["param"] == param
    _wait_in_flight_zero(gw)


def test_a_model_name_that_is_not_unicode_is_a_404(gw):
    r = _post(gw, COMPLETIONS, {"model": LONE, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404 and _is_error_shape(r.json())


# ---- unexpected exceptions --------------------------------------------------------------------

def _boom(*_a, **_k):
    raise RuntimeError("injected failure")


async def _aboom(*_a, **_k):
    raise RuntimeError("injected failure")


@pytest.mark.parametrize("where", ["prompt", "route", "text"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_an_unexpected_exception_is_an_openai_error_and_leaves_the_accounts_exact(gw, shards, monkeypatch, where,
                                                                                    path):
    """prompt: before the answer starts (tokenizing, the chat template); route: inside the route
    session (the driver); text: after the first token (looking up its text). Non-streaming: a
    500 in OpenAI's shape. Streaming: the same, or (after the 200) an error event then [DONE]."""
    eng = gw.engine
    if where == "prompt":
        monkeypatch.setattr(eng, "tokenize", _aboom)
        monkeypatch.setattr(eng, "chat_prompt", _aboom)
    elif where == "route":
        monkeypatch.setattr(eng.driver, "generate", _aboom)
    else:
        monkeypatch.setattr(eng, "pieces", _aboom)
    body = {"model": MODEL, "max_tokens": 50, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hello"})
    before = _gw_metric(gw, "dgr_gateway_requests_total", '{status="500"}')

    r = _post(gw, path, body)
    assert r.status_code == 500, r.text
    err = r.json()
    assert _is_error_shape(err) and err["error"]["type"] == "server_error" and "injected failure" in err["error"]["message"]

    r = _post(gw, path, {**body, "stream": True})
    if where == "prompt":
        assert r.status_code == 500 and _is_error_shape(r.json())
    else:
        assert r.status_code == 200, r.text
        ev = _events(r)
        assert ev[-1] == "[DONE]", ev
        last = json.loads(ev[-2])
        assert _is_error_shape(last) and last["error"]["type"] == "server_error"
    # the official client raises it as an error (not a cut stream)
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIError):
        if path == CHAT:
            list(c.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=50, stream=True))
        else:
            list(c.completions.create(model=MODEL, prompt="hello", max_tokens=50, stream=True))

    _wait_in_flight_zero(gw)
    assert _gw_metric(gw, "dgr_gateway_requests_total", '{status="500"}') == before + 3
    monkeypatch.undo()
    _wait_idle(shards)
    assert gw.engine.admission.running == 0 and not gw.engine.active


# ---- clients that leave early -----------------------------------------------------------------

def test_a_cancel_that_reaches_the_shards_before_the_session_still_ends_it(shards):
    """The cancel arrives before the head has opened the session (CancelSession finds nothing):
    the driver remembers it and ends the session at once, nothing generated, nothing left."""
    from dgr.route.driver import RouteDriver, Sampling

    async def main():
        d = await RouteDriver([w.target for w in shards]).connect()
        try:
            real_open = d.open_stream

            async def cancel_first(shard, sid, epoch, **kw):
                held = await d.cancel(sid)       # reaches every shard before the session exists
                assert not any(held)
                return await real_open(shard, sid, epoch, **kw)
            d.open_stream = cancel_first
            late = await d.generate([256, *b"cancelled early"], max_tokens=1500, sampling=Sampling(ignore_eog=True),
                                    session_id="early-1")
            d.open_stream = real_open
            # cancelled before generate() even began: nothing is opened
            await d.cancel("early-2")
            before = await d.generate([256, *b"never"], max_tokens=1500, session_id="early-2")
            # and a session id is not poisoned: the same id runs afterwards
            again = await d.generate([256, *b"fine"], max_tokens=3, session_id="early-2")
            return late, before, again
        finally:
            await d.close()

    late, before, again = asyncio.run(main())
    for r in (late, before):
        assert r.error is not None and r.error.reason.endswith("CANCELLED"), r.error
        assert r.tokens == [], f"the cancelled session generated {len(r.tokens)} tokens"
    assert again.error is None and len(again.tokens) == 3
    _wait_idle(shards)


def _send_and_leave(gw, body: dict, wait_headers: bool) -> None:
    """A raw HTTP client that sends its request and closes the connection at once (or right
    after reading the response headers)."""
    data = json.dumps(body).encode()
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        if wait_headers:
            got = b""
            while b"\r\n\r\n" not in got:
                chunk = s.recv(4096)
                assert chunk, "the gateway closed before answering"
                got += chunk
            assert got.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("stream, wait_headers", [(False, False), (True, False), (True, True)])
def test_a_client_that_leaves_at_once_leaves_nothing_generating(gw, shards, stream, wait_headers):
    """Counted in tokens the head generated, not in seconds: a session its client left at once
    must not run on (before: it ran to its end or for 5 s, hundreds of tokens)."""
    head = shards[0].target
    gen0 = _counter(head, "dgr_generated_tokens_total")
    req0 = _gw_metric(gw, "dgr_gateway_requests_total", '{status="499"}')
    n = 5
    for _ in range(n):
        _send_and_leave(gw, {"model": MODEL, "messages": [{"role": "user", "content": "leave"}], "max_tokens": 1500,
                             "temperature": 0, "stream": stream, "ignore_eos": True}, wait_headers)
    end = time.monotonic() + 30
    while _gw_metric(gw, "dgr_gateway_requests_total", '{status="499"}') < req0 + n:
        assert time.monotonic() < end, "the gateway never counted the abandoned requests"
        time.sleep(0.02)
    _wait_in_flight_zero(gw)
    _wait_idle(shards)
    generated = _counter(head, "dgr_generated_tokens_total") - gen0
    assert generated < n * 100, f"{n} abandoned sessions generated {generated:.0f} tokens"


# ---- fields the gateway does not implement ----------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("top_logprobs", 3),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("suffix", "end"), ("best_of", 2), ("mirostat", 2), ("dry_multiplier", 0.8),
])
def test_a_field_that_is_not_implemented_is_refused_not_ignored(gw, field, value):
    # (top_logprobs is chat's: completions ask with logprobs: k; test_serve_logprobs.py)
    path = COMPLETIONS if field in ("suffix", "best_of", "top_logprobs") else CHAT
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body.update({"prompt": "x"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "x"}]})
    r = _post(gw, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["code"] == "unsupported_parameter"
    # its default asks for nothing and is accepted (clients send defaults explicitly)
    # (response_format, the penalties and grammar are supported: tests/test_serve_constrained.py)
    defaults = {"logprobs": False, "top_logprobs": 0, "logit_bias": {}, "tools": [],
                "suffix": "", "best_of": 1, "mirostat": None, "dry_multiplier": None}
    r = _post(gw, path, {**body, field: defaults[field]})
    assert r.status_code == 200, r.text


def test_top_k_and_min_p_reach_the_sampler(gw):
    """top_k = 1 leaves one candidate: a hot, seeded sampler then answers exactly the greedy text,
    whatever the seed; min_p near 1 keeps only the likeliest token too. Out-of-range values are a
    400 naming the field."""
    body = {"model": MODEL, "prompt": "sampling knobs", "max_tokens": 24, "ignore_eos": True}
    greedy = _post(gw, COMPLETIONS, {**body, "temperature": 0}).json()["choices"][0]["text"]
    hot = [_post(gw, COMPLETIONS, {**body, "temperature": 2, "seed": s}).json()["choices"][0]["text"]
           for s in (1, 2, 3)]
    assert any(h != greedy for h in hot), "a hot sampler gave the greedy text for every seed: test is moot"
    for s in (1, 2, 3):
        r = _post(gw, COMPLETIONS, {**body, "temperature": 2, "seed": s, "top_k": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy, (s, r.text)
        r = _post(gw, COMPLETIONS, {**body, "temperature": 2, "seed": s, "min_p": 0.999999})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy, (s, r.text)
    for field, bad in (("top_k", -1), ("top_k", 2**31), ("min_p", 1.0), ("min_p", -0.1), ("top_k", "x")):
        r = _post(gw, COMPLETIONS, {**body, field: bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, bad, r.text)


def test_n_out_of_bounds_and_message_fields_with_values_are_refused(gw):
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    for n in (0, 9, 2**70):     # choices: 1..8 (test_serve_choices.py)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, n=n)
        assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x", "name": "bob"}],
                                  max_tokens=2)
    assert e.value.body["param"] == "messages[0].name"
    # a multi-turn client sends an earlier answer back as it got it (tool_calls: null, ...): accepted
    first = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                      temperature=0, user="someone", metadata={"k": "v"})
    echoed = first.choices[0].message.model_dump()
    again = c.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                      messages=[{"role": "user", "content": "x"}, echoed,
                                                {"role": "user", "content": "more"}])
    assert again.choices[0].finish_reason in ("stop", "length")


# ---- the dgr serve process ---------------------------------------------------------------------

def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that never comes is not running)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


class _Serve:
    """`dgr serve` in a subprocess; its stderr lines collected; ready once it says "serving"."""

    def __init__(self, native_bin: Path, *args: str) -> None:
        self.port = free_port()
        env = {**os.environ, "DGR_WORKER_BIN": str(native_bin / "dgr-worker")}
        self.proc = subprocess.Popen([sys.executable, "-c", "from dgr.main import main; main()", "serve", "--port",
                                      str(self.port), *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(60):
            self.proc.kill()
            raise AssertionError("dgr serve did not start: " + " | ".join(self.lines))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())
            if " serving " in line:
                self.ready.set()

    def wait_gone(self, pids: list[int], deadline_s: float = 30.0) -> None:
        end = time.monotonic() + deadline_s
        while (left := [p for p in pids if _alive(p)]):
            assert time.monotonic() < end, f"still running: {left}; dgr serve said: {self.lines}"
            time.sleep(0.05)


def test_serve_shard_prints_the_model_it_serves(native_bin):
    w = start_fake(native_bin)
    try:
        s = _Serve(native_bin, "--shard", w.target)
        try:
            served = httpx.get(f"http://127.0.0.1:{s.port}/v1/models").json()["data"][0]["id"]
            line = next(ln for ln in s.lines if " serving " in ln)
            assert f"serving {served} at" in line and "None" not in line
        finally:
            s.proc.send_signal(signal.SIGTERM)
            assert s.proc.wait(30) == 0, s.lines
    finally:
        w.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_serve_leaves_no_worker_behind(native_bin, sig):
    """SIGTERM drains as Ctrl-C does and stops the local workers; SIGKILL leaves the workers to
    their parent-death signal. Either way no worker outlives `dgr serve`."""
    s = _Serve(native_bin, "--fake", "--split", "0:4,4:8")
    workers: list[int] = []
    try:
        workers += _children(s.proc.pid)
        assert len(workers) == 2, workers
        r = httpx.post(f"http://127.0.0.1:{s.port}/v1/completions", timeout=30,
                       json={"model": "fake", "prompt": "x", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        # an answer in progress when the signal comes: it ends (finished, or cancelled after the
        # drain bound), it does not hold the shutdown
        streaming, ended = threading.Event(), threading.Event()

        def stream() -> None:
            try:
                with httpx.stream("POST", f"http://127.0.0.1:{s.port}/v1/completions", timeout=60,
                                  json={"model": "fake", "prompt": "x", "max_tokens": 2000, "temperature": 0,
                                        "ignore_eos": True, "stream": True}) as resp:
                    for _ in resp.iter_lines():
                        streaming.set()
            except httpx.HTTPError:
                pass
            finally:
                streaming.set()
                ended.set()
        threading.Thread(target=stream, daemon=True).start()
        assert streaming.wait(30)
        s.proc.send_signal(sig)
        code = s.proc.wait(30)
        s.wait_gone(workers)
        assert ended.wait(30), "the answer in progress never ended"
        if sig == signal.SIGTERM:
            assert code == 0, s.lines
            assert not any("Traceback" in ln for ln in s.lines), s.lines
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
        for p in workers:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
