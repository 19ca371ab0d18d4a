"""Slicing by layer range and verifying slices (dgr gguf slice / verify-slice)."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner
from built import built

from dgr.gguf import identity
from dgr.errors import DgrError
from dgr.gguf.inspect import GgufError, open_gguf
from dgr.gguf.slice import LayerRange, SliceError, slice_gguf, verify_slice
from dgr.gguf.synth import SynthSpec, synthesize

N = 4


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DGR_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize(SynthSpec(n_layer=N, dtype="q8_0", seed=5), tmp_path_factory.mktemp("u") / "untied.gguf")


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize(SynthSpec(n_layer=N, dtype="f16", tied=True, seed=6), tmp_path_factory.mktemp("t") / "tied.gguf")


def _names(path: Path) -> set[str]:
    with open_gguf(path) as gf:
        return {t.name for t in gf.tensors}


def _cut(src: Path, rng: str, out: Path) -> Path:
    return slice_gguf(src, LayerRange.parse(rng), out, progress=False).path


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_untied_head_middle_tail_own_the_right_tensors(untied: Path, tmp_path: Path) -> None:
    head = _names(_cut(untied, "0:1", tmp_path / "h.gguf"))
    mid = _names(_cut(untied, "1:3", tmp_path / "m.gguf"))
    tail = _names(_cut(untied, "3:4", tmp_path / "t.gguf"))
    assert "token_embd.weight" in head and "output.weight" not in head and "output_norm.weight" not in head
    assert not any(n.startswith(("token_embd", "output")) for n in mid)
    assert {"output.weight", "output_norm.weight"} <= tail and "token_embd.weight" not in tail
    assert {n.split(".")[1] for n in mid} == {"1", "2"}
    assert head | mid | tail == _names(untied)
    assert not (head & mid) and not (mid & tail) and not (head & tail)


def test_tied_tail_carries_the_token_embedding(tied: Path, tmp_path: Path) -> None:
    tail = _names(_cut(tied, "2:4", tmp_path / "t.gguf"))
    head = _names(_cut(tied, "0:2", tmp_path / "h.gguf"))
    assert {"token_embd.weight", "output_norm.weight"} <= tail and "output.weight" not in tail
    assert "token_embd.weight" in head and "output_norm.weight" not in head
    whole = _names(_cut(tied, "0:4", tmp_path / "w.gguf"))
    assert whole == _names(tied)


def test_slices_verify_and_keep_metadata(untied: Path, tmp_path: Path) -> None:
    ident = identity.identify(untied, progress=False)
    for rng in ("0:2", "2:4", "1:3"):
        out = _cut(untied, rng, tmp_path / f"s{rng[0]}.gguf")
        rep = verify_slice(out, untied, expect_range=LayerRange.parse(rng), progress=False)
        assert rep.source_artifact_id == ident.artifact_id and str(rep.range) == rng
        with open_gguf(untied) as src, open_gguf(out) as sl:
            for key in src.keys:
                assert sl.kv_value_bytes(key) == src.kv_value_bytes(key), key
            assert not any(k.startswith("split.") for k in sl.keys)
            assert sl.get("dgr.slice.source_artifact_id") == ident.artifact_id
            assert sl.get("dgr.slice.source_manifest") == ident.manifest.text()
            assert (sl.get("dgr.slice.layer_start"), sl.get("dgr.slice.layer_end")) == tuple(map(int, rng.split(":")))
            for t in sl.tensors:  # bytes copied exactly, quantized ones included
                assert bytes(sl.tensor_bytes(t.name)) == bytes(src.tensor_bytes(t.name))
                assert t.shape == src.tensor(t.name).shape and t.ggml_type == src.tensor(t.name).ggml_type


def test_slicing_is_deterministic(untied: Path, tmp_path: Path) -> None:
    a = _cut(untied, "1:3", tmp_path / "a.gguf")
    b = _cut(untied, "1:3", tmp_path / "b.gguf")
    assert a.read_bytes() == b.read_bytes()


def test_slice_sizes_add_up(tied: Path, tmp_path: Path) -> None:
    a = _cut(tied, "0:2", tmp_path / "a.gguf")
    b = _cut(tied, "2:4", tmp_path / "b.gguf")
    with open_gguf(tied) as gf:
        embd = gf.tensor("token_embd.weight").n_bytes
        tensors = sum(t.n_bytes for t in gf.tensors)
    with open_gguf(a) as ga, open_gguf(b) as gb:
        sliced = sum(t.n_bytes for t in ga.tensors) + sum(t.n_bytes for t in gb.tensors)
    assert sliced == tensors + embd  # tied: both endpoints own the token embedding


def test_slice_of_a_slice_is_refused(untied: Path, tmp_path: Path) -> None:
    s = _cut(untied, "0:2", tmp_path / "s.gguf")
    with pytest.raises(SliceError, match="already a slice"):
        _cut(s, "0:1", tmp_path / "ss.gguf")


def test_tampered_tensor_is_rejected(untied: Path, tmp_path: Path) -> None:
    s = _cut(untied, "1:3", tmp_path / "s.gguf")
    with open_gguf(s) as gf:
        off = gf.tensor("blk.2.attn_v.weight").offset + 17
    _flip(s, off)
    with pytest.raises(SliceError, match="tampered") as e:
        verify_slice(s, progress=False)
    assert "blk.2.attn_v.weight" in str(e.value)


def test_tampered_metadata_is_rejected(untied: Path, tmp_path: Path) -> None:
    s = _cut(untied, "0:2", tmp_path / "s.gguf")
    with open_gguf(s) as gf:
        off = gf.kv_value_offset("llama.rope.freq_base") + 4
    with open(s, "r+b") as f:
        f.seek(off)
        f.write(struct.pack("<f", 500000.0))
    with pytest.raises(SliceError, match="metadata"):
        verify_slice(s, progress=False)


@pytest.mark.parametrize("rng", ["0:5", "3:9", "2:2"])
def test_out_of_model_range_is_refused(untied: Path, tmp_path: Path, rng: str) -> None:
    with pytest.raises(DgrError, match="range"):
        _cut(untied, rng, tmp_path / "x.gguf")


@pytest.mark.parametrize("text", ["3", "a:b", "4:2", "-1:2", "1:2:3"])
def test_bad_range_text(text: str) -> None:
    with pytest.raises(DgrError, match="range"):
        LayerRange.parse(text)


def test_wrong_range_is_rejected(untied: Path, tmp_path: Path) -> None:
    s = _cut(untied, "2:4", tmp_path / "s.gguf")
    with pytest.raises(SliceError, match="expected 0:2"):
        verify_slice(s, expect_range=LayerRange(0, 2), progress=False)
    # Forge the range metadata: the slice now claims 1:4 but lacks blk.1.
    with open_gguf(s) as gf:
        off = gf.kv_value_offset("dgr.slice.layer_start") + 4
    with open(s, "r+b") as f:
        f.seek(off)
        f.write(struct.pack("<I", 1))
    with pytest.raises(SliceError, match="lacks"):
        verify_slice(s, progress=False)


def test_truncated_slice_is_rejected(untied: Path, tmp_path: Path) -> None:
    s = _cut(untied, "0:2", tmp_path / "s.gguf")
    data = s.read_bytes()
    for keep in (len(data) // 2, len(data) - 4096, 100):
        s.write_bytes(data[:keep])
        with pytest.raises(GgufError, match="truncated or corrupt"):
            verify_slice(s, progress=False)


def test_wrong_source_is_rejected(untied: Path, tied: Path, tmp_path: Path) -> None:
    s = _cut(untied, "0:2", tmp_path / "s.gguf")
    with pytest.raises(SliceError, match="cut from artifact"):
        verify_slice(s, tied, progress=False)


def test_whole_file_is_not_a_slice(untied: Path) -> None:
    with pytest.raises(SliceError, match="not a dgr slice"):
        verify_slice(untied, progress=False)


@pytest.mark.parametrize("arch", ["qwen2"])
def test_unknown_architecture_fails_closed(tmp_path: Path, arch: str) -> None:
    src = synthesize(SynthSpec(arch=arch, n_layer=2, tied=True), tmp_path / "m.gguf")
    with pytest.raises(DgrError, match="fail closed"):
        _cut(src, "0:1", tmp_path / "s.gguf")


def test_cli_slice_and_verify(untied: Path, tmp_path: Path) -> None:
    from dgr.main import app

    out = tmp_path / "cli.gguf"
    r = CliRunner().invoke(app, ["gguf", "slice", str(untied), "--layers", "0:2", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "layers 0:2 of 4 (head)" in r.stdout
    r = CliRunner().invoke(app, ["gguf", "verify-slice", str(out), "--source", str(untied), "--layers", "0:2"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("ok:")
    r = CliRunner().invoke(app, ["gguf", "verify-slice", str(out), "--layers", "2:4"])
    assert r.exit_code != 0 and isinstance(r.exception, SliceError)


# ---- real lane ----

@pytest.mark.real
def test_smollm2_halves_verify_and_sizes_add_up(smollm2_path: Path, tmp_path: Path) -> None:
    a = _cut(smollm2_path, "0:15", tmp_path / "a.gguf")
    b = _cut(smollm2_path, "15:30", tmp_path / "b.gguf")
    ra = verify_slice(a, smollm2_path, progress=False)
    rb = verify_slice(b, smollm2_path, progress=False)
    assert ra.source_artifact_id == rb.source_artifact_id == identity.identify(smollm2_path, progress=False).artifact_id
    with open_gguf(smollm2_path) as gf:
        embd = gf.tensor("token_embd.weight").n_bytes
        assert not gf.has_tensor("output.weight")  # tied: both halves own token_embd
        header = gf.data_offset
    src = smollm2_path.stat().st_size
    total = a.stat().st_size + b.stat().st_size
    # Each slice repeats the source metadata (header) and carries the manifest; the token
    # embedding is counted once per endpoint that owns it.
    expected = src + embd + header
    assert abs(total - expected) < 0.02 * src, (total, expected)
    assert "token_embd.weight" in _names(a) and "token_embd.weight" in _names(b)
    assert "output_norm.weight" in _names(b) and "output_norm.weight" not in _names(a)


@pytest.mark.native
def test_whole_range_slice_runs_like_its_source(untied: Path, tmp_path: Path) -> None:
    """A 0:n_layer slice is a complete model: stock llama.cpp loads it and greedy output is identical."""
    import subprocess

    exe = built("llama-simple", "dgr build --tools")
    whole = _cut(untied, f"0:{N}", tmp_path / "whole.gguf")
    outs = []
    for model in (untied, whole):
        r = subprocess.run([str(exe), "-m", str(model), "-n", "10", "hello world"], capture_output=True, timeout=120)
        assert r.returncode == 0, r.stderr.decode("utf-8", "replace")[-2000:]
        outs.append(r.stdout)
    assert outs[0] == outs[1]
