"""The gateway's pure parts: incremental text with stop strings, one delta per token, admission (no workers)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")

from dgr.serve.engine import Admission, Engine, GatewayError, Params, _TextStream  # noqa: E402


def _feed(stop, chunks):
    ts = _TextStream(stop)
    out = [ts.push(c) for c in chunks]
    out.append(ts.push(b"", final=True))
    return "".join(out), ts.stopped


def test_utf8_split_across_tokens_is_decoded_whole():
    data = "héllo wörld €".encode()
    chunks = [data[i:i + 1] for i in range(len(data))]   # every code point split over tokens
    ts = _TextStream([])
    parts = [ts.push(c) for c in chunks] + [ts.push(b"", final=True)]
    assert "".join(parts) == "héllo wörld €"
    assert all("\ufffd" not in p for p in parts)           # never a half character on the way


def test_invalid_bytes_match_a_one_shot_decode():
    data = bytes(range(120, 256)) + b"ok"
    text, _ = _feed([], [data[i:i + 3] for i in range(0, len(data), 3)])
    assert text == data.decode("utf-8", errors="replace")


def test_stop_string_split_over_pieces_is_cut_and_never_sent():
    text, stopped = _feed(["END"], [b"one two E", b"N", b"D three"])
    assert stopped and text == "one two "


def test_partial_stop_prefix_is_released_when_it_does_not_match():
    ts = _TextStream(["END"])
    assert ts.push(b"abc E") == "abc "      # "E" may start END: held back
    assert ts.push(b"x") == "Ex"
    assert not ts.stopped


def test_earliest_of_several_stop_strings_wins():
    text, stopped = _feed(["zz", "b"], [b"aaab", b"zz"])
    assert stopped and text == "aaa"


def test_admission_queues_then_refuses_with_retry_after():
    async def main():
        adm = Admission(slots=1, queue=1)
        await adm.acquire()
        waiter = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)                 # let it queue
        assert adm.waiting == 1
        with pytest.raises(GatewayError) as e:
            await adm.acquire()
        assert e.value.status == 429 and e.value.retry_after
        adm.release()                          # hands the slot to the waiter
        await waiter
        assert adm.running == 1 and adm.waiting == 0
        adm.release()
        assert adm.running == 0

    asyncio.run(main())


def test_cancelled_waiter_does_not_leak_a_slot():
    async def main():
        adm = Admission(slots=1, queue=2)
        await adm.acquire()
        w = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)
        w.cancel()
        with pytest.raises(asyncio.CancelledError):
            await w
        adm.release()
        assert adm.running == 0 and adm.waiting == 0
        await adm.acquire()                     # the slot is free again
        assert adm.running == 1

    asyncio.run(main())


class _BurstDriver:
    """A route driver whose session delivers every token at once, before the gateway's reader
    runs again (as a reader that fell behind finds them: several tokens queued)."""

    def __init__(self, tokens):
        self.tokens = tokens

    async def generate(self, prompt_ids, *, max_tokens, sampling, session_id, on_token):
        from dgr.route.generation import GenerationResult
        from dgr.route.telemetry import GenerationTelemetry

        for t in self.tokens[:max_tokens]:
            on_token(t)
        tel = GenerationTelemetry(request_id="r", session_id=session_id, route_epoch=1, route=[],
                                  prompt_tokens=len(prompt_ids))
        return GenerationResult(session_id, list(prompt_ids), list(self.tokens[:max_tokens]), "length", tel)

    async def cancel(self, session_id, epoch=0):
        return [True]


class _BurstEngine(Engine):
    def __init__(self, pieces, tokens):
        self._driver, self.router = _BurstDriver(tokens), None
        self.max_positions = 1000
        self.admission = Admission(1, 1)
        self.active = {}
        self._table = pieces

    async def pieces(self, toks):
        return [self._table[t] for t in toks]


def _deltas(pieces, tokens, stop=()):
    async def main():
        gen = _BurstEngine(pieces, tokens).generation([1, 2, 3], Params(max_tokens=len(tokens), stop=list(stop)))
        return [(d.text, d.finish_reason) async for d in gen.deltas()], gen
    return asyncio.run(main())


def test_every_token_is_its_own_delta_even_when_tokens_arrive_together():
    pieces = {i: f" w{i}".encode() for i in range(10)}
    got, gen = _deltas(pieces, list(range(10)))
    assert got == [(f" w{i}", None) for i in range(10)] + [("", "length")]
    assert gen.usage.completion_tokens == 10 and gen.finish_reason == "length"


def test_only_an_incomplete_character_and_a_possible_stop_string_are_held_back():
    euro = "€".encode()                       # three bytes, one per token below
    pieces = {0: b"a", 1: euro[:1], 2: euro[1:2], 3: euro[2:], 4: b" b", 5: b" E", 6: b"N", 7: b"x", 8: b" c"}
    got, _ = _deltas(pieces, list(range(9)), stop=["END"])
    # tokens 1-2 wait for the character's last byte (token 3); " E" and "N" may start "END" and
    # go out with "x", which rules it out; every other token is one delta of its own text
    assert got == [("a", None), ("€", None), (" b", None), (" ", None), ("ENx", None), (" c", None), ("", "length")]


def test_a_stop_string_ends_the_deltas_at_its_token():
    pieces = {0: b"one", 1: b" E", 2: b"ND", 3: b" never"}
    got, gen = _deltas(pieces, [0, 1, 2, 3], stop=["END"])
    assert got == [("one", None), (" ", None), ("", "stop")]
    assert gen.finish_reason == "stop" and gen.usage.completion_tokens == 3
