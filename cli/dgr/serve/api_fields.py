"""The OpenAI request bodies the gateway accepts, and how it answers logprobs.

Each field is supported, accepted as a hint that asks nothing of the answer, or refused with a
400 that names it unless its value asks for nothing (docs/serve.md, "Request fields"): nothing
a client asks for is silently ignored.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from .choices import MAX_CHOICES
from .engine import GatewayError, Params, TokenLogprob

MAX_STOP = 4
MAX_LOGIT_BIAS = 1024         # logit_bias entries (the sampling contract's bound)
MAX_BIAS = 100.0
MAX_TOP_LOGPROBS = 20         # alternatives per token (OpenAI's bound for chat; the worker's is 64)
LOGPROB_FLOOR = -9999.0       # what a logprob of -inf (a token masked out) reads as in JSON
SEED_MAX = 2**64 - 1          # the sampling contract's seed is a uint64
MAX_PENALTY_LAST_N = 4096     # repeat_last_n (the sampling contract's window bound)
DEFAULT_PENALTY_LAST_N = 64   # llama-server's repeat_last_n
MAX_GRAMMAR_BYTES = 65536     # a grammar or a JSON schema (UTF-8 bytes of its JSON text)
MAX_GRAMMAR_NESTING = 64      # brackets deep (the tail's bound: both are parsed recursively there)

# Request fields that would change the answer and that this gateway does not implement: refused
# with a 400 naming the field unless the value asks for nothing (its default). Nothing a client
# asks for is silently ignored (docs/serve.md, "Request fields").
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "top_logprobs": lambda v: v is None or v == 0,     # (on completions; chat has it)
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v == "none",
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v is None or v == "none",
    "suffix": lambda v: v is None or v == "",
    "best_of": lambda v: v is None or v == 1,
    "modalities": lambda v: v is None or v == ["text"],
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "store": lambda v: v is None or v is False,
    "reasoning_effort": lambda v: v is None,
}
# Fields that ask nothing of the answer (metadata, hints): accepted and not used.
_HINTS = frozenset({"user", "metadata", "service_tier", "parallel_tool_calls", "cache_prompt",
                    "safety_identifier", "prompt_cache_key"})


def _refuse_extras(extra: dict[str, Any] | None, where: str = "") -> None:
    """A 400 naming the first field that asks for something this gateway does not do."""
    for name, value in (extra or {}).items():
        if not where and name in _HINTS:
            continue
        is_default = _UNSUPPORTED.get(name) if not where else None
        if is_default is not None:
            try:
                ok = bool(is_default(value))
            except Exception:  # noqa: BLE001 - an odd value is not the default
                ok = False
            if ok:
                continue
        elif value is None or value == [] or value == {} or value == "":
            continue      # an unknown field that asks for nothing
        field = f"{where}{name}"
        raise GatewayError(400, f"{field} is not supported by this gateway"
                           + (" (only its default is accepted)" if name in _UNSUPPORTED and not where else ""),
                           param=field, code="unsupported_parameter")


def text_field(value: str, param: str) -> str:
    """``value``, refused with a 400 when it is not valid Unicode text (a lone surrogate such as
    ``"\\ud800"``, which JSON can carry but UTF-8 cannot)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise GatewayError(400, f"{param}: not valid Unicode text (lone surrogate {ascii(value[exc.start])[1:-1]} "
                           f"at character {exc.start})", param=param, code="invalid_value") from None
    return value


def _check_nesting(text: str, param: str, *, gbnf: bool) -> None:
    """A 400 when brackets nest deeper than the tail parses (outside quoted strings and, in GBNF,
    character classes; the same count as worker/src/worker/grammar.cpp)."""
    depth = most = 0
    quote = ""
    i = 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c == '"':
            quote = '"'
        elif gbnf and c == "[":
            quote = "]"
        elif c in ("(" if gbnf else "{["):
            depth += 1
            most = max(most, depth)
        elif c in (")" if gbnf else "}]") and depth > 0:
            depth -= 1
        i += 1
    if most > MAX_GRAMMAR_NESTING:
        raise GatewayError(400, f"{param} nests {most} levels deep, at most {MAX_GRAMMAR_NESTING}", param=param,
                           code="invalid_value")


class ApiRequest(BaseModel):
    # unknown fields are accepted by the parser and then refused unless they ask for nothing
    # (_refuse_extras); NaN and infinities are no numbers a request may carry
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0, le=2**31 - 1)     # llama-server's: 0 is off
    min_p: Optional[float] = Field(None, ge=0, lt=1)           # llama-server's: 0 is off
    seed: Optional[int] = Field(None, ge=0, le=SEED_MAX)
    stop: Optional[Union[str, list[str]]] = None
    n: Optional[int] = Field(None, ge=1, le=MAX_CHOICES)   # choices: that many sessions side by side
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    ignore_eos: bool = False       # llama-server's extension: generate through end-of-generation tokens
    logit_bias: Optional[dict[str, float]] = None   # token id (a decimal string) -> bias in [-100, 100]
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repeat_penalty: Optional[float] = Field(None, gt=0, le=10)               # llama-server's: 1 is off
    repeat_last_n: Optional[int] = Field(None, ge=0, le=MAX_PENALTY_LAST_N)  # llama-server's window
    response_format: Optional[dict[str, Any]] = None   # text, json_object or json_schema
    grammar: Optional[str] = None                      # llama-server's GBNF grammar (root rule "root")
    json_schema: Optional[dict[str, Any]] = None       # llama-server's schema extension

    def params(self) -> Params:
        _refuse_extras(self.model_extra)
        stop = [text_field(x, "stop") for x in ([self.stop] if isinstance(self.stop, str) else list(self.stop or []))]
        if len(stop) > MAX_STOP:
            raise GatewayError(400, f"at most {MAX_STOP} stop sequences, got {len(stop)}", param="stop")
        return Params(max_tokens=self.max_completion_tokens or self.max_tokens,
                      temperature=1.0 if self.temperature is None else self.temperature,
                      top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                      min_p=self.min_p or 0.0, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
                      logprobs=self.logprobs_wanted(), logit_bias=self.biases(),
                      repeat_penalty=1.0 if self.repeat_penalty is None else self.repeat_penalty,
                      frequency_penalty=self.frequency_penalty or 0.0, presence_penalty=self.presence_penalty or 0.0,
                      repeat_last_n=DEFAULT_PENALTY_LAST_N if self.repeat_last_n is None else self.repeat_last_n,
                      **self.constraint())

    def constraint(self) -> dict[str, str]:
        """The grammar or JSON schema the answer is constrained to (``{}``: none), from
        ``response_format`` (OpenAI's), ``grammar`` or ``json_schema`` (llama-server's)."""
        asked: list[tuple[str, dict[str, str]]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":     # any JSON object (llama-server: an optional "schema" narrows it)
                schema = rf.get("schema", {"type": "object"})
                asked.append(("response_format", {"json_schema": self._schema_text(schema, "response_format")}))
            elif kind == "json_schema":
                wrapper = rf.get("json_schema")
                if not isinstance(wrapper, dict) or not isinstance(wrapper.get("schema"), dict):
                    raise GatewayError(400, "response_format json_schema needs json_schema.schema (a JSON schema "
                                       "object)", param="response_format", code="invalid_value")
                asked.append(("response_format",
                              {"json_schema": self._schema_text(wrapper["schema"], "response_format")}))
            elif kind != "text":
                raise GatewayError(400, f"response_format type {ascii(kind)} is not one of text, json_object, "
                                   "json_schema", param="response_format", code="invalid_value")
        if self.json_schema is not None:
            asked.append(("json_schema", {"json_schema": self._schema_text(self.json_schema, "json_schema")}))
        if self.grammar:
            g = text_field(self.grammar, "grammar")
            if len(g.encode("utf-8")) > MAX_GRAMMAR_BYTES:
                raise GatewayError(400, f"grammar is {len(g.encode('utf-8'))} bytes, at most {MAX_GRAMMAR_BYTES}",
                                   param="grammar", code="invalid_value")
            _check_nesting(g, "grammar", gbnf=True)
            asked.append(("grammar", {"grammar": g}))
        if len(asked) > 1:
            raise GatewayError(400, f"{asked[0][0]} and {asked[1][0]} both constrain the answer: send one",
                               param=asked[1][0], code="invalid_value")
        if asked and self.ignore_eos:
            raise GatewayError(400, "a constrained answer ends where its grammar is complete: not together with "
                               "ignore_eos", param=asked[0][0], code="invalid_value")
        return {**asked[0][1], "constraint_param": asked[0][0]} if asked else {}

    @staticmethod
    def _schema_text(schema: Any, param: str) -> str:
        if not isinstance(schema, dict):
            raise GatewayError(400, f"{param}: the schema must be a JSON object", param=param, code="invalid_value")
        try:
            text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
            size = len(text.encode("utf-8"))
        except (ValueError, UnicodeEncodeError, RecursionError) as exc:
            raise GatewayError(400, f"{param}: the schema is not JSON text: {exc}", param=param,
                               code="invalid_value") from None
        if size > MAX_GRAMMAR_BYTES:
            raise GatewayError(400, f"{param}: the schema is {size} bytes of JSON, at most {MAX_GRAMMAR_BYTES}",
                               param=param, code="invalid_value")
        _check_nesting(text, param, gbnf=False)
        return text

    def biases(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs, checked here but for the vocabulary (the
        generation checks that against the route's n_vocab)."""
        items = list((self.logit_bias or {}).items())
        if len(items) > MAX_LOGIT_BIAS:
            raise GatewayError(400, f"logit_bias has {len(items)} entries, at most {MAX_LOGIT_BIAS}",
                               param="logit_bias", code="invalid_value")
        out = []
        for k, v in items:
            if not re.fullmatch(r"[0-9]{1,10}", k.strip()):
                raise GatewayError(400, f"logit_bias key {ascii(k)} is not a token id", param="logit_bias",
                                   code="invalid_value")
            if not -MAX_BIAS <= v <= MAX_BIAS:
                raise GatewayError(400, f"logit_bias of token {k.strip()} is {v}, outside [-100, 100]",
                                   param="logit_bias", code="invalid_value")
            if any(t == int(k) for t, _ in out):
                raise GatewayError(400, f"logit_bias names token {int(k)} twice", param="logit_bias",
                                   code="invalid_value")
            out.append((int(k), float(v)))
        return tuple(out)

    def logprobs_wanted(self) -> int | None:
        """None: no logprobs; k: each token's logprob and its k most likely alternatives."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self, i: int) -> str:
        # what a client echoes back from an answer (tool_calls: null, refusal: null, ...) asks
        # for nothing; a field with a value (a name, tool calls) is refused, not dropped
        _refuse_extras(self.model_extra, where=f"messages[{i}].")
        if self.content is None or isinstance(self.content, str):
            return text_field(self.content or "", "messages")
        parts = []
        for p in self.content:
            if p.get("type") != "text":
                raise GatewayError(400, f"content part type {ascii(p.get('type'))} is not supported (text only)",
                                   param="messages")
            parts.append(text_field(str(p.get("text", "")), "messages"))
        return "".join(parts)


class ChatRequest(ApiRequest):
    messages: list[_Message] = Field(min_length=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def logprobs_wanted(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise GatewayError(400, "top_logprobs needs logprobs: true", param="top_logprobs",
                                   code="invalid_value")
            return None
        return self.top_logprobs or 0


class CompletionRequest(ApiRequest):
    prompt: Union[str, list[str], list[int]]
    echo: bool = False
    # k alternatives; true/false as chat's (a client that sends false asks for none)
    logprobs: Optional[Union[StrictBool, int]] = None

    def logprobs_wanted(self) -> int | None:
        if self.logprobs is None or self.logprobs is False:
            return None
        k = 0 if self.logprobs is True else self.logprobs
        if not 0 <= k <= MAX_TOP_LOGPROBS:
            raise GatewayError(400, f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}", param="logprobs",
                               code="invalid_value")
        if self.echo:
            # the prompt's own logprobs would be the answer's first entries: not computed here
            raise GatewayError(400, "logprobs together with echo (the prompt's logprobs) is not supported",
                               param="echo", code="unsupported_parameter")
        return k


def _lp(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def logprobs_json(lps: list[TokenLogprob], chat: bool, offset0: int) -> dict[str, Any]:
    """Tokens' logprobs as OpenAI shapes them: chat ``{"content": [...]}``, completions
    ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (``offset0``: echoed text)."""
    def tok(b: bytes) -> str:
        return b.decode("utf-8", errors="replace")
    if chat:
        return {"content": [{"token": tok(t.piece), "logprob": _lp(t.logprob), "bytes": list(t.piece),
                             "top_logprobs": [{"token": tok(p), "logprob": _lp(v), "bytes": list(p)}
                                              for p, v in t.top]} for t in lps],
                "refusal": None}
    def top(t: TokenLogprob) -> dict[str, float]:
        out: dict[str, float] = {}
        for p, v in t.top:            # two tokens may read alike (bytes of one character): the
            out.setdefault(tok(p), _lp(v))   # more likely one keeps the key
        return out
    return {"tokens": [tok(t.piece) for t in lps], "token_logprobs": [_lp(t.logprob) for t in lps],
            "top_logprobs": [top(t) for t in lps], "text_offset": [offset0 + t.offset for t in lps]}
