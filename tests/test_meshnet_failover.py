"""The Tracker-side route finder for failover (meshnet_adapter.failover)."""

from __future__ import annotations

import asyncio

import pytest

from dgr.route.failover import FailoverRouter, NoRouteError
from meshnet_adapter.failover import TrackerRouteFinder
from fakeroute import start_fake
from test_routing import ART, REGISTRY, recipe, reg
from meshnet_adapter.registration import Capacity, make_registration


def _at(node, ep, start, end, n_layer=8, free=4, **kw):
    return make_registration(node_id=node, endpoint=ep, recipe=recipe(**kw), architecture="llama", n_layer=n_layer,
                             start=start, end=end, capacity=Capacity(max_sessions=4, active_sessions=4 - free),
                             registry=REGISTRY)


def test_tracker_finder_keeps_the_current_shards_and_skips_failed():
    regs = [_at("a", "h", 0, 4), _at("b", "t", 4, 8), _at("c", "t2", 4, 8), _at("d", "h2", 0, 4)]
    f = TrackerRouteFinder(lambda: regs, ART)
    assert asyncio.run(f.find({"t"}, ["h", "t"])) == ["h", "t2"]
    assert asyncio.run(f.find({"h"}, ["h", "t"])) == ["h2", "t"]


@pytest.mark.parametrize("extra,kind", [
    ([], "no_standby"),
    ([_at("x", "t3", 4, 8, free=0)], "capacity"),
    ([_at("x", "t3", 4, 8, tokenizer_digest="d" * 64)], "recipe_mismatch"),
])
def test_tracker_finder_says_why_no_route(extra, kind):
    regs = [_at("a", "h", 0, 4), _at("b", "t", 4, 8), *extra]
    with pytest.raises(NoRouteError) as ei:
        asyncio.run(TrackerRouteFinder(lambda: regs, ART).find({"t"}, ["h", "t"]))
    assert ei.value.kind == kind, str(ei.value)
    assert "failed: t" in str(ei.value)


@pytest.mark.native
def test_failover_through_the_tracker_finder(native_bin):
    ws = [start_fake(native_bin, "--layers", r, "--fake-delay-ms", "3") for r in ("0:4", "4:8", "4:8")]
    try:
        regs = [_at("n1", ws[0].target, 0, 4), _at("n2", ws[1].target, 4, 8), _at("n3", ws[2].target, 4, 8)]

        async def main():
            fr = await FailoverRouter([w.target for w in ws[:2]], TrackerRouteFinder(lambda: regs, ART)).connect()
            try:
                ref = await fr.route.generate([256, 5, 6], max_tokens=150, stop_on_eog=False)
                got = asyncio.Event()
                t = asyncio.create_task(fr.generate([256, 5, 6], max_tokens=150, stop_on_eog=False,
                                                    on_token=lambda _t: got.set()))
                await asyncio.wait_for(got.wait(), 10)
                ws[1].proc.kill()
                return ref, await asyncio.wait_for(t, 30), fr.routes
            finally:
                await fr.close()
        ref, r, routes = asyncio.run(main())
        assert r.error is None and r.record.restarts == 1 and r.tokens == ref.tokens
        assert routes[-1] == [ws[0].target, ws[2].target]
    finally:
        for w in ws:
            w.kill()
