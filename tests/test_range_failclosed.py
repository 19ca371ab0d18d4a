"""Loading by layer range fails closed: any architecture without a range-aware loader and graph
(range-aware: llama, gemma3, qwen3, qwen3moe; tests/test_archs.py), a bad range, or
a slice file asked for layers it does not hold gives a clear error and no model (never a silent
whole-model fallback)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from test_parity import parity_bin  # noqa: F401  (fixture)

pytestmark = pytest.mark.native


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DGR_CACHE_DIR", str(tmp_path / "cache"))


def _load(exe: Path, model: Path, rng: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(exe), "--model", str(model), "--memory", "--range", rng, "--n-ctx", "256"],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("arch", ["qwen2"])
def test_other_architecture_with_a_range_fails_closed(parity_bin: Path, tmp_path: Path, arch: str) -> None:  # noqa: F811
    from dgr.gguf.synth import SynthSpec, synthesize

    model = synthesize(SynthSpec(arch=arch, n_layer=4, tied=True, seed=1), tmp_path / f"{arch}.gguf")
    for rng in ("0:2", "2:4", "1:3"):
        proc = _load(parity_bin, model, rng)
        assert proc.returncode == 2, proc.stdout
        assert proc.stdout.strip() == ""  # no report: nothing was loaded
        assert f"partial loading is not supported for architecture '{arch}'" in proc.stderr
        assert "only architectures whose loader and graph are range-aware" in proc.stderr
    # the whole model is not a partial load and still loads
    whole = _load(parity_bin, model, "0:4")
    assert whole.returncode == 0, whole.stderr[-800:]


def test_bad_range_is_refused(parity_bin: Path, tmp_path: Path) -> None:  # noqa: F811
    from dgr.gguf.synth import SynthSpec, synthesize

    model = synthesize(SynthSpec(arch="llama", n_layer=4, seed=2), tmp_path / "llama.gguf")
    for rng in ("0:5", "3:3", "3:2"):
        proc = _load(parity_bin, model, rng)
        assert proc.returncode == 2
        assert "invalid layer range" in proc.stderr


def test_slice_cannot_claim_layers_it_does_not_hold(parity_bin: Path, tmp_path: Path) -> None:  # noqa: F811
    from dgr.gguf.slice import LayerRange, slice_gguf
    from dgr.gguf.synth import SynthSpec, synthesize

    model = synthesize(SynthSpec(arch="llama", n_layer=4, seed=3), tmp_path / "llama.gguf")
    tail = slice_gguf(model, LayerRange(2, 4), tmp_path / "tail.gguf", progress=False).path
    ok = _load(parity_bin, tail, "2:4")
    assert ok.returncode == 0, ok.stderr[-800:]
    for rng in ("0:4", "0:2", "1:4"):
        proc = _load(parity_bin, tail, rng)
        assert proc.returncode == 2, rng
        assert re.search(r"tensor '[^']+' not found|missing tensor", proc.stderr), proc.stderr[-500:]
