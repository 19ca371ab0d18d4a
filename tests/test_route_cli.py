"""`dgr route run|generate` end to end on fake-model workers (seconds)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dgr.route.local import parse_split
from dgr.errors import DgrError
from dgr.route.supervisor import WorkerProcess

pytestmark = pytest.mark.native


def _dgr(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgr.main", *args], capture_output=True, text=True, timeout=timeout)


def test_parse_split():
    assert parse_split("0:15,15:30") == [(0, 15), (15, 30)]
    with pytest.raises(DgrError, match="not contiguous"):
        parse_split("0:10,12:30")
    with pytest.raises(DgrError, match="bad split"):
        parse_split("0-15")


def test_route_run_json_with_parity(native_bin):
    p = _dgr("route", "run", "--fake", "--split", "0:3,3:5,5:8", "--sessions", "4", "--max-tokens", "12",
             "--parity", "--json", "--raw", "--prompt", "hello")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["parity"]["ok"] and doc["parity"]["sessions"] == 4
    assert doc["route"]["ok"] and len(doc["route"]["sessions"]) == 4
    assert all(len(s["tokens"]) == 12 for s in doc["route"]["sessions"])
    assert len(doc["route"]["workers"]) == 3
    assert all(w["sessions_left"] == 0 for w in doc["route"]["workers"])
    assert 0 < doc["route"]["seam_bytes_per_decode_token"] <= 2 * 8 * 4 + 256


def test_route_run_prints_table(native_bin, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\n")
    p = _dgr("route", "run", "--fake", "--split", "0:4,4:8", "--prompts", str(prompts), "--max-tokens", "8")
    assert p.returncode == 0, p.stderr
    assert "route  aggregate" in p.stdout and "seam bytes per decode token" in p.stdout


def test_route_generate_against_running_workers(native_bin):
    ws = [WorkerProcess.start(["--fake-model", "--layers", r], binary=native_bin / "dgr-worker") for r in ("0:4", "4:8")]
    try:
        p = _dgr("route", "generate", *[a for w in ws for a in ("--shard", w.target)], "--prompt", "hi",
                 "--sessions", "2", "--max-tokens", "6", "--json", "--raw")
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert [len(s["tokens"]) for s in doc["sessions"]] == [6, 6]
        assert doc["sessions"][0]["tokens"] == doc["sessions"][1]["tokens"]
        bad = _dgr("route", "generate", "--shard", ws[1].target, "--prompt", "hi")
        assert bad.returncode == 1 and "dgr: error:" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        for w in ws:
            w.kill()
