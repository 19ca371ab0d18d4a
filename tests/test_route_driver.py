"""RouteDriver against real dgr-worker processes in --fake-model mode (seconds, no GGUF).

The fake model is deterministic and range-splittable: a route over disjoint ranges must give
exactly the tokens of one whole fake worker, for any chunking and any concurrency.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from dgr.protocol.errors import Reason
from dgr.route.driver import RouteDriver, RouteError, Sampling
from fakeroute import start_fake, start_fake_routes

pytestmark = pytest.mark.native


_start = start_fake


@pytest.fixture(scope="module")
def fake_workers(native_bin):
    """whole [0:8), a 2-shard route 0:4,4:8 and a 3-shard route 0:3,3:5,5:8 with a small
    prefill chunk on the middle shard (so prompts go in several chunks)."""
    procs = start_fake_routes(native_bin)
    yield procs
    for p in procs.values():
        p.kill()


def _run(coro):
    return asyncio.run(coro)


async def _generate_all(endpoints, prompts, *, chain=None, **kw):
    d = await RouteDriver(endpoints, chain=chain).connect()
    try:
        return await asyncio.gather(*(d.generate(p, **kw) for p in prompts))
    finally:
        await d.close()


async def _whole(fake_workers, prompts, **kw):
    return await _generate_all([fake_workers["whole"].target], prompts, **kw)


PROMPTS = [[256, *b"hello world"], [256, *b"route sessions are isolated"], [256, *b"x"],
           [256, *b"a longer prompt that needs several prefill chunks on the middle shard"]]


@pytest.mark.parametrize("chain", [False, None], ids=["stepwise", "default"])
@pytest.mark.parametrize("split", [("0:4", "4:8"), ("0:3", "3:5", "5:8")], ids=["2-shard", "3-shard"])
def test_route_tokens_equal_whole_model(fake_workers, split, chain):
    eps = [fake_workers[r].target for r in split]
    whole = _run(_whole(fake_workers, PROMPTS, max_tokens=24, stop_on_eog=False))
    route = _run(_generate_all(eps, PROMPTS, chain=chain, max_tokens=24, stop_on_eog=False))
    for w, r in zip(whole, route):
        assert w.error is None and r.error is None, (w.error, r.error)
        assert len(r.tokens) == 24
        assert r.tokens == w.tokens
        assert r.telemetry.status == "completed"
        nodes = r.telemetry.nodes
        assert len(nodes) == len(split) and all(n.decode_steps == 23 for n in nodes)
        if chain is False:
            # every non-head shard received the boundary bundles from the driver; the head tokens only
            assert nodes[0].seam_bytes_in == 0 and all(n.seam_bytes_in > 0 for n in nodes[1:])


def test_seam_bytes_per_decode_token_fit_the_target(fake_workers):
    """FastDecodeFrame with a one-row f32 bundle: <= 2 * n_embd * 4 + 256 bytes per seam."""
    (r,) = _run(_generate_all([fake_workers["0:4"].target, fake_workers["4:8"].target], PROMPTS[:1],
                              chain=False, max_tokens=8, stop_on_eog=False))
    n_embd = 8
    tail = r.telemetry.nodes[1]
    assert tail.seam_bytes_in == (len(PROMPTS[0]) + 7) * n_embd * 4
    assert 0 < tail.decode_frame_bytes_per_token <= 2 * n_embd * 4 + 256


def test_concurrent_sessions_are_isolated_and_cleaned_up(fake_workers):
    prompts = [[256, *f"session {i}: {'ab' * i}".encode()] for i in range(8)]
    eps = [fake_workers[r].target for r in ("0:3", "3:5", "5:8")]
    seq = [_run(_whole(fake_workers, [p], max_tokens=20, stop_on_eog=False))[0].tokens for p in prompts]
    conc = _run(_generate_all(eps, prompts, max_tokens=20, stop_on_eog=False))
    assert [c.tokens for c in conc] == seq
    assert len({tuple(t) for t in seq}) > 1  # the prompts really differ
    for r in ("0:3", "3:5", "5:8"):
        with fake_workers[r].client() as c:
            end = time.monotonic() + 10
            while (load := c.load()).active_sessions or load.kv_cells_used:
                assert time.monotonic() < end, f"worker {r} kept sessions: {load}"
                time.sleep(0.02)


def test_stochastic_sampling_is_reproducible_across_the_route(fake_workers):
    s = Sampling(temperature=0.8, top_k=40, seed=1234)
    eps = [fake_workers["0:4"].target, fake_workers["4:8"].target]
    a = _run(_generate_all(eps, PROMPTS[:2], max_tokens=16, sampling=s, stop_on_eog=False))
    b = _run(_whole(fake_workers, PROMPTS[:2], max_tokens=16, sampling=s, stop_on_eog=False))
    assert [x.tokens for x in a] == [x.tokens for x in b]


def test_connect_rejects_incomplete_or_incompatible_routes(fake_workers, native_bin):
    async def connect(eps):
        d = RouteDriver(eps)
        try:
            await d.connect()
        finally:
            await d.close()

    with pytest.raises(RouteError, match="ends at layer 4"):
        _run(connect([fake_workers["0:4"].target]))
    with pytest.raises(RouteError, match="not contiguous"):
        _run(connect([fake_workers["0:3"].target, fake_workers["4:8"].target]))
    with _start(native_bin, "--layers", "4:8", "--fingerprint", "0" * 64) as other:
        with pytest.raises(RouteError, match="fingerprint"):
            _run(connect([fake_workers["0:4"].target, other.target]))
    with pytest.raises(RouteError, match="unreachable"):
        _run(connect(["127.0.0.1:1"]))


def test_cancel_one_session_others_continue(fake_workers):
    eps = [fake_workers["0:4"].target, fake_workers["4:8"].target]

    async def main():
        d = await RouteDriver(eps).connect()
        try:
            started = asyncio.Event()

            def on_token(_t):
                started.set()

            victim = asyncio.create_task(d.generate(PROMPTS[0], max_tokens=100_000, session_id="victim",
                                                    stop_on_eog=False, on_token=on_token))
            others = [asyncio.create_task(d.generate(p, max_tokens=40, stop_on_eog=False)) for p in PROMPTS[1:]]
            await asyncio.wait_for(started.wait(), 10)
            assert any(await d.cancel("victim"))
            v = await asyncio.wait_for(victim, 10)
            rest = await asyncio.gather(*others)
            return v, rest
        finally:
            await d.close()

    v, rest = _run(main())
    assert v.error is not None and v.telemetry.status == "cancelled"
    assert "CANCELLED" in v.error.reason
    assert all(r.error is None and len(r.tokens) == 40 for r in rest)


def test_killed_worker_fails_its_sessions_bounded_and_names_the_shard(fake_workers, native_bin):
    """Kill the tail of one route mid-generation: its sessions end with a structured error
    naming that shard within a bound; sessions of another route keep going to completion."""
    doomed = [_start(native_bin, "--layers", "0:4"), _start(native_bin, "--layers", "4:8")]
    healthy = [fake_workers["0:4"].target, fake_workers["4:8"].target]
    try:
        async def main():
            d_bad = await RouteDriver([w.target for w in doomed], timeout=20).connect()
            d_ok = await RouteDriver(healthy).connect()
            try:
                progress = asyncio.Event()
                count = {"n": 0}

                def on_token(_t):
                    count["n"] += 1
                    if count["n"] >= 20:
                        progress.set()

                bad = [asyncio.create_task(d_bad.generate(p, max_tokens=100_000, stop_on_eog=False,
                                                          on_token=on_token)) for p in PROMPTS]
                ok = [asyncio.create_task(d_ok.generate(p, max_tokens=300, stop_on_eog=False)) for p in PROMPTS]
                await asyncio.wait_for(progress.wait(), 10)
                t0 = time.monotonic()
                doomed[1].proc.kill()
                bad_res = await asyncio.wait_for(asyncio.gather(*bad), 15)
                failed_in = time.monotonic() - t0
                ok_res = await asyncio.gather(*ok)
                return bad_res, failed_in, ok_res
            finally:
                await d_bad.close()
                await d_ok.close()

        bad_res, failed_in, ok_res = _run(main())
        assert failed_in < 15
        for r in bad_res:
            assert r.error is not None and r.telemetry.status == "failed"
            assert r.error.shard_endpoint == doomed[1].target and r.error.shard_range == (4, 8)
            assert doomed[1].target in str(r.error)
        assert all(r.error is None and len(r.tokens) == 300 for r in ok_res)
        # the surviving head of the broken route released its sessions
        with doomed[0].client() as c:
            end = time.monotonic() + 10
            while c.load().active_sessions:
                assert time.monotonic() < end
                time.sleep(0.02)
    finally:
        for w in doomed:
            w.kill()


def test_driver_overhead_is_small_per_hop(fake_workers):
    """Measured, not timed: the driver's own CPU per decode step per hop is recorded (stepwise:
    the driver relays every step); the sanity bound (20 ms) only catches a pathological
    regression (e.g. a sleep/poll loop)."""
    eps = [fake_workers["0:4"].target, fake_workers["4:8"].target]

    async def main():
        d = await RouteDriver(eps, chain=False).connect()
        try:
            await d.generate(PROMPTS[0], max_tokens=5, stop_on_eog=False)
            c0 = time.process_time()
            r = await d.generate(PROMPTS[0], max_tokens=200, stop_on_eog=False)
            return r, time.process_time() - c0
        finally:
            await d.close()

    r, cpu = _run(main())
    per_hop = cpu / (200 * 2)
    print(f"driver CPU per decode step per hop: {per_hop * 1e3:.3f} ms; "
          f"round trip per hop {r.telemetry.nodes[1].decode_step_s * 1e3:.3f} ms")
    assert per_hop < 0.02


def test_hung_worker_hits_the_step_deadline_and_names_the_shard(native_bin):
    """SIGSTOP the tail: the head's keepalive on its chained hop (~1.5 s) or the driver's step
    deadline (2 s here), whichever comes first, bounds the wait; the error names the hung shard."""
    import signal

    ws = [_start(native_bin, "--layers", "0:4"), _start(native_bin, "--layers", "4:8")]
    try:
        async def main():
            d = await RouteDriver([w.target for w in ws], timeout=2).connect()
            try:
                ws[1].proc.send_signal(signal.SIGSTOP)
                t0 = time.monotonic()
                r = await d.generate(PROMPTS[0], max_tokens=8, stop_on_eog=False)
                return r, time.monotonic() - t0
            finally:
                ws[1].proc.send_signal(signal.SIGCONT)
                await d.close()

        r, dt = _run(main())
        assert r.error is not None and r.error.reason in (Reason.DEADLINE_EXCEEDED, Reason.PEER_SILENT), r.error
        assert r.error.reason.silent
        assert r.error.shard_range == (4, 8) and r.telemetry.status == "failed"
        assert dt < 10
    finally:
        for w in ws:
            w.kill()


def test_forced_tokens_predict_on_the_given_context(fake_workers):
    """Teacher forcing (the drift measurement): each output is the route's prediction after the
    forced tokens, the same as a free run whose prompt holds them; own greedy tokens change nothing."""
    eps = [fake_workers[r].target for r in ("0:4", "4:8")]
    prompt = PROMPTS[0]

    async def go():
        d = await RouteDriver(eps, chain=False).connect()
        try:
            free = await d.generate(prompt, max_tokens=6, stop_on_eog=False)
            same = await d.generate(prompt, max_tokens=6, stop_on_eog=False, forced_tokens=free.tokens)
            other = [65, 66, 67, 68, 69, 70]
            forced = await d.generate(prompt, max_tokens=6, stop_on_eog=False, forced_tokens=other)
            step2 = await d.generate(prompt + other[:2], max_tokens=1, stop_on_eog=False)
            return free, same, forced, step2
        finally:
            await d.close()

    free, same, forced, step2 = _run(go())
    assert same.tokens == free.tokens
    assert forced.tokens[0] == free.tokens[0] and forced.tokens[2] == step2.tokens[0]
    assert forced.tokens != free.tokens


def test_forced_tokens_need_the_stepwise_mode(fake_workers):
    async def go():
        d = await RouteDriver([fake_workers["0:4"].target, fake_workers["4:8"].target], chain=True).connect()
        try:
            return await d.generate(PROMPTS[0], max_tokens=2, forced_tokens=[1, 2])
        finally:
            await d.close()

    with pytest.raises(RouteError, match="stepwise"):
        _run(go())
