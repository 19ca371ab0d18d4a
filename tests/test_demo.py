"""`dgr demo` end to end on the embedded SmolLM2 (real lane)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.real, pytest.mark.native]


def test_demo_runs_to_completion_with_parity_and_table(smollm2_path, native_bin, tmp_path):
    out = tmp_path / "demo.json"
    p = subprocess.run([sys.executable, "-m", "dgr.main", "demo", "--max-tokens", "16", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "greedy parity vs whole model: OK" in p.stdout and "concurrent isolation: OK" in p.stdout
    for col in ("TTFT ms", "prefill tok/s", "decode tok/s", "route  aggregate", "whole  aggregate",
                "seam bytes per decode token", "KV peak"):
        assert col in p.stdout
    assert p.stdout.count("assistant:") == 4
    doc = json.loads(out.read_text())
    assert doc["parity"]["ok"] and len(doc["route"]["sessions"]) == 4
    assert [w["range"] for w in doc["route"]["workers"]] == ["0:15", "15:30"]
    assert all(w["rss_peak_bytes"] > 0 and w["kv_cells_peak"] > 0 for w in doc["route"]["workers"])
    assert 0 < doc["route"]["seam_bytes_per_decode_token"] <= 2 * 576 * 4 + 256
