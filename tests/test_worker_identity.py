"""`dgr-worker serve --model FILE` proves its identity from the file (worker/src/common/identity.cpp,
slice_verify.cpp, worker/identity_check.cpp): the artifact id of dgr.gguf.identity.identify and the
fingerprint of dgr.gguf.recipe.recipe_for, for whole artifacts (tied/untied, f32/q8_0) and slices
(which serve their source's identity once every tensor verifies against the manifest they carry).
--fingerprint/--artifact-id/--recipe-json may only name that identity: a flag that disagrees with
the file refuses startup, printing both values; so does a slice with one altered tensor byte, and
a truncated or unsupported file."""

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
from gguf_corrupt import flip_tensor_byte

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


def _refused(native_bin: Path, model: Path, *extra: str) -> str:
    r = subprocess.run([str(native_bin / "dgr-worker"), "serve", "--listen", "127.0.0.1:0", "--model", str(model),
                        *extra], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "dgr-worker: serving" not in r.stdout
    errs = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errs) == 1 and "refusing to serve" in errs[0], r.stderr
    return errs[0]


def _cli_slice(src: Path, rng: str, out: Path) -> Path:
    from typer.testing import CliRunner

    from dgr.main import app

    r = CliRunner().invoke(app, ["gguf", "slice", str(src), "--layers", rng, "-o", str(out)])
    assert r.exit_code == 0, r.output
    return out


@pytest.mark.parametrize("rng", ["2:4", "1:3"])  # a tail slice and a middle slice
def test_slice_without_layers_serves_its_own_range(native_bin: Path, tmp_path: Path, rng: str) -> None:
    """A slice serves as it is: without --layers it plans, loads and serves the range it carries
    (dgr.slice.layer_start/layer_end) under its source's identity; --layers that name another
    range refuse startup with both ranges."""
    from dgr.route.memory_plan import plan_memory

    start, end = (int(x) for x in rng.split(":"))
    src = synthesize(SynthSpec(n_layer=4, dtype="q8_0", seed=7), tmp_path / "src.gguf")
    sl = _cli_slice(src, rng, tmp_path / "slice.gguf")
    ident, stderr = served_identity(native_bin, sl)
    assert (ident.range.start, ident.range.end, ident.n_layer) == (start, end, 4), stderr
    assert (ident.head, ident.tail) == (start == 0, end == 4)
    check(native_bin, sl, source=src)
    same, _ = served_identity(native_bin, sl, "--layers", rng)
    assert (same.range.start, same.range.end, same.compatibility_fingerprint) == \
        (start, end, ident.compatibility_fingerprint)
    err = _refused(native_bin, sl, "--layers", "0:2")
    assert f"is a slice of layers {rng}" in err and "--layers 0:2 names another range" in err, err
    plan = plan_memory(sl, None, max_sessions=2, ctx_per_session=256, binary=native_bin / "dgr-worker")
    assert (plan.layer_start, plan.layer_end) == (start, end)


def test_identity_flags_that_disagree_with_the_file_refuse_startup(native_bin: Path, tmp_path: Path) -> None:
    m = synthesize(SynthSpec(n_layer=2, seed=9), tmp_path / "m.gguf")
    other = synthesize(SynthSpec(n_layer=2, seed=10), tmp_path / "other.gguf")
    mine, theirs = recipe_for(m, backend="cpu", progress=False), recipe_for(other, backend="cpu", progress=False)
    # another model's identity (a route of two different models must not form)
    err = _refused(native_bin, m, "--fingerprint", theirs.fingerprint(), "--artifact-id", theirs.artifact_id)
    assert theirs.artifact_id in err and mine.artifact_id in err and "--artifact-id" in err
    err = _refused(native_bin, m, "--fingerprint", "1" * 64)
    assert "1" * 64 in err and mine.fingerprint() in err and "--fingerprint" in err
    # a recipe that names another tokenizer / another artifact
    bad = mine.to_json() | {"tokenizer_digest": "3" * 64}
    err = _refused(native_bin, m, "--recipe-json", json.dumps(bad))
    assert "tokenizer_digest" in err and "3" * 64 in err and mine.tokenizer_digest in err
    err = _refused(native_bin, m, "--recipe-json", json.dumps(theirs.to_json()))
    assert "artifact_id" in err and theirs.artifact_id in err
    # a plan without this build's backend; a recipe whose fingerprint is not its own fields'
    err = _refused(native_bin, m, "--recipe-json", json.dumps(mine.to_json() | {"backends": "vulkan"}))
    assert "backends" in err and "'vulkan'" in err
    err = _refused(native_bin, m, "--recipe-json", json.dumps(mine.to_json() | {"fingerprint": "4" * 64}))
    assert "4" * 64 in err and mine.fingerprint() in err
    _refused(native_bin, m, "--recipe-json", "{not json")


def test_identity_flags_that_name_the_file_are_served(native_bin: Path, tmp_path: Path) -> None:
    m = synthesize(SynthSpec(n_layer=2, seed=9), tmp_path / "m.gguf")
    r = recipe_for(m, backend="cpu", progress=False)
    ident, _ = served_identity(native_bin, m, "--fingerprint", r.fingerprint(), "--artifact-id", r.artifact_id)
    assert (ident.compatibility_fingerprint, ident.artifact_id) == (r.fingerprint(), r.artifact_id)
    # the file cannot say the route's backend plan: a recipe may choose one that holds this backend
    mixed = recipe_for(m, backend="cpu", backends="cpu+vulkan", progress=False)
    assert mixed.fingerprint() != r.fingerprint()
    ident, _ = served_identity(native_bin, m, "--fingerprint", mixed.fingerprint(), "--artifact-id", r.artifact_id,
                               "--recipe-json", json.dumps(mixed.to_json()))
    assert ident.compatibility_fingerprint == mixed.fingerprint()
    # without the recipe, that fingerprint is not what the file and this build give
    _refused(native_bin, m, "--fingerprint", mixed.fingerprint())


def test_slice_with_one_altered_tensor_byte_is_refused(native_bin: Path, tmp_path: Path) -> None:
    src = synthesize(SynthSpec(n_layer=4, dtype="q8_0", seed=7), tmp_path / "src.gguf")
    sl = tmp_path / "slice.gguf"
    slice_gguf(src, LayerRange(1, 3), sl, progress=False)
    flip_tensor_byte(sl, "blk.2.ffn_down.weight")
    err = _refused(native_bin, sl, "--layers", "1:3")
    assert "tensor blk.2.ffn_down.weight" in err and "the manifest says" in err, err
    # a changed metadata pair is refused too (the tokenizer is part of the identity)
    sl2 = tmp_path / "slice2.gguf"
    slice_gguf(src, LayerRange(0, 2), sl2, progress=False)
    data = sl2.read_bytes()
    i = data.index(b"<0x41>")
    sl2.write_bytes(data[:i] + b"<0x42>" + data[i + 6:])
    err = _refused(native_bin, sl2, "--layers", "0:2")
    assert "tokenizer" in err or "metadata" in err, err


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
        assert len(errs) == 1 and "refusing to serve" in errs[0] and what in errs[0], r.stderr
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
    hashed = [line for line in stderr if "MiB hashed in" in line]
    print(f"SmolLM2 bare startup {startup:.2f} s; {hashed}")
