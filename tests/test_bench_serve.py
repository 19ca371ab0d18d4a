"""`dgr bench serve`'s arithmetic on synthetic lane results (no processes): aggregate decode and
TTFT per lane, the ratios against their targets, and where the CPU time went."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("openai")

from dgr.bench import serve as sb  # noqa: E402
from dgr.bench.loadgen import LevelResult, RequestResult  # noqa: E402


def _level(lane: str, n: int, *, ttft: float, tok_s_each: float, tokens: int = 65, cpu=None,
           route_ttft: float | None = None, per_chunk: int = 1) -> LevelResult:
    """``n`` requests whose tokens come evenly at ``tok_s_each``, ``per_chunk`` tokens per event."""
    reqs = []
    for i in range(n):
        first = ttft + 0.001 * i
        chunks = [first + k / tok_s_each for k in range(0, tokens, per_chunk)] + [first + (tokens - 1) / tok_s_each]
        reqs.append(RequestResult(30, tokens, ttft, first, first + (tokens - 1) / tok_s_each, route_ttft_s=route_ttft,
                                  chunk_times_s=sorted(set(chunks))))
    return LevelResult(lane, n, reqs, 2.0, cpu or {})


def test_aggregate_decode_counts_tokens_after_the_first_over_the_common_window():
    lv = _level("x", 4, ttft=0.05, tok_s_each=20.0)
    # 4 x 64 tokens over [0.05, 0.053 + 3.2]
    assert lv.aggregate_decode_tok_s == pytest.approx(4 * 64 / (3.2 + 0.003))
    assert lv.ttft_p50_s == pytest.approx(0.05)
    lv.requests[0].error = "boom"
    assert not lv.ok


class _Srv:
    cmd = ["llama-server", "-np", "8"]


def _doc(gw_decode: float, gw_ttft: float, whole_decode: float, whole_ttft: float, gw_route_ttft=0.050,
         per_chunk: int = 1):
    runs = {}
    for level in (1, 4):
        runs[("driver_split", level)] = [_level("driver_split", level, ttft=0.050, tok_s_each=20.0,
                                                cpu={"bench_client": 0.4, "split_worker_0": 2.0})]
        runs[("gateway_split", level)] = [_level("gateway_split", level, ttft=gw_ttft, tok_s_each=gw_decode,
                                                 cpu={"gateway_split": 0.3, "bench_client": 0.2},
                                                 route_ttft=gw_route_ttft, per_chunk=per_chunk)]
        runs[("gateway_whole", level)] = [_level("gateway_whole", level, ttft=whole_ttft, tok_s_each=whole_decode,
                                                 per_chunk=per_chunk)]
        runs[("llama_server", level)] = [_level("llama_server", level, ttft=0.040, tok_s_each=21.0)]
    cfg = sb.ServeBenchConfig(levels=(1, 4), max_tokens=65, repeats=1)
    return sb._document(Path("/m.gguf"), cfg, [(0, 15), (15, 30)], 2, runs, (1.0, 1.0, 1.0), (2.0, 2.0, 2.0), 10.0,
                        _Srv(), 1000)


def test_targets_met_and_missed_are_reported_per_level():
    ok = _doc(gw_decode=19.8, gw_ttft=0.053, whole_decode=21.0, whole_ttft=0.042)
    assert ok["all_met"], ok["checks"]
    lv = ok["results"][1]
    assert lv["comparisons"]["gateway_vs_driver_decode"] == pytest.approx(0.99, abs=0.005)
    assert lv["comparisons"]["gateway_ttft_overhead_s"] == pytest.approx(0.003)
    assert lv["comparisons"]["gateway_vs_driver_ttft_p50_diff_s"] == pytest.approx(0.003)
    assert lv["comparisons"]["gateway_ttft_overhead_requests"] == 4
    assert lv["comparisons"]["whole_vs_llama_server_ttft_ratio"] == pytest.approx(1.05)
    bad = _doc(gw_decode=18.0, gw_ttft=0.060, whole_decode=24.5, whole_ttft=0.050)
    missed = {(c["concurrency"], c["check"]) for c in bad["checks"] if not c["met"]}
    assert (4, "gateway_vs_driver_decode") in missed and (1, "gateway_ttft_overhead_s") in missed
    assert (4, "whole_vs_llama_server_ttft_ratio") in missed            # 50 ms vs 40 ms: 25 % off
    assert (4, "whole_vs_llama_server_decode") not in missed
    assert not bad["all_met"]
    # where the time went: the gateway's process and the HTTP client next to the driver's CPU
    where = bad["results"][0]["where_time_goes"]
    assert where["gateway_split"]["gateway_process_cpu_s"] == 0.3 and where["driver_split"]["driver_cpu_s"] == 0.4
    json.dumps(bad)                                # the document is plain JSON
    assert "MISSED" in sb.summary(bad) and "gateway_split" in sb.summary(bad)


def test_ttft_overhead_is_per_request_and_never_passes_without_server_timing():
    # the gateway lane's compute was slower (60 ms vs the driver's 50) but its route took 58 ms of
    # it: the overhead HTTP added is 2 ms, whatever the lanes' compute noise
    doc = _doc(gw_decode=19.8, gw_ttft=0.060, whole_decode=24.5, whole_ttft=0.042, gw_route_ttft=0.058)
    lv = doc["results"][0]
    assert lv["comparisons"]["gateway_ttft_overhead_s"] == pytest.approx(0.002)
    assert lv["comparisons"]["gateway_vs_driver_ttft_p50_diff_s"] == pytest.approx(0.010)
    assert lv["met"]["gateway_ttft_overhead_s"]
    # no route timing on the answers: the check is not met, and says why
    blind = _doc(gw_decode=19.8, gw_ttft=0.051, whole_decode=24.5, whole_ttft=0.042, gw_route_ttft=None)
    c = next(c for c in blind["checks"] if c["check"] == "gateway_ttft_overhead_s")
    assert c["value"] is None and not c["met"] and "server_timing" in c["note"]
    assert not blind["all_met"]
    json.dumps(blind, allow_nan=False)


def test_every_lane_serves_the_same_requests_at_every_level():
    assert [sb.rotations(level, 8, 2) for level in (1, 4, 8)] == [16, 4, 2]
    assert sb.rotations(3, 8, 1) == 3          # ceil(8 / 3): never fewer requests than the top level
    assert sb.default_threads() >= 1


def test_every_bench_json_records_the_tree_it_ran_from(tmp_path):
    import subprocess

    from dgr import paths
    from dgr.commands import bench as cmd

    cmd._started_at.clear()
    cmd._tree_state()                     # what `dgr bench …` runs before any benchmark
    out = tmp_path / "r.json"
    cmd._write(out, {"bench": "x"}, "summary")
    git = json.loads(out.read_text())["git"]
    head = subprocess.run(["git", "-C", str(paths.repo_root()), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    assert git["git_commit"] == head and isinstance(git["git_dirty"], bool)
    assert json.loads(out.read_text())["bench"] == "x"


def test_streaming_cadence_per_lane_and_its_targets():
    # one event per token, tokens every 1/21 s on the whole model and llama-server alike
    even = _doc(gw_decode=19.8, gw_ttft=0.053, whole_decode=21.0, whole_ttft=0.042)
    lv = even["results"][0]
    whole = lv["cadence"]["gateway_whole"]
    assert whole["chunks_per_token"] == pytest.approx(1.0) and whole["gaps"] == 64
    assert whole["itl_p50_s"] == pytest.approx(1 / 21.0) and whole["max_gap_s"] == pytest.approx(1 / 21.0)
    assert lv["comparisons"]["whole_vs_llama_server_itl_p50"] == pytest.approx(1.0)
    assert lv["comparisons"]["split_vs_whole_itl_p50"] == pytest.approx(21.0 / 19.8)
    assert all(lv["met"][k] for k in ("gateway_chunks_per_token", "whole_vs_llama_server_itl_p50",
                                      "whole_vs_llama_server_itl_p99", "split_vs_whole_itl_p50"))
    # the same decode rate in bursts of 4 tokens: a quarter of the events, gaps 4x as long
    bursts = _doc(gw_decode=19.8, gw_ttft=0.053, whole_decode=21.0, whole_ttft=0.042, per_chunk=4)
    lv = bursts["results"][0]
    assert lv["cadence"]["gateway_whole"]["chunks_per_token"] == pytest.approx(17 / 65)
    assert lv["comparisons"]["whole_vs_llama_server_itl_p50"] == pytest.approx(4.0)
    assert lv["aggregate_decode_tok_s"]["gateway_whole"] == even["results"][0]["aggregate_decode_tok_s"]["gateway_whole"]
    missed = {c["check"] for c in bursts["checks"] if not c["met"]}
    assert {"gateway_chunks_per_token", "whole_vs_llama_server_itl_p50", "whole_vs_llama_server_itl_p99"} <= missed
    assert "ITL p50" in sb.summary(bursts)
    json.dumps(bursts, allow_nan=False)
