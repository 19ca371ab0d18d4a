"""The route planner and `dgr plan` (cli/dgr/route/planner.py), on fake capabilities: no worker,
no model run. Predictions only; the lab checks them against measurement."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from dgr.errors import DgrError
from dgr.route.planner import (HostCapability, Link, ModelShape, Overheads, Workload, _interpolate, even_ranges,
                               model_shape, parse_capabilities, plan_route, predict)

GIB = 1 << 30
# SmolLM2-135M-like: 30 equal layers, a tied 49k x 576 output matrix that costs ~8 layers a row
SMOL = ModelShape.uniform(30, layer_bytes=2_000_000, output_bytes=30_000_000, embed_bytes=30_000_000, n_embd=576,
                          kv_bytes_per_cell_layer=768, tied=True, name="smol-like")


def cap(name: str, slow: float = 1.0, memory: int = 4 * GIB) -> HostCapability:
    # one core's figures (CPU decode grows about linearly with rows past a few), times `slow`
    return HostCapability(name, {1: 0.00033 * slow, 4: 0.0010 * slow, 8: 0.0019 * slow, 16: 0.0037 * slow},
                          0.00012 * slow, {1: 0.0028 * slow, 4: 0.0040 * slow, 8: 0.0058 * slow, 16: 0.0095 * slow},
                          0.0028 * slow, memory, 0.00001)


def test_interpolate_between_and_beyond_the_measured_batches():
    t = {1: 1.0, 4: 2.5, 8: 4.5}
    assert _interpolate(t, 1) == 1.0
    assert _interpolate(t, 2) == pytest.approx(1.5)
    assert _interpolate(t, 6) == pytest.approx(3.5)
    assert _interpolate(t, 16) == pytest.approx(4.5 + 0.5 * 8)   # the last segment's slope
    assert _interpolate({1: 2.0}, 3) == pytest.approx(6.0)         # one figure: per row


def test_prediction_pipeline_arithmetic():
    m = ModelShape.uniform(4, layer_bytes=1, output_bytes=1, embed_bytes=1, n_embd=4, kv_bytes_per_cell_layer=1)
    h = HostCapability("a", {1: 1.0, 2: 2.0}, 1.0, {1: 1.0, 2: 2.0}, 1.0, GIB)
    link, none = Link(rtt_s=0.0, bandwidth_bytes_s=1e12), Overheads(token_s=0.0, step_s=0.0, hop_s=0.0)
    one = predict(m, [h, h], [(0, 2), (2, 4)], link, Workload(sessions=2, prompt_tokens=1), groups=1, overheads=none)
    # stage 0: 2 layers x 2 s (2 rows); stage 1: 2 layers x 2 s + output 2 s
    assert [s.decode_s for s in one.stages] == pytest.approx([4.0, 6.0])
    assert one.round_s == pytest.approx(10.0) and one.aggregate_tok_s == pytest.approx(0.2)
    two = predict(m, [h, h], [(0, 2), (2, 4)], link, Workload(sessions=2, prompt_tokens=1), groups=2, overheads=none)
    # groups of one row: stages 2 s and 3 s; round = max(cycle 5 s, 2 x 3 s)
    assert two.round_s == pytest.approx(6.0) and two.aggregate_tok_s == pytest.approx(2 / 6)
    assert two.stages[1].busy_share == pytest.approx(1.0) and two.stages[0].busy_share == pytest.approx(4 / 6)
    # a tail host with half a core's duty: bursts as fast, but kept busy it computes half the time
    half = HostCapability("h", {1: 1.0, 2: 2.0}, 1.0, {1: 1.0, 2: 2.0}, 1.0, GIB, duty=0.5)
    slow = predict(m, [h, half], [(0, 2), (2, 4)], link, Workload(sessions=2, prompt_tokens=1), groups=2,
                   overheads=none)
    assert slow.round_s == pytest.approx(12.0)   # 2 groups x 3 s / 0.5
    alone = predict(m, [h, half], [(0, 2), (2, 4)], link, Workload(sessions=1, prompt_tokens=1), overheads=none)
    assert alone.single_session_tok_s == pytest.approx(1 / 6.0)   # 3 s of tail compute per 6 s at duty 0.5
    # the driver's share sits on the head's host
    drv = predict(m, [h, h], [(0, 2), (2, 4)], link, Workload(sessions=2, prompt_tokens=1), groups=1,
                  overheads=Overheads(token_s=0.5, step_s=0.25, hop_s=0.0))
    assert drv.stages[0].decode_s == pytest.approx(4.0 + 2 * 0.5) and drv.round_s == pytest.approx(10.0 + 1.0 + 0.25)
    # two hosts on one core: their stages add up there (a pipeline cannot overlap them)
    shared = [dataclasses.replace(h, name="x", core="c0"), dataclasses.replace(h, name="y", core="c0")]
    both = predict(m, shared, [(0, 2), (2, 4)], link, Workload(sessions=2, prompt_tokens=1), groups=2,
                   overheads=none)
    assert both.round_s == pytest.approx(2 * (2.0 + 3.0))   # against 6 s on two cores (above)
    # a hop's overhead: half on each end, all of it on the trip
    hop = predict(m, [h, h], [(0, 2), (2, 4)], link, Workload(sessions=2, prompt_tokens=1), groups=1,
                  overheads=Overheads(token_s=0.0, step_s=0.0, hop_s=1.0))
    assert [s.decode_s for s in hop.stages] == pytest.approx([4.5, 6.5]) and hop.round_s == pytest.approx(11.0)
    with pytest.raises(DgrError, match="contiguously"):
        predict(m, [h, h], [(0, 1), (2, 4)], link, Workload())
    # one Shard batches every ready row: no groups without a second stage
    solo = predict(m, [h], [(0, 4)], link, Workload(sessions=2, prompt_tokens=1), groups=2, overheads=none)
    assert solo.groups == 1 and solo.rows_per_group == 2 and solo.round_s == pytest.approx(4 * 2.0 + 2.0)


@pytest.mark.parametrize("sessions", [1, 8])
def test_identical_hosts_plan_at_least_as_fast_as_every_hand_split(sessions):
    hosts, link, w = [cap("a"), cap("b")], Link(), Workload(sessions=sessions, prompt_tokens=128, ctx_per_session=512)
    p = plan_route(SMOL, hosts, link, w)
    best_hand = max(predict(SMOL, hosts, [(0, c), (c, 30)], link, w, g).aggregate_tok_s
                    for c in range(1, 30) for g in range(1, min(sessions, 3) + 1))
    assert p.prediction.aggregate_tok_s >= best_hand * (1 - 1e-9)


def test_a_half_speed_host_gets_fewer_layers_and_the_route_beats_the_even_split():
    hosts, link = [cap("fast"), cap("half", slow=2.0)], Link()
    for sessions in (1, 8):
        w = Workload(sessions=sessions, prompt_tokens=128, ctx_per_session=512)
        p = plan_route(SMOL, hosts, link, w)
        even = max(predict(SMOL, hosts, even_ranges(30, 2), link, w, g).aggregate_tok_s for g in (1, 2, 3))
        alone = plan_route(SMOL, hosts[:1], link, w).prediction.aggregate_tok_s
        assert p.prediction.aggregate_tok_s > even
        assert p.prediction.aggregate_tok_s >= alone * (1 - 1e-9), "adding a host never plans a slower route"
        if len(p.hosts) == 2:
            (a0, a1), (b0, b1) = [tuple(map(int, r.split(":"))) for r in p.split.split(",")]
            assert a1 - a0 > b1 - b0
        else:
            assert p.dropped and p.dropped[0]["host"] == "half" and "faster without it" in p.dropped[0]["why"]


def test_a_very_slow_host_is_left_out_and_named():
    p = plan_route(SMOL, [cap("fast"), cap("crawl", slow=20.0)], Link(), Workload(sessions=8, ctx_per_session=512))
    assert p.hosts == ["fast"] and p.split == "0:30"
    assert p.dropped == [{"host": "crawl", "why": p.dropped[0]["why"]}]
    assert "faster without it" in p.dropped[0]["why"]


def test_memory_decides_the_split_when_no_host_holds_the_model():
    big = ModelShape.uniform(32, layer_bytes=200 << 20, output_bytes=500 << 20, embed_bytes=500 << 20, n_embd=4096,
                             kv_bytes_per_cell_layer=4096, name="8b-like")
    w = Workload(sessions=4, prompt_tokens=256, ctx_per_session=1024)
    hosts = [cap("a", memory=5 * GIB), cap("b", memory=5 * GIB), cap("tiny", memory=100 << 20)]
    p = plan_route(big, hosts, Link(), w)
    assert p.hosts == ["a", "b"]
    assert all(s.memory_bytes <= s.memory_budget_bytes for s in p.prediction.stages)
    assert p.dropped == [{"host": "tiny", "why": "it cannot hold any layer range of this route within its memory"}]
    with pytest.raises(DgrError, match="no subset of the 2 hosts holds 8b-like"):
        plan_route(big, [cap("a", memory=2 * GIB), cap("b", memory=2 * GIB)], Link(), w)
    one = plan_route(big, [cap("a", memory=16 * GIB), cap("b", memory=5 * GIB)], Link(), w)
    assert one.hosts[0] == "a" and all(s.memory_bytes <= s.memory_budget_bytes for s in one.prediction.stages)


def test_latency_bound_limits_pipeline_groups():
    hosts, w = [cap("a"), cap("b")], Workload(sessions=16, prompt_tokens=64, ctx_per_session=256)
    loose = plan_route(SMOL, hosts, Link(), w, latency_bound=100.0)
    tight = plan_route(SMOL, hosts, Link(), w, latency_bound=1.0)
    assert tight.prediction.token_latency_s <= tight.latency_bound_s * (1 + 1e-9)
    assert tight.prediction.token_latency_s <= loose.prediction.token_latency_s * (1 + 1e-9)
    assert tight.prediction.aggregate_tok_s <= loose.prediction.aggregate_tok_s * (1 + 1e-9)
    with pytest.raises(DgrError, match="latency bound"):
        plan_route(SMOL, hosts, Link(), w, latency_bound=0.5)


def _caps_doc(**over):
    h = {"name": "a", "layer_decode_s": {"1": 0.001, "8": 0.004}, "layer_prefill_s": 0.0002,
         "output_decode_s": {"1": 0.003}, "output_prefill_s": 0.003, "memory_bytes": 1 << 30}
    h.update(over)
    return {"schema": "dgr.capabilities.v1", "hosts": [h]}


@pytest.mark.parametrize("over,match", [
    ({"layer_decode_s": {}}, "layer_decode_s"),
    ({"layer_decode_s": {"x": 0.1}}, "batch size 'x'"),
    ({"layer_decode_s": {"0": 0.1}}, "within 1..4096"),
    ({"layer_decode_s": {"1": -1}}, "seconds in"),
    ({"layer_decode_s": {"1": True}}, "seconds in"),
    ({"layer_decode_s": {"1": float("nan")}}, "seconds in"),
    ({"layer_prefill_s": None}, "layer_prefill_s"),
    ({"output_prefill_s": "fast"}, "output_prefill_s"),
    ({"memory_bytes": 0}, "memory_bytes"),
    ({"memory_bytes": 1.5}, "memory_bytes"),
    ({"memory_bytes": True}, "memory_bytes"),
    ({"memory_bytes": 10 ** 20}, "memory_bytes"),
    ({"layer_decode_s": {"1": 1e308}}, "seconds in"),
    ({"output_prefill_s": 1e5}, "seconds in"),
    ({"embed_s": -0.1}, "embed_s"),
    ({"duty": 0}, "duty"),
    ({"duty": 1.5}, "duty"),
])
def test_bad_capabilities_are_refused_naming_the_field(over, match):
    with pytest.raises(DgrError, match=match):
        parse_capabilities(_caps_doc(**over))


def test_capability_documents_refused_whole():
    with pytest.raises(DgrError, match="schema"):
        parse_capabilities({**_caps_doc(), "schema": "other"})
    with pytest.raises(DgrError, match="non-empty list"):
        parse_capabilities({"hosts": []})
    many = _caps_doc()
    many["hosts"] = [dict(many["hosts"][0], name=f"h{i}") for i in range(9)]
    with pytest.raises(DgrError, match="at most 8"):
        parse_capabilities(many)
    with pytest.raises(DgrError, match="at most 8"):
        plan_route(SMOL, [cap(f"h{i}") for i in range(9)], Link(), Workload())
    with pytest.raises(DgrError, match="an object"):
        parse_capabilities([1, 2])
    doc = _caps_doc()
    doc["hosts"].append(dict(doc["hosts"][0]))
    with pytest.raises(DgrError, match="distinct"):
        parse_capabilities(doc)
    with pytest.raises(DgrError, match="link"):
        parse_capabilities({**_caps_doc(), "link": {"rtt_ms": -1, "bandwidth_mbit": 10}})
    for bad in ({"bandwidth_mbit": 1e-320}, {"bandwidth_mbit": 1e9}, {"rtt_ms": 1e6}, {"rtt_ms": True}):
        with pytest.raises(DgrError, match="link"):
            parse_capabilities({**_caps_doc(), "link": {"rtt_ms": 1, "bandwidth_mbit": 10, **bad}})
    hosts, link = parse_capabilities({**_caps_doc(), "link": {"rtt_ms": 2, "bandwidth_mbit": 100}})
    assert hosts[0].layer_decode_s == {1: 0.001, 8: 0.004}
    assert link.rtt_s == pytest.approx(0.002) and link.bandwidth_bytes_s == pytest.approx(12.5e6)


def _dgr(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgr.main", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def tiny_model(tmp_path):
    from dgr.gguf.synth import SynthSpec, synthesize
    return synthesize(SynthSpec(n_layer=6, dtype="q8_0"), tmp_path / "tiny.gguf")


def test_model_shape_reads_the_gguf(tiny_model):
    s = model_shape(tiny_model)
    assert s.n_layer == 6 and len(s.layer_bytes) == 6 and all(b > 0 for b in s.layer_bytes)
    assert s.kv_bytes_per_cell_layer > 0 and s.n_embd > 0 and s.embed_bytes > 0


def test_dgr_plan_json_and_text(tmp_path, tiny_model):
    caps = tmp_path / "caps.json"
    doc = {"schema": "dgr.capabilities.v1", "link": {"rtt_ms": 1, "bandwidth_mbit": 1000},
           "hosts": [{"name": "fast", "layer_decode_s": {"1": 0.001, "8": 0.006}, "layer_prefill_s": 0.0002,
                      "output_decode_s": {"1": 0.004, "8": 0.01}, "output_prefill_s": 0.004, "memory_bytes": 1 << 30},
                     {"name": "slow", "layer_decode_s": {"1": 0.002, "8": 0.012}, "layer_prefill_s": 0.0004,
                      "output_decode_s": {"1": 0.008, "8": 0.02}, "output_prefill_s": 0.008, "memory_bytes": 1 << 30}]}
    caps.write_text(json.dumps(doc))
    p = _dgr("plan", "-c", str(caps), "--model", str(tiny_model), "--sessions", "8", "--compare", "even", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["kind"] == "prediction" and out["n_layer"] == 6
    ranges = [tuple(map(int, r.split(":"))) for r in out["split"].split(",")]
    assert ranges[0][0] == 0 and ranges[-1][1] == 6 and len(ranges) == len(out["hosts"])
    assert out["prediction"]["aggregate_tok_s"] >= out["compare"]["prediction"]["aggregate_tok_s"] * (1 - 1e-9)
    t = _dgr("plan", "-c", str(caps), "--model", str(tiny_model), "--sessions", "1")
    assert t.returncode == 0, t.stderr
    assert "predicted: aggregate decode" in t.stdout and "1 session," in t.stdout
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    e = _dgr("plan", "-c", str(bad), "--model", str(tiny_model))
    assert e.returncode != 0 and "is not JSON" in e.stderr and "Traceback" not in e.stderr
    e = _dgr("plan", "-c", str(caps), "--model", str(tiny_model), "--compare", "0:2,2:4,4:6")
    assert e.returncode != 0 and "3 ranges for 2 hosts" in e.stderr and "Traceback" not in e.stderr
    e = _dgr("plan", "-c", str(tmp_path / "missing.json"), "--model", str(tiny_model))
    assert e.returncode != 0 and "cannot read" in e.stderr and "Traceback" not in e.stderr


@pytest.mark.parametrize("kw,match", [
    ({"cpu_quota": (None,)}, "2 to 8 hosts"),
    ({"cpu_quota": (None, 1.5)}, "0.05..1"),
    ({"cpu_quota": (None, float("nan"))}, "0.05..1"),
    ({"sessions": ()}, "--sessions"),
    ({"sessions": (0,)}, "--sessions"),
    ({"repeats": 0}, "--repeats"),
    ({"probe_budget_s": 0.1}, "--probe-budget-s"),
])
def test_plan_bench_config_refused_before_a_lab_comes_up(kw, match):
    from dgr.lab.plan_bench import PlanBenchConfig
    with pytest.raises(DgrError, match=match):
        PlanBenchConfig(**kw).validate()


def test_dgr_bench_plan_refuses_a_single_quota(tmp_path):
    p = _dgr("bench", "plan", "--cpu-quota", "0.5", "--out", str(tmp_path / "x.json"))
    assert p.returncode != 0 and "one value per host" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "x.json").exists()


def test_plan_bench_compare_and_cpus_must_name_every_host():
    from dgr.lab.plan_bench import PlanBenchConfig
    with pytest.raises(DgrError, match="1 ranges for 2 hosts"):
        PlanBenchConfig(compare=((0, 30),)).validate()
    PlanBenchConfig(compare=((0, 19), (19, 30))).validate()
    with pytest.raises(DgrError, match="2 sets for 3 hosts"):
        PlanBenchConfig(cpu_quota=(None, None, None), cpus=("0", "1")).validate()
    PlanBenchConfig(cpu_quota=(None, None, None), cpus=("0", "1", "1")).validate()
