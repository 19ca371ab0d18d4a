"""Chained routes on fake-model workers: the driver talks to the head only, the head forwards
its boundary along the chain and generates server-side (seconds, no GGUF).

The chained mode must give exactly the stepwise mode's tokens, stop where asked, keep
concurrent sessions apart, and fail a session whose downstream shard dies with an error
naming that shard, without hanging anything.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from dgr.shard.v1 import shard_runtime_pb2 as pb
from dgr.protocol.client import WorkerClient
from dgr.route.driver import RouteDriver, RouteError, Sampling
from dgr.route.supervisor import WorkerProcess
from fakeroute import start_fake, start_fake_routes

pytestmark = pytest.mark.native

PROMPTS = [[256, *b"hello world"], [256, *b"route sessions are isolated"], [256, *b"x"],
           [256, *b"a longer prompt that needs several prefill chunks on the middle shard"]]
SPLITS = {"2-shard": ("0:4", "4:8"), "3-shard": ("0:3", "3:5", "5:8")}


_start = start_fake


@pytest.fixture(scope="module")
def fake_workers(native_bin):
    procs = start_fake_routes(native_bin)
    yield procs
    for p in procs.values():
        p.kill()


def _eps(fake_workers, split):
    return [fake_workers[r].target for r in SPLITS[split]]


async def _generate_all(endpoints, prompts, *, chain=None, expect_mode=None, tokens_per_answer=None, **kw):
    opts = {} if tokens_per_answer is None else {"tokens_per_answer": tokens_per_answer}
    d = await RouteDriver(endpoints, chain=chain, **opts).connect()
    try:
        if expect_mode:
            assert d.mode == expect_mode
        return await asyncio.gather(*(d.generate(p, **kw) for p in prompts))
    finally:
        await d.close()


def _metric(w: WorkerProcess, name: str, **labels: str) -> float:
    with w.client() as c:
        return c.metric(name, **labels)


def _wait_idle(ws, deadline_s: float = 10.0) -> None:
    for w in ws:
        with w.client() as c:
            end = time.monotonic() + deadline_s
            while (load := c.load()).active_sessions or load.kv_cells_used:
                assert time.monotonic() < end, f"worker {w.target} kept sessions: {load}"
                time.sleep(0.02)


def test_fake_workers_advertise_chaining(fake_workers):
    with fake_workers["0:4"].client() as c:
        cap = c.capability().capacity
    assert cap.chain_forwarding and cap.server_generation


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8, top_k=40, seed=1234),
                                      Sampling(top_logprobs=3)], ids=["greedy", "stochastic", "logprobs"])
def test_chained_equals_stepwise(fake_workers, split, sampling):
    eps = _eps(fake_workers, split)
    head = fake_workers[SPLITS[split][0]]
    fed0 = _metric(head, "dgr_generated_tokens_total")
    chained = asyncio.run(_generate_all(eps, PROMPTS, chain=True, expect_mode="chained", max_tokens=24,
                                        sampling=sampling, stop_on_eog=False))
    fed = _metric(head, "dgr_generated_tokens_total") - fed0
    step = asyncio.run(_generate_all(eps, PROMPTS, chain=False, expect_mode="stepwise", max_tokens=24,
                                     sampling=sampling, stop_on_eog=False))
    for c, s in zip(chained, step):
        assert c.error is None and s.error is None, (c.error, s.error)
        assert len(c.tokens) == 24 and c.tokens == s.tokens
        assert c.top_logprobs == s.top_logprobs
        assert c.telemetry.status == "completed" and c.telemetry.ttft_s > 0
        assert len(c.telemetry.nodes) == len(eps)
    assert len({tuple(c.tokens) for c in chained}) > 1
    # the head fed every token but the first of each session back itself
    assert fed == len(PROMPTS) * 23
    _wait_idle([fake_workers[r] for r in SPLITS[split]])


def test_tokens_per_answer_changes_the_answers_not_the_tokens(fake_workers):
    eps = _eps(fake_workers, "2-shard")
    ref = asyncio.run(_generate_all(eps, PROMPTS, chain=False, max_tokens=30, stop_on_eog=False))
    bytes_out = {}
    for per_answer in (None, 1, 8):     # None: the driver's default
        got = asyncio.run(_generate_all(eps, PROMPTS, chain=True, expect_mode="chained",
                                        tokens_per_answer=per_answer, max_tokens=30, stop_on_eog=False))
        for g, r in zip(got, ref):
            assert g.error is None and g.tokens == r.tokens and len(g.tokens) == 30
            assert g.telemetry.nodes[0].decode_steps == 29           # one step per token, grouped or not
        bytes_out[per_answer] = sum(g.telemetry.nodes[0].frame_bytes_out for g in got)
    # grouped answers share one header: fewer answers, fewer bytes for the same tokens
    assert bytes_out[8] < 0.6 * bytes_out[1], bytes_out
    # by default every token is an answer of its own, sent as soon as it is sampled (streaming)
    assert bytes_out[None] == bytes_out[1], bytes_out
    with pytest.raises(RouteError, match="tokens_per_answer must be >= 1"):
        RouteDriver(eps, tokens_per_answer=0)


@pytest.mark.parametrize("split", list(SPLITS))
def test_chained_stops_at_eog_like_stepwise(fake_workers, split):
    prompts = [[256, *f"eog {i} {'z' * i}".encode()] for i in range(12)]
    eps = _eps(fake_workers, split)
    chained = asyncio.run(_generate_all(eps, prompts, chain=True, max_tokens=64))
    step = asyncio.run(_generate_all(eps, prompts, chain=False, max_tokens=64))
    assert [(c.tokens, c.finish_reason) for c in chained] == [(s.tokens, s.finish_reason) for s in step]
    assert all(c.error is None for c in chained)


def test_generation_stops_at_max_tokens(fake_workers):
    eps = _eps(fake_workers, "3-shard")
    head, mid = fake_workers["0:3"], fake_workers["3:5"]
    fed0 = _metric(head, "dgr_generated_tokens_total")
    frames0 = [_metric(w, "dgr_chain_frames_sent_total", phase="decode") for w in (head, mid)]
    res = asyncio.run(_generate_all(eps, PROMPTS[:3], chain=True, max_tokens=5, stop_on_eog=False))
    assert [len(r.tokens) for r in res] == [5, 5, 5]
    assert all(r.finish_reason == "length" for r in res)
    _wait_idle([fake_workers[r] for r in SPLITS["3-shard"]])
    # nothing generated past the 5th token: 4 tokens fed back per session, each forwarded once per seam
    assert _metric(head, "dgr_generated_tokens_total") - fed0 == 3 * 4
    frames = [_metric(w, "dgr_chain_frames_sent_total", phase="decode") - f0 for w, f0 in zip((head, mid), frames0)]
    assert frames == [12, 12]
    one = asyncio.run(_generate_all(eps, PROMPTS[:1], chain=True, max_tokens=1, stop_on_eog=False))
    assert len(one[0].tokens) == 1 and one[0].tokens == res[0].tokens[:1]


def test_chained_seam_bytes_per_decode_token_fit_the_target(fake_workers):
    """Per seam: serialized decode frame bytes the worker sent downstream, per frame."""
    from dgr.route.sessions import chain_counters, chain_seam_bytes

    async def main():
        d = await RouteDriver(_eps(fake_workers, "3-shard")).connect()
        try:
            before = await chain_counters(d)
            await asyncio.gather(*(d.generate(p, max_tokens=16, stop_on_eog=False) for p in PROMPTS))
            return chain_seam_bytes(before, await chain_counters(d))
        finally:
            await d.close()

    seams = asyncio.run(main())
    n_embd = 8
    assert len(seams) == 2 and all(0 < b <= 2 * n_embd * 4 + 256 for b in seams), seams


def test_whole_model_worker_generates_server_side(fake_workers):
    eps = [fake_workers["whole"].target]
    chained = asyncio.run(_generate_all(eps, PROMPTS, expect_mode="chained", max_tokens=20, stop_on_eog=False))
    step = asyncio.run(_generate_all(eps, PROMPTS, chain=False, max_tokens=20, stop_on_eog=False))
    route = asyncio.run(_generate_all(_eps(fake_workers, "2-shard"), PROMPTS, max_tokens=20, stop_on_eog=False))
    assert [r.tokens for r in chained] == [r.tokens for r in step] == [r.tokens for r in route]


def test_cancel_one_session_mid_generation_others_complete(native_bin, fake_workers):
    """Slow workers (a sleep per decode call) so the victim is surely still generating."""
    slow = [_start(native_bin, "--layers", "0:4", "--fake-delay-ms", "2"),
            _start(native_bin, "--layers", "4:8", "--fake-delay-ms", "2")]
    ref = asyncio.run(_generate_all(_eps(fake_workers, "2-shard"), PROMPTS[1:], chain=False, max_tokens=40,
                                    stop_on_eog=False))
    try:
        async def main():
            d = await RouteDriver([w.target for w in slow]).connect()
            assert d.mode == "chained"
            try:
                started = asyncio.Event()
                victim = asyncio.create_task(d.generate(PROMPTS[0], max_tokens=1500, session_id="victim",
                                                        stop_on_eog=False, on_token=lambda _t: started.set()))
                others = [asyncio.create_task(d.generate(p, max_tokens=40, stop_on_eog=False)) for p in PROMPTS[1:]]
                await asyncio.wait_for(started.wait(), 10)
                assert any(await d.cancel("victim"))
                v = await asyncio.wait_for(victim, 10)
                rest = await asyncio.wait_for(asyncio.gather(*others), 30)
                return v, rest
            finally:
                await d.close()

        v, rest = asyncio.run(main())
        assert v.error is not None and v.telemetry.status == "cancelled", v.error
        assert "CANCELLED" in v.error.reason
        assert len(v.tokens) < 1500
        assert [r.tokens for r in rest] == [r.tokens for r in ref]
        assert all(r.error is None for r in rest)
        _wait_idle(slow)
    finally:
        for w in slow:
            w.kill()


@pytest.mark.parametrize("victim", ["tail", "middle"])
def test_killed_downstream_worker_fails_sessions_naming_it(native_bin, victim):
    """Kill a downstream shard mid-generation: every session of the route ends with a
    RouteSessionError naming that shard, within a bound; the head frees its sessions."""
    ranges = ("0:4", "4:8") if victim == "tail" else ("0:3", "3:5", "5:8")
    doomed = [_start(native_bin, "--layers", r, "--fake-delay-ms", "2") for r in ranges]
    dead = doomed[-1] if victim == "tail" else doomed[1]
    try:
        async def main():
            d = await RouteDriver([w.target for w in doomed], timeout=20).connect()
            assert d.mode == "chained"
            try:
                progress = asyncio.Event()
                count = {"n": 0}

                def on_token(_t):
                    count["n"] += 1
                    if count["n"] >= 20:
                        progress.set()

                tasks = [asyncio.create_task(d.generate(p, max_tokens=1500, stop_on_eog=False, on_token=on_token))
                         for p in PROMPTS]
                await asyncio.wait_for(progress.wait(), 10)
                dead.proc.kill()
                return await asyncio.wait_for(asyncio.gather(*tasks), 30)
            finally:
                await d.close()

        res = asyncio.run(main())
        a, b = (int(x) for x in ranges[doomed.index(dead)].split(":"))
        for r in res:
            assert r.error is not None and r.telemetry.status == "failed"
            assert r.error.shard_endpoint == dead.target and r.error.shard_range == (a, b), str(r.error)
            assert dead.target in str(r.error)
            assert len(r.tokens) < 1500
        _wait_idle([w for w in doomed if w is not dead])
    finally:
        for w in doomed:
            w.kill()


@pytest.mark.parametrize("endpoint", ["10.1.2.3:5", "[::ffff:10.1.2.3]:5", "127.0.0.1.evil.example:{port}",
                                      "localhost.attacker:{port}", "127.0.0.1:{port}.evil"])
def test_downstream_outside_allowed_peers_is_refused(fake_workers, endpoint):
    """Only parsed addresses count: names that merely start like loopback are refused."""
    head = fake_workers["0:4"]
    endpoint = endpoint.format(port=fake_workers["4:8"].target.rsplit(":", 1)[1])
    with head.client() as c:
        fp = c.capability().identity.compatibility_fingerprint
        hop = pb.ChainHop(endpoint=endpoint, range=pb.ShardRange(start=4, end=8), compatibility_fingerprint=fp)
        with c.open_session(downstream=[hop]) as s:
            req = s._input_frame(pb.PHASE_PREFILL, [256, 104, 105], None, True)
            assert list(req.step.downstream) == [hop]
            r = s.exchange(req, raise_errors=False)
            assert r.WhichOneof("result") == "error", r
            assert r.error.reason == pb.ERROR_REASON_BAD_REQUEST
            assert endpoint in r.error.message and "not an allowed peer" in r.error.message
            s.close()


def test_downstream_by_v4_mapped_loopback_is_allowed(fake_workers):
    head, tail = fake_workers["0:4"], fake_workers["4:8"]
    port = tail.target.rsplit(":", 1)[1]
    with head.client() as c:
        fp = c.capability().identity.compatibility_fingerprint
        hop = pb.ChainHop(endpoint=f"[::ffff:127.0.0.1]:{port}", range=pb.ShardRange(start=4, end=8),
                          compatibility_fingerprint=fp)
        with c.open_session(downstream=[hop]) as s:
            got = s.prefill([256, 104, 105])
            s.release()
    with fake_workers["whole"].client() as w, w.open_session() as s:
        assert got == s.prefill([256, 104, 105])   # the whole fake model's token
        s.release()


def test_mode_selection_relay_and_requirement(fake_workers):
    """A relayed hop cannot be dialled by the head: auto falls back to stepwise, chain=True refuses."""
    from dgr.protocol.relay import LoopbackRelay, RelayBridge

    async def main():
        bridge = await RelayBridge(fake_workers["4:8"].target).start()
        relay = await LoopbackRelay(bridge.address).start()
        try:
            eps = [fake_workers["0:4"].target, relay.endpoint]
            d = await RouteDriver(eps).connect()
            try:
                mode = d.mode
                (r,) = await asyncio.gather(d.generate(PROMPTS[0], max_tokens=12, stop_on_eog=False))
            finally:
                await d.close()
            with pytest.raises(RouteError, match="relayed"):
                await RouteDriver(eps, chain=True).connect()
            return mode, r
        finally:
            await relay.close()
            await bridge.close()

    mode, r = asyncio.run(main())
    assert mode == "stepwise" and r.error is None
    direct = asyncio.run(_generate_all(_eps(fake_workers, "2-shard"), PROMPTS[:1], chain=True, max_tokens=12,
                                       stop_on_eog=False))
    assert r.tokens == direct[0].tokens


def test_chain_client_helpers_drive_a_chained_head(fake_workers):
    """dgr.protocol.client: a head session with downstream hops answers the tail's tokens."""
    head, tail = fake_workers["0:4"], fake_workers["4:8"]
    with WorkerClient(tail.target) as t:
        cap = t.capability()
    hop = pb.ChainHop(endpoint=tail.target, range=cap.identity.range,
                      compatibility_fingerprint=cap.identity.compatibility_fingerprint)
    with fake_workers["whole"].client() as w, w.open_session() as s:
        first = s.prefill(PROMPTS[1])
        ref = [first, *s.generate(first, 15)]
        s.release()
    with head.client() as c, c.open_session(downstream=[hop]) as s:
        got = s.prefill_generate(PROMPTS[1], 8)
        got += s.decode_generate(got[-1], 8)
        s.release()
    assert got == ref


def test_every_hop_of_a_chained_route_reports_a_measured_round_trip(fake_workers):
    """The driver times its hop to the head; each worker times its own hop downstream
    (dgr_chain_hop_seconds_total / dgr_chain_replies_total): no hop reads 0 in a chained route."""
    from dgr.route.sessions import run_sessions

    rep = asyncio.run(run_sessions(_eps(fake_workers, "3-shard"), [""] * 2, token_prompts=PROMPTS[:2],
                                   max_tokens=12, stop_on_eog=False, chain=True, tokens_per_answer=1))
    assert rep.mode == "chained" and rep.ok
    hops = rep.hop_decode_rtt_s
    assert len(hops) == 3 and all(h > 0 for h in hops), hops
    assert all(len(s.hop_decode_rtt_s) == 3 for s in rep.sessions)
