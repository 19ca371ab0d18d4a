"""Artifact identity: canonical manifest, artifact id, cache, and strict GGUF reading."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dgr.gguf import identity
from dgr.errors import DgrError
from dgr.gguf.inspect import GgufError, open_gguf
from dgr.gguf.synth import SynthSpec, synthesize
from dgr.gguf.identity import Manifest, ManifestError, TensorEntry


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DGR_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize(SynthSpec(n_layer=3, dtype="q8_0", seed=11), tmp_path_factory.mktemp("m") / "m.gguf")


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # never rely on clock granularity


def _tensor_offset(path: Path, name: str) -> int:
    with open_gguf(path) as gf:
        return gf.tensor(name).offset


def _kv_value_offset(path: Path, key: str) -> int:
    with open_gguf(path) as gf:
        return gf.kv_value_offset(key)


def test_artifact_id_is_stable_and_cached(model: Path) -> None:
    a = identity.identify(model, progress=False, use_cache=False)
    b = identity.identify(model, progress=False, use_cache=False)
    assert a.artifact_id == b.artifact_id and len(a.artifact_id) == 64
    c = identity.identify(model, progress=False)            # computes and stores
    d = identity.identify(model, progress=False)            # cache hit
    assert c.artifact_id == d.artifact_id == a.artifact_id
    assert len(list((Path(os.environ["DGR_CACHE_DIR"]) / "identity").glob("*.json"))) == 1


def test_cache_hit_does_not_rehash(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = identity.identify(model, progress=False)

    def boom(*a, **k):
        raise AssertionError("hashed again despite an unchanged (path, size, mtime_ns)")

    monkeypatch.setattr(identity, "manifest_of", boom)
    assert identity.identify(model, progress=False).artifact_id == first.artifact_id


def test_artifact_id_is_the_sha256_of_the_canonical_manifest(model: Path) -> None:
    import hashlib

    ident = identity.identify(model, progress=False)
    text = ident.manifest.text()
    assert hashlib.sha256(text.encode()).hexdigest() == ident.artifact_id
    lines = text.splitlines()
    assert lines[0] == "dgr-artifact-manifest/v1"
    assert lines[1] == f"metadata {ident.metadata_digest}"
    assert lines[2] == f"tensors {len(ident.manifest.tensors)}"
    assert [ln.split()[1] for ln in lines[3:]] == sorted(ln.split()[1] for ln in lines[3:])
    assert Manifest.parse(text) == ident.manifest


def test_tensor_byte_change_changes_id(model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(model, copy)
    before = identity.identify(copy, progress=False)
    _flip(copy, _tensor_offset(copy, "blk.1.ffn_down.weight") + 5)
    after = identity.identify(copy, progress=False)
    assert after.artifact_id != before.artifact_id
    assert after.metadata_digest == before.metadata_digest
    changed = [t.name for t, u in zip(before.manifest.tensors, after.manifest.tensors) if t != u]
    assert changed == ["blk.1.ffn_down.weight"]


def test_metadata_change_changes_id(model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(model, copy)
    before = identity.identify(copy, progress=False)
    # general.name is a string: type u32, length u64, then the bytes; flip its first byte.
    _flip(copy, _kv_value_offset(copy, "general.name") + 4 + 8)
    after = identity.identify(copy, progress=False)
    assert after.metadata_digest != before.metadata_digest
    assert after.artifact_id != before.artifact_id
    assert after.tokenizer_digest == before.tokenizer_digest


def test_tokenizer_change_changes_tokenizer_digest(model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(model, copy)
    before = identity.identify(copy, progress=False)
    _flip(copy, _kv_value_offset(copy, "tokenizer.ggml.bos_token_id") + 4)
    after = identity.identify(copy, progress=False)
    assert after.tokenizer_digest != before.tokenizer_digest
    assert after.artifact_id != before.artifact_id


def test_manifest_rejects_non_canonical_text() -> None:
    e = TensorEntry("blk.0.x", 0, (4, 2), 32, "a" * 64)
    m = Manifest.build("b" * 64, [e, TensorEntry("a b%", 1, (8,), 16, "c" * 64)])
    assert Manifest.parse(m.text()) == m
    assert "tensor a%20b%25 1 8 16" in m.text()
    with pytest.raises(ManifestError):
        Manifest.parse(m.text().replace("tensors 2", "tensors 3"))
    with pytest.raises(ManifestError):
        Manifest.parse(m.text().replace("a" * 64, "A" * 64))
    lines = m.text().splitlines()
    with pytest.raises(ManifestError):
        Manifest.parse("\n".join(lines[:3] + [lines[4], lines[3]]) + "\n")  # wrong order


@pytest.mark.parametrize("cut", [0, 10, 23, 200, 2000, -100, -1])
def test_truncated_file_is_a_clear_error(model: Path, tmp_path: Path, cut: int) -> None:
    data = model.read_bytes()
    with open_gguf(model) as gf:
        data_end = max(t.offset + t.n_bytes for t in gf.tensors)  # the file may end in padding
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:cut] if cut >= 0 else data[:data_end + cut])
    with pytest.raises(GgufError, match="truncated or corrupt|not a readable GGUF"):
        identity.identify(bad, progress=False)


def test_corrupt_headers_are_clear_errors(model: Path, tmp_path: Path) -> None:
    data = bytearray(model.read_bytes())
    bad = tmp_path / "bad.gguf"
    for mutate in (lambda d: d.__setitem__(slice(0, 4), b"GGUX"),        # magic
                   lambda d: d.__setitem__(slice(4, 8), (7).to_bytes(4, "little")),   # version
                   lambda d: d.__setitem__(slice(16, 24), (2**40).to_bytes(8, "little")),  # kv count
                   lambda d: d.__setitem__(slice(24, 32), (2**50).to_bytes(8, "little"))):  # first key length
        d = bytearray(data)
        mutate(d)
        bad.write_bytes(bytes(d))
        with pytest.raises(GgufError):
            open_gguf(bad)


def test_cli_fingerprint_json(model: Path) -> None:
    from dgr.main import app

    r = CliRunner().invoke(app, ["gguf", "fingerprint", str(model), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    ident = identity.identify(model, progress=False)
    assert out["artifact_id"] == ident.artifact_id
    assert len(out["tensors"]) == len(ident.manifest.tensors)
    assert out["tensors"][0] == ident.manifest.tensors[0].to_json()


def test_cli_inspect(model: Path) -> None:
    from dgr.main import app

    r = CliRunner().invoke(app, ["gguf", "inspect", str(model)])
    assert r.exit_code == 0, r.output
    assert "architecture:  llama" in r.stdout and "blk.0..2" in r.stdout and "tokenizer:     llama" in r.stdout


def test_missing_file_is_a_dgr_error(tmp_path: Path) -> None:
    with pytest.raises(DgrError, match="not found"):
        identity.identify(tmp_path / "nope.gguf")


# ---- real lane ----

@pytest.mark.real
def test_smollm2_artifact_id_stable_and_sensitive(smollm2_path: Path, tmp_path: Path) -> None:
    a = identity.identify(smollm2_path, progress=False)
    identity.clear_cache()
    b = identity.identify(smollm2_path, progress=False)
    assert a.artifact_id == b.artifact_id
    assert a.architecture == "llama" and len(a.manifest.tensors) == 272
    copy = tmp_path / "smol.gguf"
    shutil.copyfile(smollm2_path, copy)
    assert identity.identify(copy, progress=False).artifact_id == a.artifact_id  # path-independent
    _flip(copy, _tensor_offset(copy, "blk.29.ffn_down.weight") + 1234)
    t = identity.identify(copy, progress=False)
    assert t.artifact_id != a.artifact_id and t.metadata_digest == a.metadata_digest
    shutil.copyfile(smollm2_path, copy)
    _flip(copy, _kv_value_offset(copy, "llama.attention.layer_norm_rms_epsilon") + 4)
    m = identity.identify(copy, progress=False)
    assert m.artifact_id != a.artifact_id and m.metadata_digest != a.metadata_digest
