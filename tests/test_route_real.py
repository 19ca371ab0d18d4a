"""Real-model routes (SmolLM2-135M): route 0:15 | 15:30 vs the whole model, exact greedy parity,
concurrent isolation and cleanup, slices, a killed worker. Real lane."""

from __future__ import annotations

import asyncio
import os

import pytest

from dgr.route.local import LocalRoute
from dgr.route.run import _sequential
from dgr.route.sessions import run_sessions
from dgr.route.parity import compare, isolation
from dgr.route.driver import RouteDriver, Sampling

pytestmark = [pytest.mark.real, pytest.mark.native]

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Name three prime numbers.", "Why do leaves change colour?"]


@pytest.fixture(scope="module")
def routes(smollm2_path, native_bin):
    t = os.cpu_count() or 1
    with LocalRoute(smollm2_path, [(0, 15), (15, 30)], slices=True, threads=t) as r, \
            LocalRoute(smollm2_path, [(0, 30)], threads=t) as w:
        yield r, w


def test_route_matches_whole_model_exactly(routes):
    r, w = routes

    async def gen(eps):
        d = await RouteDriver(eps).connect()
        try:
            toks = await d.tokenize("The quick brown fox jumps over the lazy dog. " * 6, add_special=True)
            return await d.generate(toks, max_tokens=32, sampling=Sampling(top_logprobs=3, ignore_eog=True),
                                    stop_on_eog=False)
        finally:
            await d.close()

    a, b = asyncio.run(gen(r.endpoints)), asyncio.run(gen(w.endpoints))
    assert a.error is None and b.error is None
    assert len(a.tokens) == 32 and a.tokens == b.tokens
    assert a.top_logprobs == b.top_logprobs   # exact, not approximately equal


def test_chained_route_equals_stepwise(routes):
    """The head forwarding along the chain and generating server-side gives the stepwise
    driver's tokens (and logprobs) exactly, and so does the whole model generating server-side."""
    r, w = routes

    async def gen(eps, chain):
        d = await RouteDriver(eps, chain=chain).connect()
        try:
            assert d.mode == ("stepwise" if chain is False else "chained")
            toks = await d.tokenize("Chained shards forward their own boundaries. " * 3, add_special=True)
            return await d.generate(toks, max_tokens=24, sampling=Sampling(top_logprobs=3, ignore_eog=True),
                                    stop_on_eog=False)
        finally:
            await d.close()

    chained, stepwise = asyncio.run(gen(r.endpoints, True)), asyncio.run(gen(r.endpoints, False))
    whole = asyncio.run(gen(w.endpoints, True))
    assert chained.error is None and stepwise.error is None and whole.error is None
    assert len(chained.tokens) == 24 and chained.tokens == stepwise.tokens == whole.tokens
    assert chained.top_logprobs == stepwise.top_logprobs


def test_four_concurrent_sessions_isolated_and_released(routes):
    """Concurrent route sessions vs their own sequential runs (identical or a near-tie flip from
    batched numerics); one at a time the route equals the whole model exactly; nothing is left."""
    r, w = routes
    samp = Sampling(top_logprobs=5)
    conc = asyncio.run(run_sessions(r.endpoints, PROMPTS, max_tokens=24, sampling=samp, stats=r.stats(),
                                    pids=[x.pid for x in r.workers]))
    seq = asyncio.run(_sequential(r.endpoints, PROMPTS, "seq", max_tokens=24, sampling=samp))
    wseq = asyncio.run(_sequential(w.endpoints, PROMPTS, "wseq", max_tokens=24, sampling=samp))
    assert conc.ok
    iso = isolation(conc, seq)
    assert iso.ok, iso.violations
    assert compare(seq, wseq).ok
    assert all(x.sessions_left == 0 and x.kv_cells_left == 0 and x.kv_cells_peak > 0 for x in conc.workers)
    assert 0 < conc.seam_bytes_per_decode_token <= 2 * 576 * 4 + 256


def test_relayed_real_route_equals_direct(routes):
    """The same frames through a byte relay (loopback, 1000-byte pieces) to the real workers."""
    from dgr.protocol.relay import LoopbackRelay, RelayBridge

    r, _ = routes

    async def main():
        bridges = [await RelayBridge(ep).start() for ep in r.endpoints]
        relays = [await LoopbackRelay(b.address).start() for b in bridges]
        try:
            out = []
            for eps in (r.endpoints, [x.endpoint for x in relays]):
                d = await RouteDriver(eps).connect()
                try:
                    toks = await d.tokenize("Relays move bytes, not meaning.", add_special=True)
                    out.append(await d.generate(toks, max_tokens=16, sampling=Sampling(ignore_eog=True),
                                                stop_on_eog=False))
                finally:
                    await d.close()
            return out
        finally:
            for x in relays:
                await x.close()
            for b in bridges:
                await b.close()

    direct, relayed = asyncio.run(main())
    assert direct.error is None and relayed.error is None
    assert relayed.tokens == direct.tokens and len(direct.tokens) == 16


def test_backend_registers_the_exact_recipe_and_forms_a_route(smollm2_path, native_bin, tmp_path):
    from dgr.gguf.recipe import load_registry, recipe_for
    from meshnet_adapter.backend import BackendConfig, GgufShardBackend
    from meshnet_adapter.routing import NoRoute, form_routes

    reg = load_registry()
    recipe = recipe_for(smollm2_path, progress=False)
    regs = []
    with GgufShardBackend(BackendConfig(model=smollm2_path, start=0, end=15, threads=1)) as a, \
            GgufShardBackend(BackendConfig(model=smollm2_path, start=15, end=30, threads=1)) as b:
        regs = [a.load(node_id="a", registry=reg), b.load(node_id="b", registry=reg)]
        for x in regs:
            assert x.fingerprint == recipe.fingerprint() and x.artifact_id == recipe.artifact_id
            assert x.capacity.max_sessions > 0 and x.capacity.kv_cells_total > 0
        assert [(x.start, x.end) for x in regs] == [(0, 15), (15, 30)]
        routes = form_routes(regs, recipe.artifact_id)
        if reg.routable(recipe):
            assert not isinstance(routes, NoRoute) and routes[0].split == "0:15,15:30"
        else:   # registered but dark until certified: never routable, and the reason says so
            assert isinstance(routes, NoRoute) and any("dark" in r for r in routes.reasons)
