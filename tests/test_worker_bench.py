"""dgr bench worker: saturation logic (unit) and a short real-lane run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dgr import worker_bench as wb


def test_saturation_is_the_last_level_that_still_grew():
    rows = [{"sessions": 1, "worker_decode_tokens_per_s": 100.0},
            {"sessions": 2, "worker_decode_tokens_per_s": 150.0},
            {"sessions": 4, "worker_decode_tokens_per_s": 152.0},
            {"sessions": 8, "worker_decode_tokens_per_s": 120.0}]
    assert wb.saturation(rows) == 2
    assert wb.saturation(rows[:2]) is None


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
    assert rows[4]["dgr_batch_occupancy_avg"] > 1.5  # batching in use
    assert "saturation_sessions" in doc and doc["label"] == "local-real"
