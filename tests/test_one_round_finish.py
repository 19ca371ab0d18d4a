"""A normal finish takes one round: no ReleaseSession or CancelSession on the caller's path.

The half-close of the session stream ends the session on its worker (and a chained head ends its
downstream streams), so ``RouteDriver.generate`` returns at its last token, and the gateway's
answer ends there too. The cleanup stays guaranteed: every worker holds nothing once the driver
is closed, and a stream that does not end cleanly still gets the full release."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from dgr.protocol.client import AsyncWorkerClient, WorkerClient
from dgr.route.driver import RouteDriver
from fakeroute import poll, start_fake

pytestmark = pytest.mark.native

PROMPT = [256, *b"one round"]


@pytest.fixture(scope="module")
def route(native_bin):
    ws = [start_fake(native_bin, "--layers", r) for r in ("0:4", "4:8")]
    yield ws
    for w in ws:
        w.kill()


@pytest.fixture
def calls(monkeypatch):
    """Counts the ReleaseSession and CancelSession calls the driver makes."""
    got = {"release": 0, "cancel": 0}
    real_release, real_cancel = AsyncWorkerClient.release, AsyncWorkerClient.cancel

    async def release(self, *a, **kw):
        got["release"] += 1
        return await real_release(self, *a, **kw)

    async def cancel(self, *a, **kw):
        got["cancel"] += 1
        return await real_cancel(self, *a, **kw)

    monkeypatch.setattr(AsyncWorkerClient, "release", release)
    monkeypatch.setattr(AsyncWorkerClient, "cancel", cancel)
    return got


def _held(ws) -> list[tuple[int, int]]:
    out = []
    for w in ws:
        with WorkerClient(w.target) as c:
            load = c.load()
            out.append((load.active_sessions, load.kv_cells_used))
    return out


def _released(ws) -> list[float]:
    out = []
    for w in ws:
        with WorkerClient(w.target) as c:
            out.append(c.metric("dgr_sessions_released_total") + c.metric("dgr_sessions_cancelled_total"))
    return out


@pytest.mark.parametrize("chain", [None, False], ids=["chained", "stepwise"])
def test_a_normal_finish_sends_no_release_or_cancel(route, calls, chain):
    before = _released(route)

    async def main():
        d = await RouteDriver([w.target for w in route], chain=chain).connect()
        try:
            res = await asyncio.gather(*(d.generate(PROMPT, max_tokens=12, stop_on_eog=False) for _ in range(3)))
            assert [r.finish_reason for r in res] == ["length"] * 3 and all(len(r.tokens) == 12 for r in res)
            assert calls == {"release": 0, "cancel": 0}
        finally:
            await d.close()
        assert calls == {"release": 0, "cancel": 0}    # not in the background either: the streams ended OK

    asyncio.run(main())
    # each session ended on both workers (the head's by the half-close, the tail's by the head's
    # downstream half-close in chained mode), and nothing is left
    poll(lambda: [a - b for a, b in zip(_released(route), before)] == [3, 3], 5, "the sessions' ends")
    assert _held(route) == [(0, 0), (0, 0)]


def test_a_stream_that_does_not_end_cleanly_is_released(route, calls, monkeypatch):
    from dgr.protocol.stream import AsyncSessionStream

    async def not_ok(self, timeout=10.0):
        return grpc.StatusCode.UNAVAILABLE

    monkeypatch.setattr(AsyncSessionStream, "wait_closed", not_ok)

    async def main():
        d = await RouteDriver([w.target for w in route]).connect()
        try:
            r = await d.generate(PROMPT, max_tokens=6, stop_on_eog=False)
            assert len(r.tokens) == 6
        finally:
            await d.close()     # waits for the background release

    asyncio.run(main())
    assert calls["release"] == 2 and calls["cancel"] == 0    # the head's stream, and the tail
    poll(lambda: _held(route) == [(0, 0), (0, 0)], 5, "nothing held")


def test_the_gateway_answer_needs_no_extra_round(route, calls):
    openai = pytest.importorskip("openai")
    from dgr.serve.server import Gateway

    with Gateway([w.target for w in route], model_id="fake-8") as gw:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        r = c.completions.create(model="fake-8", prompt="x", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        s = c.completions.create(model="fake-8", prompt="y", max_tokens=5, temperature=0, stream=True,
                                 extra_body={"ignore_eos": True})
        assert [ch.choices[0].finish_reason for ch in s][-1] == "length"
    assert calls == {"release": 0, "cancel": 0}
    poll(lambda: _held(route) == [(0, 0), (0, 0)], 5, "nothing held")
