"""`dgr serve` logprobs over a 2-shard fake-model route, through the official `openai` client.

Chat (`logprobs`, `top_logprobs`) and completions (`logprobs: k`), streaming and not: one entry
per generated token, the tokens spelling the answer, alternatives most likely first, the greedy
token the most likely one, a stream's entries equal to the whole answer's; and the refusals
(`top_logprobs` without `logprobs`, out of bounds, with `echo`).
"""

from __future__ import annotations

import math

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from fakeroute import fake_split_gateway  # noqa: E402

pytestmark = pytest.mark.native

KEY = "test-key-lp"
MODEL = "fake-8"
MSG = [{"role": "user", "content": "tell me about logprobs"}]


@pytest.fixture(scope="module")
def gw(native_bin):
    with fake_split_gateway(native_bin, model_id=MODEL, api_key=KEY) as g:
        yield g


def _client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)


def _check_entry(e, k: int) -> None:
    assert math.isfinite(e.logprob) and e.logprob <= 1e-6
    assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    assert len(e.top_logprobs) == k
    lps = [a.logprob for a in e.top_logprobs]
    assert lps == sorted(lps, reverse=True) and all(v <= 1e-6 for v in lps)
    if k:   # greedy: the sampled token is the most likely one
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)


def test_chat_logprobs_one_entry_per_token_spelling_the_answer(gw):
    r = _client(gw).chat.completions.create(model=MODEL, messages=MSG, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.content) == r.usage.completion_tokens == 12
    for e in lp.content:
        _check_entry(e, 3)
    assert "".join(e.token for e in lp.content) == r.choices[0].message.content


def test_chat_logprobs_without_alternatives_and_without_logprobs(gw):
    c = _client(gw)
    r = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, temperature=0, logprobs=True)
    assert len(r.choices[0].logprobs.content) == 6
    for e in r.choices[0].logprobs.content:
        _check_entry(e, 0)
    plain = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content   # asking changes no token


def test_chat_stream_logprobs_equal_the_whole_answer(gw):
    c = _client(gw)
    whole = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=10, temperature=0,
                                      logprobs=True, top_logprobs=2)
    got = []
    text = ""
    for ch in c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=10, temperature=0,
                                        logprobs=True, top_logprobs=2, stream=True):
        if not ch.choices:
            continue
        text += ch.choices[0].delta.content or ""
        if ch.choices[0].logprobs is not None:
            got.extend(ch.choices[0].logprobs.content)
    assert text == whole.choices[0].message.content
    assert [(e.token, round(e.logprob, 5), [a.token for a in e.top_logprobs]) for e in got] == \
           [(e.token, round(e.logprob, 5), [a.token for a in e.top_logprobs]) for e in whole.choices[0].logprobs.content]


@pytest.mark.parametrize("prompt", ["once upon a time", "hi", "zq"])
def test_completion_logprobs_shape(gw, prompt):
    c = _client(gw)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n == 8
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(v, abs=1e-5) and t in top
    streamed = [ch.choices[0].logprobs for ch in c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2, stream=True)
        if ch.choices and ch.choices[0].logprobs is not None]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


@pytest.mark.parametrize("body,param", [
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),                   # without logprobs: true
    ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "logprobs": 2**70}, "logprobs"),
    ({"prompt": "x", "logprobs": 1.5}, "logprobs"),
    ({"prompt": "x", "logprobs": 1, "echo": True}, "echo"),
    ({"prompt": "x", "top_logprobs": 2}, "top_logprobs"),                      # a chat field
])
def test_refused_logprob_requests_name_the_field(gw, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(gw.url + path, json={"model": MODEL, "max_tokens": 2, **body},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 400, r.text
    assert param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"]
    m = httpx.get(gw.url + "/metrics").text
    assert "dgr_gateway_in_flight_requests 0.0" in m


def test_stop_string_and_sampling_keep_one_entry_per_token(gw):
    c = _client(gw)
    whole = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, temperature=0)
    stop = whole.choices[0].message.content[3:5]
    r = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, temperature=0, stop=[stop],
                                  logprobs=True, top_logprobs=1)
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].message.content
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    assert "".join(e.token for e in entries).startswith(r.choices[0].message.content + stop)
    s = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=16, temperature=1.5, seed=11,
                                  logprobs=True, top_logprobs=4)
    assert len(s.choices[0].logprobs.content) == s.usage.completion_tokens
    for e in s.choices[0].logprobs.content:   # a sampled token need not be the most likely one
        assert e.logprob <= e.top_logprobs[0].logprob + 1e-5 and len(e.top_logprobs) == 4


def test_completion_logprobs_false_is_off_and_true_is_no_alternatives(gw):
    c = _client(gw)
    off = c.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0, extra_body={"logprobs": False})
    assert off.choices[0].logprobs is None
    on = c.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0, extra_body={"logprobs": True})
    lp = on.choices[0].logprobs
    assert len(lp.tokens) == 3 and lp.top_logprobs == [{}, {}, {}]
    assert on.choices[0].text == off.choices[0].text


# ---- logit_bias (here: it shares the route and reads its effect through logprobs) ---------------

PROMPT_IDS = [256, *b"bias me"]     # token ids: the fake model's vocabulary is bytes + specials


def _greedy_tokens(c, **kw):
    r = c.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=0, logprobs=1, **kw)
    return r.choices[0].logprobs.tokens, r


def _route_ids(gw, n: int, bias: tuple[tuple[int, float], ...] = ()) -> list[int]:
    """The greedy answer's token ids, from the route driver itself."""
    import asyncio

    from dgr.route.driver import RouteDriver, Sampling

    async def main():
        d = await RouteDriver(gw.endpoints).connect()
        try:
            return (await d.generate(PROMPT_IDS, max_tokens=n, sampling=Sampling(logit_bias=bias))).tokens
        finally:
            await d.close()
    return asyncio.run(main())


def test_logit_bias_bans_and_forces_tokens(gw):
    c = _client(gw)
    plain, _ = _greedy_tokens(c)
    ids = _route_ids(gw, 6)
    assert len(ids) == 6
    # the route driver: banning the greedy first token puts another one first
    banned_ids = _route_ids(gw, 6, ((ids[0], -100.0),))
    assert banned_ids[0] != ids[0] and ids[0] not in banned_ids
    # the gateway: the same ban; the token chosen first is no longer the raw most likely one, whose
    # logprob (reported raw, before the bias) stays at the top of the alternatives
    _, r1 = _greedy_tokens(c, logit_bias={str(ids[0]): -100})
    lp = r1.choices[0].logprobs
    assert lp.top_logprobs[0] == {plain[0]: pytest.approx(_greedy_tokens(c)[1].choices[0].logprobs.token_logprobs[0])}
    assert lp.token_logprobs[0] < max(lp.top_logprobs[0].values()) - 1e-6
    # force one token: +100 makes it every greedy (and every sampled) choice
    forced, _ = _greedy_tokens(c, logit_bias={str(ids[0]): 100})
    assert forced == [plain[0]] * 6
    assert _route_ids(gw, 6, ((ids[0], 100.0),)) == [ids[0]] * 6
    hot = c.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=1.5, seed=3, logprobs=1,
                               logit_bias={str(ids[0]): 100})
    assert hot.choices[0].logprobs.tokens == [plain[0]] * 6
    # an empty bias asks for nothing: the plain answer
    assert _greedy_tokens(c, logit_bias={})[0] == plain


@pytest.mark.parametrize("bias", [{"abc": 1}, {"-1": 1}, {"7": 101}, {"7": -100.5}, {"7": 1, "007": 2},
                                  {str(i): 1 for i in range(1025)}, {"99999999": 1}])
def test_bad_logit_bias_is_refused_naming_it(gw, bias):
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 2,
                                                          "logit_bias": bias},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "logit_bias", r.text
    assert "dgr_gateway_in_flight_requests 0.0" in httpx.get(gw.url + "/metrics").text


def test_the_sampling_contract_bounds_logit_bias_in_python_too():
    from dgr.protocol.bundle import ShardProtocolError
    from dgr.protocol.frame_checks import MAX_LOGIT_BIAS, check_sampling
    from dgr.shard.v1 import shard_runtime_pb2 as pb

    ok = pb.SamplingParams(logit_bias=[pb.TokenBias(token_id=i, bias=-100.0) for i in range(MAX_LOGIT_BIAS)])
    check_sampling(ok, n_vocab=49152)
    ok.logit_bias.append(pb.TokenBias(token_id=MAX_LOGIT_BIAS, bias=0.0))
    with pytest.raises(ShardProtocolError, match="1025 logit_bias entries"):
        check_sampling(ok, n_vocab=49152)
