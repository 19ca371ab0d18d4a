"""A bare `dgr-worker serve --model FILE` (no --fingerprint/--artifact-id, which `dgr worker
serve` computes in Python and passes) computes the real identity itself
(worker/src/common/identity.cpp): the artifact id of dgr.gguf.identity.identify and the fingerprint
of dgr.gguf.recipe.recipe_for, for whole artifacts (tied/untied, f32/q8_0) and slices (which serve
their source's identity). A truncated or unsupported file makes it refuse to start."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from dgr.gguf import identity
from dgr.gguf.slice import LayerRange, slice_gguf
from dgr.gguf.synth import SynthSpec, synthesize
from dgr.gguf.recipe import recipe_for
from dgr.route.supervisor import WorkerProcess

pytestmark = pytest.mark.native


def served_identity(native_bin: Path, model: Path, *extra: str):
    with WorkerProcess.start(["--model", str(model), "--max-sessions", "2", "--ctx-per-session", "256", *extra],
                             binary=native_bin / "dgr-worker") as w:
        c = w.client()
        try:
            cap = c.capability()
        finally:
            c.close()
        return cap.identity, list(w.stderr_lines)


def check(native_bin: Path, model: Path, *extra: str, source: Path | None = None) -> None:
    ident, stderr = served_identity(native_bin, model, *extra)
    recipe = recipe_for(model, backend="cpu", progress=False)
    want_id = identity.identify(source or model, progress=False, use_cache=False).artifact_id
    assert recipe.artifact_id == want_id
    assert ident.artifact_id == want_id, stderr
    assert ident.compatibility_fingerprint == recipe.fingerprint(), stderr
    j = json.loads(ident.recipe_json)
    assert j["fingerprint"] == recipe.fingerprint() and j["backend"] == "cpu"
    want = recipe.to_json()
    for k in recipe.fingerprint_fields():
        assert str(j[k]) == str(want[k]), k
    assert j["weight_types_digest"] == recipe.weight_types_digest
    if source is None:
        assert any("computing the artifact identity of" in line for line in stderr), stderr


@pytest.mark.parametrize("tied,dtype", [(False, "f32"), (True, "f32"), (False, "q8_0"), (True, "q8_0")])
def test_bare_worker_serves_real_identity(native_bin: Path, tmp_path: Path, tied: bool, dtype: str) -> None:
    m = synthesize(SynthSpec(n_layer=4, tied=tied, dtype=dtype, seed=5), tmp_path / "m.gguf")
    check(native_bin, m)
    check(native_bin, m, "--layers", "1:3")  # a range of a whole file: the same identity


@pytest.mark.parametrize("tied,rng", [(False, (0, 2)), (True, (2, 4)), (False, (1, 3))])
def test_bare_worker_slice_serves_source_identity(native_bin: Path, tmp_path: Path, tied: bool,
                                                  rng: tuple[int, int]) -> None:
    src = synthesize(SynthSpec(n_layer=4, tied=tied, dtype="q8_0", seed=7), tmp_path / "src.gguf")
    sl = tmp_path / "slice.gguf"
    slice_gguf(src, LayerRange(*rng), sl, progress=False)
    check(native_bin, sl, "--layers", f"{rng[0]}:{rng[1]}", source=src)
    assert recipe_for(sl, progress=False).fingerprint() == recipe_for(src, progress=False).fingerprint()


def test_given_identity_is_not_recomputed(native_bin: Path, tmp_path: Path) -> None:
    m = synthesize(SynthSpec(n_layer=2, seed=9), tmp_path / "m.gguf")
    fp, aid = "1" * 64, "2" * 64
    ident, stderr = served_identity(native_bin, m, "--fingerprint", fp, "--artifact-id", aid)
    assert (ident.compatibility_fingerprint, ident.artifact_id) == (fp, aid)
    assert not any("computing the artifact identity" in line for line in stderr)


def run_bare(native_bin: Path, model: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(native_bin / "dgr-worker"), "serve", "--listen", "127.0.0.1:0", "--model", str(model)],
                          capture_output=True, text=True, timeout=60)


def test_truncated_gguf_refused(native_bin: Path, tmp_path: Path) -> None:
    m = synthesize(SynthSpec(n_layer=2, seed=1), tmp_path / "m.gguf")
    data = m.read_bytes()
    for n, what in ((len(data) - 100, "ends past the end of the file"), (2000, "truncated or corrupt"),
                    (3, "truncated or corrupt")):
        bad = tmp_path / f"trunc{n}.gguf"
        bad.write_bytes(data[:n])
        r = run_bare(native_bin, bad)
        assert r.returncode == 2, (n, r.stderr)
        errs = [line for line in r.stderr.splitlines() if "error" in line]
        assert len(errs) == 1 and "cannot compute the artifact identity" in errs[0] and what in errs[0], r.stderr
        assert "dgr-worker: serving" not in r.stdout


def test_missing_file_and_bad_magic_refused(native_bin: Path, tmp_path: Path) -> None:
    r = run_bare(native_bin, tmp_path / "nope.gguf")
    assert r.returncode == 2 and "cannot read" in r.stderr, r.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + bytes(100))
    r = run_bare(native_bin, bad)
    assert r.returncode == 2 and "GGUF magic missing" in r.stderr, r.stderr


def test_architecture_without_adapter_refused(native_bin: Path, tmp_path: Path) -> None:
    m = synthesize(SynthSpec(arch="qwen2", n_layer=2, seed=1), tmp_path / "q.gguf")
    r = run_bare(native_bin, m)
    assert r.returncode == 2 and "has no dgr adapter" in r.stderr, r.stderr


@pytest.mark.real
def test_smollm2_bare_worker_identity(native_bin: Path, smollm2_path: Path, tmp_path: Path) -> None:
    local = tmp_path / "smollm2.gguf"  # own copy: path-independent, and no cache entry to hit
    shutil.copyfile(smollm2_path, local)
    t0 = time.monotonic()
    ident, stderr = served_identity(native_bin, local, "--layers", "0:15")
    startup = time.monotonic() - t0
    recipe = recipe_for(smollm2_path, backend="cpu", progress=False)
    assert ident.artifact_id == identity.identify(smollm2_path, progress=False, use_cache=False).artifact_id
    assert ident.artifact_id == recipe.artifact_id
    assert ident.compatibility_fingerprint == recipe.fingerprint()
    hashed = [line for line in stderr if line.startswith("dgr-worker: artifact id")]
    print(f"SmolLM2 bare startup {startup:.2f} s; {hashed}")
