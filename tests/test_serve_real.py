"""`dgr serve` over the real SmolLM2-135M (real lane): the model's own chat template on the
head (also of a sliced head), a chat answer through a 2-shard route equal to the whole model's,
and the template's text where llama.cpp's engine formats SmolLM2's ChatML."""

from __future__ import annotations

import os

import grpc
import pytest

openai = pytest.importorskip("openai")

from dgr.route.local import LocalRoute  # noqa: E402
from dgr.serve.server import Gateway  # noqa: E402
from dgr.shard.v1 import shard_runtime_pb2 as pb  # noqa: E402
from dgr.shard.v1 import shard_runtime_pb2_grpc as pbg  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.native]


@pytest.fixture(scope="module")
def routes(smollm2_path, native_bin):
    t = os.cpu_count() or 1
    with LocalRoute(smollm2_path, [(0, 15), (15, 30)], slices=True, threads=t) as r, \
            LocalRoute(smollm2_path, [(0, 30)], threads=t) as w:
        yield r, w


def _template(target: str, messages) -> pb.ApplyChatTemplateResponse:
    with grpc.insecure_channel(target) as ch:
        return pbg.ShardRuntimeServiceStub(ch).ApplyChatTemplate(pb.ApplyChatTemplateRequest(
            messages=[pb.ChatMessage(role=a, content=b) for a, b in messages], add_assistant=True), timeout=10)


def test_head_formats_with_the_models_template(routes):
    r, w = routes
    msgs = [("system", "Be brief."), ("user", "Hi!")]
    whole, sliced = _template(w.endpoints[0], msgs), _template(r.endpoints[0], msgs)
    assert whole.text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                          "<|im_start|>assistant\n")
    assert "<|im_start|>" in whole.template_source          # the GGUF's own Jinja source
    assert sliced.text == whole.text and sliced.template_source == whole.template_source


def test_chat_through_the_split_equals_the_whole_model(routes):
    r, w = routes
    answers = []
    for eps in (r.endpoints, w.endpoints):
        with Gateway(eps, model_id="smollm2") as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
            out = c.chat.completions.create(model="smollm2", temperature=0, max_tokens=24, messages=[
                {"role": "user", "content": "What is the capital of France?"}])
            answers.append(out.choices[0].message.content)
    assert answers[0] == answers[1]
    assert "Paris" in answers[0]


def test_logprobs_through_the_split_match_the_whole_model(routes):
    """The tail's log-probabilities over a split equal the whole model's (within f32 noise), and
    the tokens they list spell the answer."""
    r, w = routes
    got = []
    for eps in (r.endpoints, w.endpoints):
        with Gateway(eps, model_id="smollm2") as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
            out = c.chat.completions.create(model="smollm2", temperature=0, max_tokens=12, logprobs=True,
                                            top_logprobs=3, messages=[{"role": "user", "content": "Name a colour."}])
            lp = out.choices[0].logprobs.content
            assert len(lp) == out.usage.completion_tokens
            assert "".join(e.token for e in lp).startswith(out.choices[0].message.content)
            got.append(lp)
    split, whole = got
    assert [e.token for e in split] == [e.token for e in whole]
    for a, b in zip(split, whole):
        assert a.logprob == pytest.approx(b.logprob, abs=0.05)
        assert a.top_logprobs[0].token == a.token      # greedy: the most likely token


def test_logit_bias_through_the_split_matches_the_whole_model(routes):
    """A ban (-100) of the greedy answer's first token changes the answer, the same way over the
    split as on the whole model."""
    from dgr.protocol.client import WorkerClient

    r, w = routes
    prompt = "The capital of France is"
    answers = []
    for eps in (r.endpoints, w.endpoints):
        with Gateway(eps, model_id="smollm2") as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
            plain = c.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0, logprobs=1)
            first = plain.choices[0].logprobs.tokens[0]
            with WorkerClient(eps[0]) as head:
                tid = head.tokenize(first, add_special=False)
            assert len(tid) == 1, (first, tid)
            banned = c.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0,
                                          logit_bias={str(tid[0]): -100})
            assert banned.choices[0].text != plain.choices[0].text
            answers.append(banned.choices[0].text)
    assert answers[0] == answers[1]


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}


def test_constrained_answers_follow_their_schema_and_grammar(routes):
    """response_format json_schema: the answer parses and has exactly the schema's fields and types
    (bounded schema: it always completes), over the split as on the whole model; json_object: an
    object; llama-server's grammar: one of its alternatives."""
    import json

    r, w = routes
    answers = []
    for eps in (r.endpoints, w.endpoints):
        with Gateway(eps, model_id="smollm2") as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
            msgs = [{"role": "user", "content": "What is the capital of France and how many people live there?"}]
            out = c.chat.completions.create(model="smollm2", temperature=0, max_tokens=96, messages=msgs,
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": "city", "schema": CITY, "strict": True}})
            ch = out.choices[0]
            assert ch.finish_reason == "stop", ch
            obj = json.loads(ch.message.content)
            assert set(obj) == {"city", "population"}, obj
            assert isinstance(obj["city"], str) and len(obj["city"]) <= 24
            assert isinstance(obj["population"], int) and not isinstance(obj["population"], bool)
            answers.append(ch.message.content)
            # streamed, the same answer
            parts = [e.choices[0].delta.content or "" for e in c.chat.completions.create(
                model="smollm2", temperature=0, max_tokens=96, messages=msgs, stream=True,
                response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
                if e.choices]
            assert "".join(parts) == ch.message.content
            anyobj = c.chat.completions.create(model="smollm2", temperature=0, max_tokens=160, messages=msgs,
                                               response_format={"type": "json_object"}).choices[0]
            assert anyobj.message.content.lstrip().startswith("{"), anyobj
            if anyobj.finish_reason == "stop":
                assert isinstance(json.loads(anyobj.message.content), dict)
            yn = c.completions.create(model="smollm2", prompt="Is Paris in France? Answer:", max_tokens=4,
                                      temperature=0, extra_body={"grammar": 'root ::= " yes" | " no"'})
            assert yn.choices[0].text in (" yes", " no") and yn.choices[0].finish_reason == "stop"
            bad = c.with_options(max_retries=0)
            with pytest.raises(openai.BadRequestError) as e:
                bad.chat.completions.create(model="smollm2", messages=msgs, max_tokens=4,
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": "x", "schema": {"type": "object", "$ref": "#/nowhere"}}})
            assert e.value.body["param"] == "response_format"
    assert answers[0] == answers[1]


def test_penalties_over_the_split_equal_the_whole_model(routes):
    r, w = routes
    answers = []
    for eps in (r.endpoints, w.endpoints):
        with Gateway(eps, model_id="smollm2") as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
            kw = dict(model="smollm2", prompt="One, two, three, four,", max_tokens=16, temperature=0)
            plain = c.completions.create(**kw).choices[0].text
            pen = c.completions.create(**kw, frequency_penalty=1.5, presence_penalty=0.5,
                                       extra_body={"repeat_penalty": 1.2}).choices[0].text
            answers.append((plain, pen))
    assert answers[0] == answers[1]
    assert answers[0][0] != answers[0][1]      # counting on, greedy repeats digits the penalties push away
