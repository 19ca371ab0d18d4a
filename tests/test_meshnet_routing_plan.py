"""Route formation on the Tracker ranked by the planner's cost model (meshnet_adapter.routing with
measured registrations): synthetic hosts, no model file, no worker."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import pytest

from dgr.errors import DgrError
from dgr.gguf.recipe import Registry
from dgr.route.capabilities import HostCapability, Link
from dgr.route.planner import ModelShape, Workload, predict
from dgr.shard.v1 import shard_runtime_pb2 as pb
from meshnet_adapter.failover import TrackerRouteFinder
from meshnet_adapter.registration import (Capacity, ShardMeasurement, make_registration, measurement_of_capability,
                                          registration_from_json)
from meshnet_adapter.routing import RANKED_BY_PREDICTION, RANKED_BY_SHAPE, NoRoute, Routes, form_routes
from test_routing import ART, REGISTRY, recipe

N = 8
SHAPE = ModelShape.uniform(N, layer_bytes=10_000_000, output_bytes=50_000_000, embed_bytes=50_000_000,
                           n_embd=1024, kv_bytes_per_cell_layer=4096)
# one mean layer's decode step at 1 and 4 rows: the slow host takes 4x the fast host's time
SLOW = {1: 0.004, 4: 0.008}
FAST = {1: 0.001, 4: 0.002}
OUTPUT = {1: 0.003, 4: 0.005}   # the output matrix on the tail
PREFILL = 0.0005                # one mean layer per prompt token


def measured(per_layer: dict[int, float], a: int, b: int, **kw) -> ShardMeasurement:
    """What a worker serving [a, b) on a host with these per-layer figures measures for its range."""
    n = b - a
    no_out = {r: t * n for r, t in per_layer.items()}
    if b == N:   # a tail: the step with logits, and without
        return ShardMeasurement(decode_s={r: no_out[r] + OUTPUT[r] for r in per_layer}, decode_no_output_s=no_out,
                                prompt_s_per_token=PREFILL * n + OUTPUT[1], prompt_no_output_s_per_token=PREFILL * n,
                                **kw)
    return ShardMeasurement(decode_s=no_out, prompt_s_per_token=PREFILL * n, **kw)


def at(node: str, a: int, b: int, per_layer: dict[int, float] | None, *, free: int = 4, **kw):
    return make_registration(node_id=node, endpoint=f"{node}:50151", recipe=recipe(), architecture="llama",
                             n_layer=N, start=a, end=b, capacity=Capacity(max_sessions=4, active_sessions=4 - free),
                             registry=REGISTRY, measured=None if per_layer is None else measured(per_layer, a, b, **kw))


def host(name: str, per_layer: dict[int, float]) -> HostCapability:
    return HostCapability(name, dict(per_layer), PREFILL, dict(OUTPUT), OUTPUT[1], 1 << 50)


def splits(routes) -> list[str]:
    assert isinstance(routes, Routes), routes
    return [r.split for r in routes]


def even_and_spared(slow_head_measured: bool = True):
    """A slow host and a fast host, each serving two ranges: an even split 0:4,4:8 and one that
    leaves the slow host 2 layers, 0:2,2:8."""
    return [at("slow-even", 0, 4, SLOW), at("fast-even", 4, 8, FAST),
            at("slow-short", 0, 2, SLOW if slow_head_measured else None), at("fast-long", 2, 8, FAST)]


def test_the_cost_model_ranks_the_split_that_spares_the_slow_host_first():
    cov = even_and_spared()
    shape_order = form_routes(cov, ART)   # no model shape: the order of fewest shards, then free sessions
    assert splits(shape_order) == ["0:4,4:8", "0:2,2:8"]
    routes = form_routes(cov, ART, model=SHAPE)
    assert routes.ranked_by == RANKED_BY_PREDICTION
    assert splits(routes) == ["0:2,2:8", "0:4,4:8"]
    assert [[s.node_id for s in r.shards] for r in routes] == [["slow-short", "fast-long"], ["slow-even", "fast-even"]]
    spared, even = routes
    # 8 sessions in 2 groups of 4 rows: the even split's slow stage is 4 x 8 ms of layers, the
    # spared one's slowest 6 x 2 ms + the output matrix; well apart, not a rounding
    assert spared.predicted_tok_s > 1.5 * even.predicted_tok_s
    assert spared.prediction.groups == even.prediction.groups == 2
    assert even.prediction.stages[0].decode_s > 2 * even.prediction.stages[1].decode_s   # the slow host sets the pace
    # the measured ranges, divided over their layers, are the planner's own hosts: the same figures
    for r, ranges in ((spared, [(0, 2), (2, 8)]), (even, [(0, 4), (4, 8)])):
        ref = predict(SHAPE, [host("slow", SLOW), host("fast", FAST)], ranges, Link(), Workload(), groups=2)
        assert r.prediction.aggregate_tok_s == pytest.approx(ref.aggregate_tok_s, rel=1e-9)
        assert r.prediction.ttft_s == pytest.approx(ref.ttft_s, rel=1e-9)
    assert "predicted aggregate decode over 2 candidate route(s)" in routes.notes[0]


def test_the_cost_model_may_prefer_a_route_with_more_seams():
    # two shards with the slow host on 6 layers, against three where it keeps 1
    cov = [at("slow-long", 0, 6, SLOW), at("fast-tail", 6, 8, FAST),
           at("slow-1", 0, 1, SLOW), at("fast-mid", 1, 5, FAST), at("fast-tail2", 5, 8, FAST)]
    assert splits(form_routes(cov, ART)) == ["0:6,6:8", "0:1,1:5,5:8"]
    routes = form_routes(cov, ART, model=SHAPE)
    assert splits(routes) == ["0:1,1:5,5:8", "0:6,6:8"]
    assert routes[0].predicted_tok_s > routes[1].predicted_tok_s
    assert routes[0].prediction.groups == 3   # one pipeline group per shard, as a chained head does
    assert splits(form_routes(cov, ART, model=SHAPE, limit=1)) == ["0:1,1:5,5:8"]


def test_the_workload_is_the_load_predicted_for():
    cov = even_and_spared()
    one = form_routes(cov, ART, model=SHAPE, workload=Workload(sessions=1))
    eight = form_routes(cov, ART, model=SHAPE)
    assert splits(one) == ["0:2,2:8", "0:4,4:8"]
    assert one[0].prediction.groups == 1 and one[0].predicted_tok_s < eight[0].predicted_tok_s
    assert "for 1 session(s)" in one.notes[0]


def test_equal_predictions_keep_the_order_of_free_sessions():
    cov = [at("a-busy", 0, 4, FAST, free=1), at("a-idle", 0, 4, FAST, free=3), at("b", 4, 8, FAST)]
    routes = form_routes(cov, ART, model=SHAPE)
    assert routes.ranked_by == RANKED_BY_PREDICTION
    assert routes[0].predicted_tok_s == pytest.approx(routes[1].predicted_tok_s, rel=1e-12)
    assert [r.shards[0].node_id for r in routes] == ["a-idle", "a-busy"]


def test_an_unmeasured_shard_falls_back_to_the_shape_order_and_says_so():
    routes = form_routes(even_and_spared(slow_head_measured=False), ART, model=SHAPE)
    assert routes.ranked_by == RANKED_BY_SHAPE
    assert splits(routes) == ["0:4,4:8", "0:2,2:8"]
    assert all(r.prediction is None and r.predicted_tok_s is None for r in routes)
    (note,) = routes.notes
    assert "not by the cost model" in note and "1 shard(s) report no measured cost: slow-short[0:2]" in note


def test_no_model_shape_or_another_models_shape_falls_back():
    cov = even_and_spared()
    assert "no model shape was given" in form_routes(cov, ART).notes[0]
    other = dataclasses.replace(SHAPE, layer_elements=(1,) * 12, layer_bytes=(1,) * 12, name="other.gguf")
    routes = form_routes(cov, ART, model=other)
    assert routes.ranked_by == RANKED_BY_SHAPE and splits(routes) == ["0:4,4:8", "0:2,2:8"]
    assert "other.gguf has 12 layers, the registrations 8" in routes.notes[0]


def test_no_route_is_unchanged_by_measurements():
    res = form_routes([at("a", 0, 4, SLOW), at("b", 5, 8, FAST)], ART, model=SHAPE)
    assert isinstance(res, NoRoute) and any("[4:5)" in r for r in res.reasons)


def test_a_registration_with_its_measurement_round_trips_through_json():
    r = at("fast-long", 2, 8, FAST, duty=0.5, threads=4, memory_bytes=6 << 30, backend="cpu")
    text = r.dumps()
    doc = json.loads(text)
    assert doc["measured"]["decode_s"] == {"1": pytest.approx(0.006 + 0.003), "4": pytest.approx(0.012 + 0.005)}
    assert doc["measured"]["duty"] == 0.5 and doc["schema"] == 1
    back = registration_from_json(doc, registry=REGISTRY)
    assert back == r and back.measured == r.measured and back.dumps() == text
    assert back.measured.decode_s.keys() == {1, 4}
    # a Shard without a measurement: no "measured" key at all, and it reads back as unmeasured
    plain = at("p", 0, 2, None)
    assert "measured" not in plain.to_json()
    assert registration_from_json(json.loads(plain.dumps()), registry=REGISTRY).measured is None
    # the receiver's registry decides certification, and the fingerprint must be the recipe's
    assert not registration_from_json(doc, registry=Registry(entries=())).certified
    with pytest.raises(DgrError, match="does not match its recipe"):
        registration_from_json({**doc, "fingerprint": "0" * 64}, registry=REGISTRY)
    with pytest.raises(DgrError, match="schema 2 is not 1"):
        registration_from_json({**doc, "schema": 2}, registry=REGISTRY)
    with pytest.raises(DgrError, match="not a registration payload"):
        registration_from_json({k: v for k, v in doc.items() if k != "capacity"}, registry=REGISTRY)
    # routes formed from registrations read back rank as the originals do
    cov = [registration_from_json(json.loads(x.dumps()), registry=REGISTRY) for x in even_and_spared()]
    assert splits(form_routes(cov, ART, model=SHAPE)) == ["0:2,2:8", "0:4,4:8"]


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("m, b, match", [
    (ShardMeasurement(decode_s={1: -0.01}), 4, r"decode_s\[1\] = -0.01 is not a number of seconds"),
    (ShardMeasurement(decode_s={1: 0.0}), 4, r"decode_s\[1\] = 0.0"),
    (ShardMeasurement(decode_s={1: NAN}), 4, r"decode_s\[1\] = nan"),
    (ShardMeasurement(decode_s={1: INF}), 4, r"decode_s\[1\] = inf"),
    (ShardMeasurement(decode_s={1: 1e9}), 4, r"decode_s\[1\] = 1000000000.0"),
    (ShardMeasurement(decode_s={1: True}), 4, r"decode_s\[1\] = True"),
    (ShardMeasurement(decode_s={1: "0.01"}), 4, r"decode_s\[1\] = '0.01'"),
    (ShardMeasurement(decode_s={0: 0.01}), 4, "batch size 0 is not an integer in 1..4096"),
    (ShardMeasurement(decode_s={"1": 0.01}), 4, "batch size '1' is not an integer"),
    (ShardMeasurement(decode_s={1 << 20: 0.01}), 4, "batch size 1048576"),
    (ShardMeasurement(decode_s={}), 4, "decode_s is empty"),
    (ShardMeasurement(decode_s={1: 0.01}), 8, "a tail's measurement needs its decode step without logits"),
    (ShardMeasurement(decode_s={1: 0.01}, decode_no_output_s={4: 0.01}), 8, "without logits"),
    (ShardMeasurement(decode_s={1: 0.01}, decode_no_output_s={1: -1.0}), 8, r"decode_no_output_s\[1\] = -1.0"),
    (ShardMeasurement(decode_s={1: 0.01}, prompt_s_per_token=-1e-3), 4, "prompt_s_per_token = -0.001"),
    (ShardMeasurement(decode_s={1: 0.01}, prompt_no_output_s_per_token=NAN), 4, "prompt_no_output_s_per_token = nan"),
    (ShardMeasurement(decode_s={1: 0.01}, duty=1.5), 4, r"duty = 1.5 is not a share in \(0, 1\]"),
    (ShardMeasurement(decode_s={1: 0.01}, duty=0.0), 4, "duty = 0.0"),
    (ShardMeasurement(decode_s={1: 0.01}, duty=NAN), 4, "duty = nan"),
    (ShardMeasurement(decode_s={1: 0.01}, threads=-1), 4, "threads = -1"),
    (ShardMeasurement(decode_s={1: 0.01}, memory_bytes=-1), 4, "memory_bytes = -1"),
    (ShardMeasurement(decode_s={1: 0.01}, memory_bytes=1 << 60), 4, "memory_bytes = 1152921504606846976"),
    (ShardMeasurement(decode_s=[0.01]), 4, "decode_s is not a table"),
])
def test_an_absurd_measurement_is_refused_at_registration(m, b, match):
    with pytest.raises(DgrError, match=match) as ei:
        make_registration(node_id="odd", endpoint="odd:1", recipe=recipe(), architecture="llama", n_layer=8,
                          start=b - 4, end=b, capacity=Capacity(max_sessions=4), registry=REGISTRY, measured=m)
    assert f"node odd [{b - 4}:{b}]: refusing its measured cost" in str(ei.value)


def test_an_absurd_measurement_in_a_payload_is_refused():
    doc = json.loads(at("x", 0, 4, SLOW).dumps())
    for bad, match in (({"decode_s": {"1": "Infinity"}}, "is not a number of seconds"),
                       ({"decode_s": {"one": 0.01}}, "a batch size is not an integer"),
                       ({"decode_s": {"1": 0.01}, "speed": 9}, "unknown fields: speed"),
                       ({"duty": 1}, "no decode_s"),
                       ("fast", "not an object")):
        with pytest.raises(DgrError, match=match):
            registration_from_json({**doc, "measured": bad}, registry=REGISTRY)
    # JSON's own Infinity (Python's json reads it) is refused the same way
    doc["measured"]["decode_s"]["1"] = float("inf")
    with pytest.raises(DgrError, match=r"decode_s\[1\] = inf"):
        registration_from_json(json.loads(json.dumps(doc)), registry=REGISTRY)


def test_odd_measurements_that_reach_ranking_are_ignored_with_the_reason():
    # built around make_registration (as a Tracker holding an old or foreign object might): ranking
    # never raises; it falls back and names the Shard
    cov = even_and_spared()
    cov[2] = dataclasses.replace(cov[2], measured=ShardMeasurement(decode_s={1: NAN}))
    routes = form_routes(cov, ART, model=SHAPE)
    assert routes.ranked_by == RANKED_BY_SHAPE and splits(routes) == ["0:4,4:8", "0:2,2:8"]
    assert "the measured cost of slow-short[0:2] is refused: measured decode_s[1] = nan" in routes.notes[0]
    # figures within bounds for the range, beyond them per layer under this model's shape (a
    # range of one tiny layer that took 9000 s): ignored for ranking, with the planner's reason
    skewed = dataclasses.replace(SHAPE, layer_elements=(1,) + (1000,) * 7)
    cov = [at("tiny", 0, 1, None), at("rest", 1, 8, FAST), *even_and_spared()]
    cov[0] = dataclasses.replace(cov[0], measured=ShardMeasurement(decode_s={1: 9000.0}))
    cov[0].measured.validate(tail=False)   # a plausible range figure on its own
    routes = form_routes(cov, ART, model=skewed)
    assert routes.ranked_by == RANKED_BY_SHAPE and len(routes) == 3
    assert "tiny[0:1]" in routes.notes[0] and "layer_decode_s" in routes.notes[0]
    assert all(r.prediction is None for r in routes)


def test_the_measurement_of_a_workers_capability():
    cap = pb.GetCapabilityResponse()
    assert measurement_of_capability(cap) is None   # a worker started without --probe-budget-s
    cap.capacity.memory_budget_bytes = 3 << 30
    cap.runtime.backend = "cpu"
    for rows, step, no_out in ((1, 0.009, 0.006), (4, 0.017, 0.012)):
        b = cap.measured.decode.add()
        b.rows, b.step_seconds, b.step_no_output_seconds = rows, step, no_out
    cap.measured.prompt_seconds_per_token = 0.004
    cap.measured.prompt_no_output_seconds_per_token = 0.003
    cap.measured.threads = 2
    m = measurement_of_capability(cap)
    assert m == ShardMeasurement(decode_s={1: 0.009, 4: 0.017}, decode_no_output_s={1: 0.006, 4: 0.012},
                                 prompt_s_per_token=0.004, prompt_no_output_s_per_token=0.003, duty=1.0,
                                 threads=2, memory_bytes=3 << 30, backend="cpu")   # duty 0: not measured
    m.validate(tail=True)
    cap.measured.duty = 0.49
    assert measurement_of_capability(cap).duty == pytest.approx(0.49)
    # a worker's absurd figure reaches make_registration, which refuses it
    cap.measured.decode[0].step_seconds = math.inf
    with pytest.raises(DgrError, match="refusing its measured cost"):
        make_registration(node_id="w", endpoint="w:1", recipe=recipe(), architecture="llama", n_layer=8, start=4,
                          end=8, capacity=Capacity(max_sessions=1), registry=REGISTRY,
                          measured=measurement_of_capability(cap))


def test_the_failover_finder_takes_the_predicted_fastest_of_the_routes_it_may_keep():
    cov = even_and_spared()
    # nothing of the session's current route survives: every candidate keeps none of its Shards
    plain = TrackerRouteFinder(lambda: cov, ART)
    ranked = TrackerRouteFinder(lambda: cov, ART, model=SHAPE)
    assert asyncio.run(plain.find(set(), ["gone:1"])) == ["slow-even:50151", "fast-even:50151"]
    assert asyncio.run(ranked.find(set(), ["gone:1"])) == ["slow-short:50151", "fast-long:50151"]
    # keeping the current Shards still comes first
    assert asyncio.run(ranked.find(set(), ["slow-even:50151", "fast-even:50151"])) == \
        ["slow-even:50151", "fast-even:50151"]


@pytest.mark.parametrize("measured_all", [True, False])
def test_the_coverage_command_reports_the_ranking(monkeypatch, capsys, tmp_path, measured_all):
    import dgr.route.planner as planner
    import meshnet_adapter.coverage as coverage

    cov = even_and_spared(slow_head_measured=measured_all)
    monkeypatch.setattr(coverage, "register", lambda nodes, model, **kw: (cov, []))
    monkeypatch.setattr(planner, "model_shape", lambda path: SHAPE)
    assert coverage.main(["--model", str(tmp_path / "m.gguf"), "--node", "a=h:1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    routes = [[s["node"] for s in r] for r in doc["routes"]]
    if measured_all:
        assert routes == [["slow-short", "fast-long"], ["slow-even", "fast-even"]]
        assert doc["ranking"]["by"] == RANKED_BY_PREDICTION
        fast, slow = doc["ranking"]["predicted_tok_s"]
        assert fast > 1.5 * slow
        assert doc["registrations"][0]["measured"]["decode_s"]["4"] == pytest.approx(0.032)
    else:
        assert routes == [["slow-even", "fast-even"], ["slow-short", "fast-long"]]
        assert doc["ranking"] == {"by": RANKED_BY_SHAPE, "predicted_tok_s": [None, None], "notes": [
            f"ranked by {RANKED_BY_SHAPE}, not by the cost model: 1 shard(s) report no measured cost: "
            "slow-short[0:2]"]}
        assert "measured" not in doc["registrations"][2]
