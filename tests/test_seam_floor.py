"""dgr-seam-floor: the whole model, head+tail in one process and head and tail in two processes
over a socketpair decode the same greedy ids (synthetic llama model; the real lane adds SmolLM2)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from built import built

pytestmark = pytest.mark.native


@pytest.fixture(scope="module")
def floor_bin(native_bin: Path) -> Path:
    return built("dgr-seam-floor", "dgr build --tests", native_bin)


def _run(exe: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300)


def _synth(tmp: Path) -> Path:
    from dgr.gguf.synth import SynthSpec, synthesize

    return synthesize(SynthSpec(arch="llama", n_layer=6, tied=True, dtype="f32", seed=5), tmp / "llama.gguf")


@pytest.mark.parametrize("sessions", [1, 3])
def test_three_ways_give_the_same_ids(floor_bin: Path, tmp_path: Path, sessions: int) -> None:
    model = _synth(tmp_path)
    p = _run(floor_bin, "--model", str(model), "--split", "2", "--threads", "2", "--sessions", str(sessions),
             "--prompt-tokens", "8", "--gen-tokens", "6", "--rounds", "2", "--max-sessions", "4")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["kind"] == "dgr.seam_floor/v1" and doc["n_layer"] == 6 and doc["split"] == 2
    assert doc["sessions"] == sessions and doc["max_sessions"] == 4 and doc["ctx_per_session"] == 8 + 6 + 16
    assert doc["same_tokens"] is True
    assert len(doc["rounds"]) == 2
    for r in doc["rounds"]:
        assert all(r[k] > 0 for k in ("whole_ms_per_step", "in_process_ms_per_step", "two_process_ms_per_step",
                                      "in_process_head_ms", "in_process_tail_ms", "two_process_head_ms"))
    assert doc["median"]["two_process_vs_whole"] > 0


def test_bad_input_exits_2_with_the_reason(floor_bin: Path, tmp_path: Path) -> None:
    model = _synth(tmp_path)
    p = _run(floor_bin, "--model", str(model), "--split", "6")
    assert p.returncode == 2 and "below the layer count 6" in p.stderr
    p = _run(floor_bin, "--model", str(tmp_path / "missing.gguf"), "--split", "2")
    assert p.returncode == 2 and "error" in p.stderr
    p = _run(floor_bin, "--model", str(model))
    assert p.returncode == 2 and "--split is required" in p.stderr
    p = _run(floor_bin, "--model", str(model), "--split", "2", "--sessions", "0")
    assert p.returncode == 2 and "--sessions: expected an integer >= 1" in p.stderr


def test_smollm2_two_processes_match(floor_bin: Path, smollm2_path: Path) -> None:
    p = _run(floor_bin, "--model", str(smollm2_path), "--split", "15", "--threads", "2", "--sessions", "2",
             "--prompt-tokens", "16", "--gen-tokens", "8", "--rounds", "1", "--max-sessions", "4")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["n_layer"] == 30 and doc["same_tokens"] is True
