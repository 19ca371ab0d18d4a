"""The gateway's pure parts: incremental text with stop strings, admission (no workers)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")

from dgr.serve.engine import Admission, GatewayError, _TextStream  # noqa: E402


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
