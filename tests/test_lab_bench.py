"""`dgr bench route --hosts N`: the target table and summary from a synthetic results document,
and the CLI's input checks (no lab, no model needed)."""

from __future__ import annotations

import pytest

from typer.testing import CliRunner

from dgr.errors import DgrError
from dgr.lab.bench import COUNTERS, HostsBenchConfig, _where, balanced_split, even_split
from dgr.lab.bench_report import summary, targets
from dgr.main import app


def _run(decode: float, prefill: float = 0.0, c: int = 1) -> dict:
    return {"sessions": c, "decode_tok_s": decode, "prefill_tok_s": prefill, "seam_bytes_per_decode_token": 4800.0,
            "where": {"stages": [{"busy_share": 0.5, "decode_compute_ms_per_batch": 5.0, "rows_per_batch": c,
                                  "mean_queue_wait_ms": 0.1}] * 2, "step_ms": 11.0, "compute_ms_per_step": 10.0,
                      "handoff_ms_per_step": 1.0}}


def _res(scale: float) -> dict:
    return {"route": {"1": [_run(88 * scale), _run(90 * scale)], "4": [_run(100 * scale, c=4)] * 2,
                      "8": [_run(120 * scale, c=8)] * 2},
            "whole_worker": {"1": [_run(92)] * 2, "4": [_run(110, c=4)] * 2, "8": [_run(125, c=8)] * 2},
            "route_long_prefill": [_run(0, 600 * scale)] * 2, "whole_long_prefill": [_run(0, 580)] * 2,
            "rpc": [{"llama_bench": {"tg_tok_s": 85.0}, "batched_bench": {"by_batch": {"4": {"tg_tok_s": 100.0},
                                                                                        "8": {"tg_tok_s": 120.0}}}}] * 2,
            "lab": {"shaping": {"delay_mechanism": "proxy"}}}


def _doc() -> dict:
    lb = [{"pp_tok_s": 700.0, "pp_long_tok_s": 600.0, "tg_tok_s": 92.0}] * 2
    bb = [{"by_batch": {"4": {"tg_tok_s": 110.0}, "8": {"tg_tok_s": 125.0}}}] * 2
    return {"model": "/m/x.gguf", "hosts": 2, "split": ["0:15", "15:30"], "n_prompt": 128, "n_gen": 64,
            "long_prompt": 512, "repeats": 2, "seam_bytes_limit": 4864, "rpc_skipped": None,
            "one_host": {"llama_bench": lb, "batched_bench": bb}, "by_rtt": {"0": _res(1.0), "10": _res(0.5)}}


def test_targets_pair_each_repeat_and_judge_the_median():
    doc = _doc()
    all_t = targets(doc)
    t = {x["target"].split(":")[0]: x for x in all_t}
    one = t["1 session, no added latency"]
    assert one["per_repeat"] == [88 / 92, 90 / 92] and not one["met"]          # median 0.967 < 0.97
    eight = t["8 sessions, no added latency"]
    assert eight["median"] == 120 / 125 and not eight["met"] and eight["least"] == 1.6
    bound = 1 / (1 / 92 + 0.010)
    rtt1 = next(x for x in all_t if x["target"].startswith("10 ms RTT: 1-session"))
    assert rtt1["per_repeat"][0] == 44 / bound
    assert next(x for x in all_t if x["target"].startswith("0 ms added RTT: 8"))["per_repeat"] == [1.0, 1.0]
    seam = t["seam bytes per decode token per hop <= 2*n_embd*4 + 256"]
    assert seam["met"] and seam["limit"] == 4864
    doc["targets"] = targets(doc)
    text = summary(doc)
    assert "MISS 8 sessions" in text and "busy share 0.50/0.50" in text


def test_the_replica_ceiling_is_judged_per_repeat_when_measured():
    doc = _doc()
    doc["by_rtt"]["0"]["replicas"] = {"8": [{"decode_tok_s": 125.0}, {"decode_tok_s": 150.0}]}
    t = {x["target"].split(":")[0]: x for x in targets(doc)}
    rep = t["8 sessions against replicas, no added latency"]
    assert rep["per_repeat"] == [120 / 125, 120 / 150] and rep["least"] == 0.92
    assert rep["median"] == pytest.approx((0.96 + 0.8) / 2) and not rep["met"]
    assert "16 sessions against replicas, no added latency" not in t      # not measured: no line


def test_a_target_without_its_lane_is_not_judged():
    doc = {"one_host": {"llama_bench": [{"tg_tok_s": 90.0, "pp_long_tok_s": 100.0}], "batched_bench": []},
           "by_rtt": {"10": {"route": {"8": []}, "rpc": []}}, "long_prompt": 512, "hosts": 2,
           "seam_bytes_limit": 4864}
    t = {x["target"]: x for x in targets(doc)}
    one = next(v for k, v in t.items() if k.startswith("10 ms RTT: 1-session"))
    assert one["met"] is None and "not measured" in one["note"]


def test_a_run_with_only_some_session_counts():
    # --sessions 4,8: the seam is judged at 4 sessions; --sessions 1: no llama-batched-bench, and
    # the multi-session targets are not judged
    doc = _doc()
    for res in doc["by_rtt"].values():
        res["route"].pop("1")
    seam = next(x for x in targets(doc) if x["target"].startswith("seam bytes"))
    assert seam["met"] and seam["note"] == "4 session(s)" and seam["per_repeat"] == [4800.0, 4800.0]
    doc = _doc()
    doc["one_host"]["batched_bench"] = []
    for res in doc["by_rtt"].values():
        res["route"] = {"1": res["route"]["1"]}
        res["rpc"] = [{"llama_bench": {"tg_tok_s": 85.0}, "batched_bench": {"by_batch": {}}}]
    doc["targets"] = targets(doc)
    t = {x["target"].split(":")[0]: x for x in doc["targets"]}
    assert t["8 sessions, no added latency"]["met"] is None and t["1 session, no added latency"]["met"] is not None
    text = summary(doc)
    assert "N/A  8 sessions" in text and "llama-batched-bench" in text


def _stage(busy: float, batches: float, rows: float) -> dict:
    d = dict.fromkeys(COUNTERS, 0.0)
    d.update({"dgr_decode_busy_seconds_total": busy, "dgr_decode_only_busy_seconds_total": busy,
              "dgr_decode_only_batches_total": batches, "dgr_decode_only_rows_total": rows})
    return d


def test_where_time_goes_when_stages_take_turns_and_when_they_overlap():
    zero = [dict.fromkeys(COUNTERS, 0.0)] * 2
    # 1 session, 100 tokens at 70 tok/s: 6 + 7 ms of compute per token, the rest is hand-off
    w = _where(zero, [_stage(0.6, 100, 100), _stage(0.7, 100, 100)], 2.0, 70.0)
    assert [s["decode_busy_share"] for s in w["stages"]] == pytest.approx([0.42, 0.49])
    assert not w["stages_overlap"]
    assert w["handoff_ms_per_step"] == pytest.approx(1e3 / 70 - 13.0)
    # 8 sessions in 2 groups of 4 at 170 tok/s: 5.25 and 5 ms per token, both stages busy most
    # of the time at once; step minus compute would be negative, so no hand-off is given
    w = _where(zero, [_stage(4.2, 200, 800), _stage(4.0, 200, 800)], 5.0, 170.0)
    assert [s["decode_busy_share"] for s in w["stages"]] == pytest.approx([0.8925, 0.85])
    assert w["stages_overlap"] and w["handoff_ms_per_step"] is None
    doc = _doc()
    doc["by_rtt"]["0"]["route"]["8"] = [{**_run(170.0, c=8), "where": w}] * 2
    doc["targets"] = targets(doc)
    assert "decode busy share 0.89/0.85" in summary(doc) and "stages overlap" in summary(doc)


def test_the_one_host_yardstick_is_the_mean_of_the_hosts():
    # h2 is slower than h1 (on a VM each host is a vCPU): targets are judged against the mean of
    # both per repeat, and the ratios against h1 alone are kept
    doc = _doc()
    doc["other_hosts"] = {"h2": {
        "llama_bench": [{"pp_tok_s": 600.0, "pp_long_tok_s": 500.0, "tg_tok_s": 84.0}] * 2,
        "batched_bench": [{"by_batch": {"4": {"tg_tok_s": 100.0}, "8": {"tg_tok_s": 115.0}}}] * 2}}
    t = {x["target"].split(":")[0]: x for x in targets(doc)}
    one = t["1 session, no added latency"]
    assert one["per_repeat"] == [88 / 88, 90 / 88] and one["met"]
    assert one["per_repeat_vs_h1"] == [88 / 92, 90 / 92]
    assert t["8 sessions, no added latency"]["per_repeat"] == [120 / 120, 120 / 120]
    prefill = next(v for k, v in t.items() if k.startswith("prefill"))
    assert prefill["per_repeat"] == [600 / 550, 600 / 550]
    doc["targets"] = targets(doc)
    text = summary(doc)
    assert "one host (h2): llama-bench" in text and "yardstick of the targets: mean of h1, h2" in text
    # a host measured fewer times than h1 (an interrupted run): h1 alone, said so
    doc["other_hosts"]["h2"]["llama_bench"] = doc["other_hosts"]["h2"]["llama_bench"][:1]
    assert "per_repeat_vs_h1" not in targets(doc)[0]
    assert "yardstick of the targets: h1 " in summary(doc)


def test_even_split():
    assert even_split(30, 2) == [(0, 15), (15, 30)]
    assert even_split(30, 3) == [(0, 10), (10, 20), (20, 30)]
    assert even_split(30, 4)[-1][1] == 30


def test_balanced_split_weighs_the_output_matrix_on_the_tail():
    # equal layers and no output: even
    assert balanced_split([1] * 8, 0, 2) == [(0, 4), (4, 8)]
    # the tail's output matrix weighs 4 layers: the head takes more layers
    assert balanced_split([1] * 8, 4, 2) == [(0, 6), (6, 8)]
    # SmolLM2-135M Q4_1's shape: 30 layers of 3540096 weights, a 28311552-weight output matrix
    split = balanced_split([3540096] * 30, 28311552, 2)
    assert split == [(0, 19), (19, 30)]
    # the largest stage is the least possible: no other cut does better
    cost = lambda c: max(c * 3540096, (30 - c) * 3540096 + 28311552)  # noqa: E731
    assert cost(19) == min(cost(c) for c in range(1, 30))
    # three hosts: contiguous, covering, each non-empty
    s3 = balanced_split([5, 1, 1, 1, 1, 5], 2, 3)
    assert s3[0][0] == 0 and s3[-1][1] == 6 and all(a < b for a, b in s3)
    assert all(x[1] == y[0] for x, y in zip(s3, s3[1:]))
    with pytest.raises(DgrError):
        balanced_split([1, 1], 0, 3)


def test_bench_hosts_bad_input_is_one_line():
    r = CliRunner().invoke(app, ["bench", "route", "--hosts", "2", "--rtt-ms", "x"])
    assert r.exit_code != 0 and "comma-separated" in str(r.exception)
    r = CliRunner().invoke(app, ["route", "generate", "--shard", "127.0.0.1:1", "--prompt", "p", "--tls-cert", "c.pem"])
    assert r.exit_code != 0 and "--tls-ca" in str(r.exception)


@pytest.mark.parametrize("args, says", [
    (["--rtt-ms", "nan"], "--rtt-ms needs"), (["--rtt-ms", "1e9"], "--rtt-ms needs"), (["--rtt-ms", "-5"], "--rtt-ms needs"),
    (["--sessions", "0"], "--sessions needs"), (["--sessions", "100000"], "--sessions needs"),
    (["--repeats", "100000"], "--repeats"), (["--long-prompt", "999999999"], "--long-prompt"),
    (["--hosts", "1"], "--hosts must be 2..16"), (["--hosts", "17"], "--hosts must be 2..16"),
    (["--rate-mbit", "0"], "--rate-mbit"),
])
def test_bench_hosts_refuses_before_a_lab_comes_up(args, says, tmp_path):
    """Checked before any lab, build or model: these return at once, without namespaces."""
    r = CliRunner().invoke(app, ["bench", "route", "--hosts", "2", "--no-rpc", "--out", str(tmp_path / "r.json"), *args])
    assert r.exit_code != 0
    assert says in (str(r.exception) + r.output)
    assert not (tmp_path / "r.json").exists()


def test_bench_out_checked_first(tmp_path):
    r = CliRunner().invoke(app, ["bench", "route", "--hosts", "2", "--no-rpc", "--out", str(tmp_path)])
    assert r.exit_code != 0 and "is a directory" in str(r.exception)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = CliRunner().invoke(app, ["bench", "route", "--hosts", "2", "--no-rpc", "--out", str(blocker / "r.json")])
    assert r.exit_code != 0 and "cannot write there" in str(r.exception)
    assert not list(tmp_path.glob(".dgr-out-check-*"))


def test_hosts_bench_config_bounds():
    HostsBenchConfig(sessions=(1, 256), rtts_ms=(0.0, 60_000.0), repeats=50, rate_mbit=100.0).validate()
    for bad in (HostsBenchConfig(sessions=()), HostsBenchConfig(rtts_ms=(float("inf"),)), HostsBenchConfig(repeats=0),
                HostsBenchConfig(n_prompt=30_000, n_gen=5_000), HostsBenchConfig(hosts=1),
                HostsBenchConfig(rate_mbit=0.0), HostsBenchConfig(rate_mbit=float("nan"))):
        with pytest.raises(DgrError):
            bad.validate()
