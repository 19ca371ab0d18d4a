"""dgr bench worker: saturation, per-mode rows and the summary (unit), and a short real-lane run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dgr.bench import worker as wb


def test_saturation_is_the_last_level_that_still_grew():
    rows = [{"sessions": 1, "worker_decode_tokens_per_s": 100.0},
            {"sessions": 2, "worker_decode_tokens_per_s": 150.0},
            {"sessions": 4, "worker_decode_tokens_per_s": 152.0},
            {"sessions": 8, "worker_decode_tokens_per_s": 120.0}]
    assert wb.saturation(rows) == 2
    assert wb.saturation(rows[:2]) is None


def _measured(tps: float, occ: float) -> dict[str, float]:
    return {"decode_tokens_per_s": tps, "decode_wall_s": 1.0, "batches": 10.0, "dgr_batch_occupancy_avg": occ,
            "decode_busy_fraction": 0.5}


def _doc() -> dict:
    rows = [wb.level_row(1, {"stepwise": _measured(40.0, 1.0), "server_generation": _measured(46.0, 1.0)}, 50.0),
            wb.level_row(4, {"stepwise": _measured(90.0, 3.1), "server_generation": _measured(120.0, 3.9)}, 125.0)]
    return {"levels": rows, "saturation_sessions": wb.saturation(rows),
            "stepwise_saturation_sessions": wb.saturation(rows, "stepwise"), "target_ratio": wb.TARGET_RATIO,
            "target_mode": wb.TARGET_MODE, "meets_target": wb.meets(rows),
            "stepwise_meets_target": wb.meets(rows, "stepwise")}


def test_level_rows_keep_the_legacy_keys_from_server_generation():
    doc = _doc()
    one, four = doc["levels"]
    assert one["worker_decode_tokens_per_s"] == 46.0 and one["ratio"] == pytest.approx(0.92)
    assert four["dgr_batch_occupancy_avg"] == 3.9 and four["batches"] == 10.0
    assert four["stepwise"]["ratio"] == pytest.approx(0.72) and four["server_generation"]["ratio"] == pytest.approx(0.96)
    assert set(one["stepwise"]) == set(one["server_generation"]) == {
        "worker_decode_tokens_per_s", "ratio", "dgr_batch_occupancy_avg", "batches", "decode_busy_fraction"}
    assert doc["meets_target"] and not doc["stepwise_meets_target"]
    assert wb.level_row(2, {"stepwise": _measured(1, 1), "server_generation": _measured(1, 1)}, None)["ratio"] is None
    assert not wb.meets([wb.level_row(2, {"stepwise": _measured(1, 1), "server_generation": _measured(1, 1)}, None)])


def test_summary_prints_both_ratios():
    text = wb.summary(_doc())
    assert "server-gen tok/s" in text and "stepwise ratio" in text
    line4 = next(ln for ln in text.splitlines() if ln.split()[:1] == ["4"])
    assert "0.96" in line4 and "0.72" in line4
    assert "(server_generation, best of the repeats): met" in text and "stepwise: not met" in text


@pytest.mark.native
@pytest.mark.real
def test_bench_worker_writes_json(native_bin: Path, smollm2_path: Path, tmp_path: Path):
    if not (native_bin / "llama-batched-bench").is_file():
        pytest.skip("llama-batched-bench not built")
    cfg = wb.WorkerBenchConfig(levels=(1, 4), prompt_tokens=16, gen_tokens=16, repeats=1)
    doc = wb.run_worker_bench(smollm2_path, cfg, worker_bin=native_bin / "dgr-worker",
                              batched_bench=native_bin / "llama-batched-bench")
    (tmp_path / "b.json").write_text(json.dumps(doc))
    rows = {r["sessions"]: r for r in doc["levels"]}
    assert rows[1]["worker_decode_tokens_per_s"] > 0 and rows[1]["llama_batched_bench_tg_tokens_per_s"] > 0
    assert rows[4]["dgr_batch_occupancy_avg"] > 1.5  # batching in use (server generation)
    assert rows[4]["stepwise"]["dgr_batch_occupancy_avg"] > 1.5
    assert rows[1]["stepwise"]["worker_decode_tokens_per_s"] > 0
    assert rows[1]["server_generation"]["worker_decode_tokens_per_s"] == rows[1]["worker_decode_tokens_per_s"]
    assert doc["target_mode"] == "server_generation" and isinstance(doc["stepwise_meets_target"], bool)
    assert "saturation_sessions" in doc and doc["label"] == "local-real"
    assert "stepwise ratio" in wb.summary(doc)


def test_paired_ratio_pairs_each_repeat_with_its_own_reference():
    # the worker's best (110) and the reference's best (120) come from different minutes
    assert wb.paired_ratio([100.0, 110.0, 90.0], [105.0, 120.0, 95.0]) == pytest.approx(
        sorted([100 / 105, 110 / 120, 90 / 95])[1])
    assert wb.paired_ratio([1.0], [0.0]) is None
    row = wb.level_row(2, {"stepwise": _measured(80.0, 2.0), "server_generation": _measured(110.0, 2.0)}, 120.0,
                       {"stepwise": [80.0, 70.0, 75.0], "server_generation": [100.0, 110.0, 90.0]},
                       [105.0, 120.0, 95.0])
    assert row["ratio"] == pytest.approx(110 / 120)
    assert row["paired_ratio"] == pytest.approx(sorted([100 / 105, 110 / 120, 90 / 95])[1])
    assert row["stepwise"]["paired_ratio"] == pytest.approx(sorted([80 / 105, 70 / 120, 75 / 95])[1])
    # the target is judged on the best-of ratio; the paired one is reported next to it
    assert wb.meets([row]) == (row["ratio"] >= wb.TARGET_RATIO)


def test_bench_worker_measures_the_worker_every_command_runs(tmp_path: Path, monkeypatch):
    """$DGR_WORKER_BIN picks the worker for `dgr bench worker` too (the one locator), so a paired
    run of two builds measures the two binaries it names; the JSON records which one it was."""
    from typer.testing import CliRunner

    from dgr.main import app

    other = tmp_path / "dgr-worker-other"
    other.write_bytes(b"#!/bin/sh\n")
    other.chmod(0o755)
    seen = {}

    def fake_run(model, cfg, *, worker_bin, batched_bench):
        seen["worker_bin"] = worker_bin
        return {"levels": [], "saturation_sessions": None}

    monkeypatch.setenv("DGR_WORKER_BIN", str(other))
    monkeypatch.setattr(wb, "run_worker_bench", fake_run)
    monkeypatch.setattr(wb, "summary", lambda doc: "ok")
    out = tmp_path / "w.json"
    r = CliRunner().invoke(app, ["bench", "worker", "--sessions", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert seen["worker_bin"] == other
