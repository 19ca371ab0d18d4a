"""Penalties and constrained sampling over a 2-shard fake-model route (synthetic weights), through
the route driver and the official `openai` client.

Penalties: each greedy choice is the best token once the frequency and presence penalties of the
window (the prompt's last ids, then the answer's) are taken off its raw log-probability; off
(``repeat_last_n: 0``) is the plain answer; out-of-range values are 400s naming the field.
Constraints: the fake model has no vocabulary to constrain with, so a schema or grammar the tail
cannot apply is a 400 naming ``response_format``/``grammar``, and the gateway is left exact; the
request-side refusals (two constraints, with ``ignore_eos``, too deep, not an object, too large).
The real model's constrained answers: tests/test_serve_real.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from fakeroute import fake_split_gateway  # noqa: E402

pytestmark = pytest.mark.native

KEY = "test-key-pen"
MODEL = "fake-8"
PROMPT_IDS = [256, *b"abab abab"]   # the fake model's vocabulary is bytes + specials


@pytest.fixture(scope="module")
def gw(native_bin):
    with fake_split_gateway(native_bin, model_id=MODEL, api_key=KEY) as g:
        yield g


def _client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)


def _post(gw, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 3, **body}
    if path.endswith("chat/completions"):
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    # ASCII-escaped JSON: a lone surrogate travels as JSON can carry it ("\\ud800")
    return httpx.post(gw.url + path, content=json.dumps(body), timeout=30,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})


def _exact(gw) -> None:
    m = httpx.get(gw.url + "/metrics").text
    assert "dgr_gateway_in_flight_requests 0.0" in m


def _driver_run(gw, sampling, n: int):
    from dgr.route.driver import RouteDriver

    async def main():
        d = await RouteDriver(gw.endpoints).connect()
        seen = []
        try:
            res = await d.generate(PROMPT_IDS, max_tokens=n, sampling=sampling, stop_on_eog=False,
                                   on_sampled=lambda st: seen.append(st))
            return res.tokens, seen
        finally:
            await d.close()
    return asyncio.run(main())


@pytest.mark.parametrize("freq,present,last_n", [(1.5, 0.0, 64), (0.0, 2.0, 4), (0.8, 0.6, 8), (-1.0, 0.0, 64)])
def test_each_greedy_choice_is_the_best_after_the_penalties(gw, freq, present, last_n):
    from dgr.route.driver import Sampling

    n = 12
    s = Sampling(top_logprobs=64, ignore_eog=True, frequency_penalty=freq, presence_penalty=present,
                 penalty_last_n=last_n, penalty_prompt=tuple(PROMPT_IDS))
    tokens, seen = _driver_run(gw, s, n)
    assert len(tokens) == n and len(seen) == n
    window = list(PROMPT_IDS)
    for tok, st in zip(tokens, seen):
        recent = window[-last_n:]
        # additive penalties keep logprob differences those of the logits
        score = {a.token_id: a.logprob - recent.count(a.token_id) * freq - (a.token_id in recent) * present
                 for a in st.top_logprobs}
        assert tok in score, "the chosen token is among the 64 most likely raw tokens"
        best = max(score.values())
        assert score[tok] == pytest.approx(best, abs=1e-4), (tok, score[tok], best)
        window.append(tok)
    plain, _ = _driver_run(gw, Sampling(ignore_eog=True), n)
    if freq > 0 or present > 0:
        # the fake model repeats itself; penalties that count push it elsewhere
        assert len(set(tokens)) >= len(set(plain))


def test_penalties_through_the_gateway(gw):
    c = _client(gw)
    kw = dict(model=MODEL, prompt=PROMPT_IDS, max_tokens=8, temperature=0)
    plain = c.completions.create(**kw).choices[0].text
    off = c.completions.create(**kw, frequency_penalty=2, presence_penalty=2, extra_body={"repeat_last_n": 0})
    assert off.choices[0].text == plain          # a window of 0 counts nothing
    one = c.completions.create(**kw, extra_body={"repeat_penalty": 1})
    assert one.choices[0].text == plain          # 1 is off
    pen = c.completions.create(**kw, frequency_penalty=2, presence_penalty=2)
    assert pen.choices[0].finish_reason in ("length", "stop")
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                     temperature=0.7, seed=5, frequency_penalty=1, presence_penalty=-1,
                                     extra_body={"repeat_penalty": 1.3, "repeat_last_n": 16})
    assert chat.choices[0].message.content is not None
    _exact(gw)


@pytest.mark.parametrize("body,param", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repeat_penalty": 11}, "repeat_penalty"),
    ({"repeat_last_n": -1}, "repeat_last_n"),
    ({"repeat_last_n": 4097}, "repeat_last_n"),
])
def test_penalties_out_of_range_are_refused_naming_the_field(gw, body, param):
    r = _post(gw, body)
    assert r.status_code == 400, r.text
    assert param in (r.json()["error"].get("param") or "") + r.json()["error"]["message"], r.text
    _exact(gw)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "response_format"),
    ({"grammar": 'root ::= "a"'}, "grammar"),
    ({"json_schema": {"type": "integer"}}, "json_schema"),
])
def test_a_tail_without_a_vocabulary_refuses_the_constraint_naming_it(gw, body, param):
    r = _post(gw, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "vocabulary" in err["message"], err
    _exact(gw)
    # streamed, the refusal comes from the tail's first step, after the 200: an error event, then [DONE]
    r = _post(gw, {**body, "stream": True})
    assert r.status_code == 200, r.text
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    errs = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert len(errs) == 1 and errs[0]["param"] == param and "vocabulary" in errs[0]["message"], events
    _exact(gw)
    # the route is left serving
    assert _post(gw, {}).status_code == 200


def test_text_response_format_asks_for_nothing(gw):
    plain = _post(gw, {"temperature": 0}).json()["choices"][0]["message"]["content"]
    r = _post(gw, {"temperature": 0, "response_format": {"type": "text"}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain


def _deep(n: int) -> dict:
    d: dict = {"type": "string"}
    for _ in range(n):
        d = {"type": "object", "properties": {"a": d}}
    return d


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar", "send one"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}, "json_schema": {}}, "json_schema",
     "send one"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format", "ignore_eos"),
    ({"response_format": {"type": "xml"}}, "response_format", "not one of"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format",
     "json_schema.schema"),
    ({"json_schema": {"enum": ["x" * 70000]}}, "json_schema", "at most 65536"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": _deep(40)}}}, "response_format",
     "levels deep"),
    ({"grammar": "root ::= " + "(" * 70 + '"a"' + ")" * 70}, "grammar", "levels deep"),
    ({"grammar": "root ::= \"\ud800\""}, "grammar", "Unicode"),
])
def test_constraint_requests_refused_at_the_gateway(gw, body, param, words):
    r = _post(gw, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    _exact(gw)


def test_the_sampling_contract_bounds_penalties_and_grammars_in_python_too():
    from dgr.protocol.bundle import ShardProtocolError
    from dgr.protocol.frame_checks import MAX_GRAMMAR_BYTES, check_sampling
    from dgr.shard.v1 import shard_runtime_pb2 as pb

    check_sampling(pb.SamplingParams(repeat_penalty=10, frequency_penalty=2, presence_penalty=-2, penalty_last_n=4,
                                     penalty_prompt_tokens=[1, 2, 3, 4], grammar="x" * MAX_GRAMMAR_BYTES),
                   n_vocab=49152)
    for bad, words in [(dict(penalty_last_n=2, penalty_prompt_tokens=[1, 2, 3]), "more than penalty_last_n"),
                       (dict(penalty_last_n=2, penalty_prompt_tokens=[49152]), "outside"),
                       (dict(grammar="é" * (MAX_GRAMMAR_BYTES // 2 + 1)), "bytes"),
                       (dict(json_schema="{}", ignore_eog=True), "ignore_eog")]:
        with pytest.raises(ShardProtocolError, match=words):
            check_sampling(pb.SamplingParams(**bad), n_vocab=49152)
