"""Split GGUF sets (llama.cpp's gguf-split format) are one artifact everywhere a single file works
(docs/identity.md "Split GGUF sets")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dgr.errors import DgrError
from dgr.gguf import identity
from dgr.gguf.gguf_set import GgufSet, SplitSetError, inspect_model, model_stem, open_model, part_paths
from dgr.gguf.inspect import open_gguf
from dgr.gguf.models import resolve_model
from dgr.gguf.recipe import recipe_for
from dgr.gguf.slice import LayerRange, SliceError, slice_gguf, verify_slice
from dgr.gguf.synth import SynthSpec, synthesize
from dgr.main import app

from splitset import gguf_split_tool, run_gguf_split, split_like_gguf_split

N_LAYER = 6
PER_PART = 19   # 57 tensors: part 1 = token_embd + blk.0-1, part 2 = blk.2-3 + blk.4.attn_norm, part 3 = the rest


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DGR_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic (random-weight) model as one file."""
    return synthesize(SynthSpec(n_layer=N_LAYER, dtype="q8_0", seed=29), tmp_path_factory.mktemp("one") / "m.gguf")


@pytest.fixture()
def parts(single: Path, tmp_path: Path) -> list[Path]:
    """The same model as a 3-part set in its own folder (a fresh copy per test: tests break it)."""
    d = tmp_path / "set"
    d.mkdir()
    return split_like_gguf_split(single, d / "m", PER_PART)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # never rely on clock granularity


def _tensor_names(path: Path) -> list[str]:
    with open_gguf(path) as gf:
        return [t.name for t in gf.tensors]


# ---- the format as written ----

def test_the_helper_writes_the_gguf_split_layout(parts: list[Path]) -> None:
    assert [p.name for p in parts] == ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]
    for i, p in enumerate(parts):
        with open_gguf(p) as gf:
            assert (gf.get("split.no"), gf.get("split.count"), gf.get("split.tensors.count")) == (i, 3, 57)
            if i:
                assert sorted(gf.keys) == ["split.count", "split.no", "split.tensors.count"]
    with open_model(parts[1]) as m:
        assert isinstance(m, GgufSet) and m.path == parts[0] and m.n_parts == 3 and len(m.tensors) == 57


# ---- identity ----

def test_set_id_equals_single_file_id_from_any_part(single: Path, parts: list[Path]) -> None:
    one = identity.identify(single, progress=False)
    for p in parts:
        ident = identity.identify(p, progress=False)
        assert ident.artifact_id == one.artifact_id
        assert ident.metadata_digest == one.metadata_digest and ident.tokenizer_digest == one.tokenizer_digest
        assert ident.manifest.text() == one.manifest.text()
        assert ident.path == str(parts[0].resolve())
        assert ident.parts == tuple(str(q.resolve()) for q in parts)
        assert ident.size == sum(q.stat().st_size for q in parts)
    assert one.parts == ()


def test_split_pairs_are_outside_the_metadata_digest(single: Path) -> None:
    with open_gguf(single) as gf:
        assert not any(k.startswith("split.") for k in gf.keys)
    d = single.parent / "merged-like"
    d.mkdir(exist_ok=True)
    # a one-part set carries split.* pairs (like llama-gguf-split --merge output): same digest, same id
    [only] = split_like_gguf_split(single, d / "x", 1000)
    assert identity.identify(only, progress=False).artifact_id == identity.identify(single, progress=False).artifact_id


def test_flipped_byte_in_part_3_changes_the_id_through_the_cache(parts: list[Path]) -> None:
    before = identity.identify(parts[0], progress=False)
    assert identity.identify(parts[0], progress=False) == before   # cached now
    with open_gguf(parts[2]) as gf:
        t = gf.tensor("blk.5.ffn_down.weight")
        offset = t.offset + t.n_bytes // 2
    _flip(parts[2], offset)
    after = identity.identify(parts[0], progress=False)   # part 1 untouched: only part 3's key changed
    assert after.artifact_id != before.artifact_id
    changed = [a.name for a, b in zip(after.manifest.tensors, before.manifest.tensors) if a != b]
    assert changed == ["blk.5.ffn_down.weight"]
    r = CliRunner().invoke(app, ["gguf", "fingerprint", str(parts[1]), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["artifact_id"] == after.artifact_id


# ---- broken sets are refused, naming the part ----

def _refused(path: Path) -> str:
    with pytest.raises(DgrError) as e:
        identity.identify(path, progress=False)
    msg = str(e.value)
    assert "\n" not in msg
    with pytest.raises(DgrError) as e2:   # the same before any worker: the model argument itself
        resolve_model(path)
    assert str(e2.value) == msg
    return msg


def test_missing_part_is_refused(parts: list[Path]) -> None:
    parts[1].unlink()
    for p in (parts[0], parts[2]):
        msg = _refused(p)
        assert "m-00002-of-00003.gguf" in msg and "missing" in msg


def test_extra_part_is_refused(parts: list[Path]) -> None:
    shutil.copy(parts[2], parts[2].with_name("m-00004-of-00004.gguf"))
    msg = _refused(parts[0])
    assert "m-00004-of-00004.gguf" in msg and "extra part" in msg


def test_part_of_another_count_in_the_folder_is_an_extra_part(parts: list[Path]) -> None:
    shutil.copy(parts[0], parts[0].with_name("m-00001-of-00002.gguf"))
    msg = _refused(parts[2])
    assert "m-00001-of-00002.gguf" in msg and "extra part" in msg


def test_reordered_parts_are_refused(parts: list[Path]) -> None:
    tmp = parts[1].with_name("swap")
    parts[1].rename(tmp)
    parts[2].rename(parts[1])
    tmp.rename(parts[2])
    msg = _refused(parts[0])
    assert "m-00002-of-00003.gguf holds split.no 2" in msg and "reordered" in msg


def test_renamed_part_is_refused(parts: list[Path], tmp_path: Path) -> None:
    lone = tmp_path / "model.gguf"
    shutil.copy(parts[0], lone)
    msg = _refused(lone)
    assert "model.gguf is part 1 of a 3-part split set" in msg


def test_part_of_a_split_into_another_count_is_refused(single: Path, parts: list[Path], tmp_path: Path) -> None:
    other = split_like_gguf_split(single, tmp_path / "m", 15)      # 4 parts, in another folder
    shutil.copy(other[2], parts[2])                               # its part 3 renamed into our set
    msg = _refused(parts[0])
    assert "m-00003-of-00003.gguf has split.count 4, not 3" in msg and "mismatched" in msg


def test_part_from_another_model_is_refused(parts: list[Path], tmp_path: Path) -> None:
    deeper = synthesize(SynthSpec(n_layer=N_LAYER + 1, dtype="q8_0", seed=29), tmp_path / "deeper.gguf")
    other = split_like_gguf_split(deeper, tmp_path / "m", 22)      # 66 tensors, 3 parts
    shutil.copy(other[2], parts[2])
    msg = _refused(parts[0])
    assert "m-00003-of-00003.gguf has split.tensors.count 66, part 1 has 57" in msg and "mismatched" in msg


def test_non_first_part_with_model_metadata_is_refused(single: Path, tmp_path: Path) -> None:
    d = tmp_path / "meta"
    d.mkdir()
    bad = split_like_gguf_split(single, d / "m", PER_PART, part_extra_kv={1: {"general.name": "other"}})
    msg = _refused(bad[2])
    assert "m-00002-of-00003.gguf carries model metadata ('general.name')" in msg


def test_whole_model_renamed_into_a_set_is_refused(single: Path, parts: list[Path]) -> None:
    shutil.copy(single, parts[1])
    msg = _refused(parts[0])
    assert "m-00002-of-00003.gguf has no split.count pair" in msg


def test_part_name_without_split_pairs(single: Path, tmp_path: Path) -> None:
    p = tmp_path / "x-00002-of-00003.gguf"
    shutil.copy(single, p)
    assert "no split.count pair" in _refused(p)
    one = tmp_path / "y-00001-of-00001.gguf"   # a single file that happens to be named like a 1-part set
    shutil.copy(single, one)
    assert identity.identify(one, progress=False).artifact_id == identity.identify(single, progress=False).artifact_id


def _cli_error(cmd: list[str]) -> str:
    r = CliRunner().invoke(app, cmd)
    assert r.exit_code != 0 and isinstance(r.exception, DgrError), r.output
    return str(r.exception)


def test_cli_refusal_is_one_line_naming_the_part(parts: list[Path]) -> None:
    parts[2].unlink()
    for cmd in (["gguf", "fingerprint", str(parts[0])], ["gguf", "inspect", str(parts[0])],
                ["gguf", "recipe", str(parts[1])], ["gguf", "slice", str(parts[1]), "--layers", "0:1", "-o",
                                                    str(parts[0].with_name("s.gguf"))]):
        assert "m-00003-of-00003.gguf is missing" in _cli_error(cmd)
    r = subprocess.run([sys.executable, "-m", "dgr.main", "gguf", "fingerprint", str(parts[1])],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "dgr: error: split set m-00001-of-00003.gguf (3 parts): part m-00003-of-00003.gguf is missing "
        f"(all 3 parts must sit in {parts[0].parent})"]


@pytest.mark.parametrize("cmd", [
    ["route", "run", "--split", "0:3,3:6", "--prompt", "hi"],
    ["serve", "--split", "0:3,3:6"],
    ["demo"],
])
def test_routes_refuse_a_broken_set_before_any_worker(parts: list[Path], cmd: list[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from dgr.route import local

    def no_worker(*a: object, **k: object) -> None:
        raise AssertionError("a worker was about to start for a broken set")

    monkeypatch.setattr(local, "ensure_worker", no_worker)
    monkeypatch.setattr(local.LocalRoute, "start", no_worker)
    parts[1].unlink()
    assert "m-00002-of-00003.gguf is missing" in _cli_error([*cmd, "--model", str(parts[2])])


def test_model_argument_resolves_any_part_to_part_1(parts: list[Path]) -> None:
    assert resolve_model(parts[2]) == parts[0]
    assert part_paths(parts[1]) == parts
    assert model_stem(parts[2]) == "m" and model_stem(Path("x/model.gguf")) == "model"


def test_worker_gets_part_1_and_the_set_identity(single: Path, parts: list[Path]) -> None:
    r = CliRunner().invoke(app, ["worker", "serve", "--model", str(parts[2]), "--dry-run"])
    assert r.exit_code == 0, r.output
    argv = r.output.split()
    assert argv[argv.index("--model") + 1] == str(parts[0])
    assert argv[argv.index("--artifact-id") + 1] == identity.identify(single, progress=False).artifact_id


# ---- inspect, recipe ----

def test_inspect_lists_parts_and_their_layers(single: Path, parts: list[Path]) -> None:
    info = inspect_model(parts[1])
    one = inspect_model(single)
    assert info["n_tensors"] == one["n_tensors"] == 57 and info["tensor_bytes"] == one["tensor_bytes"]
    assert info["groups"] == one["groups"] and info["tokenizer"] == one["tokenizer"]
    assert info["path"] == str(parts[0]) and info["file_bytes"] == sum(p.stat().st_size for p in parts)
    assert one["parts"] is None
    got = [(Path(p["path"]).name, p["n_tensors"], p["layers"], p["globals"]) for p in info["parts"]]
    assert got == [("m-00001-of-00003.gguf", 19, "0..1", ["token_embd.weight"]),
                   ("m-00002-of-00003.gguf", 19, "2..4", []),
                   ("m-00003-of-00003.gguf", 19, "4..5", ["output_norm.weight", "output.weight"])]
    r = CliRunner().invoke(app, ["gguf", "inspect", str(parts[2])])
    assert r.exit_code == 0, r.output
    assert "split set:     3 parts" in r.output and "m-00003-of-00003.gguf" in r.output
    assert "layers 4..5 + output_norm.weight, output.weight" in r.output


def test_recipe_of_a_set_is_the_recipe_of_the_single_file(single: Path, parts: list[Path]) -> None:
    runtime = ("0", "c" * 40, "d" * 64)
    a = recipe_for(parts[2], runtime=runtime, progress=False)
    b = recipe_for(single, runtime=runtime, progress=False)
    assert a == b and a.fingerprint() == b.fingerprint()
    r = CliRunner().invoke(app, ["gguf", "recipe", str(parts[1]), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["artifact_id"] == b.artifact_id


# ---- slices ----

@pytest.mark.parametrize("rng,needed", [("0:1", [0]), ("2:4", [1]), ("4:6", [1, 2]), ("0:6", [0, 1, 2])])
def test_slice_of_a_set_equals_slice_of_the_file_and_reads_only_its_parts(
        single: Path, parts: list[Path], tmp_path: Path, rng: str, needed: list[int]) -> None:
    identity.identify(parts[0], progress=False)   # the source artifact id is cached, as on a coordinator
    from_set = slice_gguf(parts[1], LayerRange.parse(rng), tmp_path / "s.gguf", progress=False)
    from_one = slice_gguf(single, LayerRange.parse(rng), tmp_path / "o.gguf", progress=False)
    assert from_set.read_from == tuple(str(parts[i]) for i in needed)
    assert from_set.source_parts == 3 and from_one.source_parts == 1
    assert from_set.source_artifact_id == from_one.source_artifact_id
    # the same file: part 1's pairs minus split.*, the same tensors and bytes
    assert (tmp_path / "s.gguf").read_bytes() == (tmp_path / "o.gguf").read_bytes()
    with open_gguf(tmp_path / "s.gguf") as gf:
        assert not any(k.startswith("split.") for k in gf.keys)
    rep = verify_slice(tmp_path / "s.gguf", parts[2], expect_range=LayerRange.parse(rng), progress=False)
    assert "source artifact id matches the source file" in rep.checks


def test_cli_slice_and_verify_against_a_set(parts: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "tail.gguf"
    r = CliRunner().invoke(app, ["gguf", "slice", str(parts[0]), "--layers", "4:6", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "read from 2 of 3 parts: m-00002-of-00003.gguf, m-00003-of-00003.gguf" in r.output
    r = CliRunner().invoke(app, ["gguf", "verify-slice", str(out), "--source", str(parts[1]), "--layers", "4:6"])
    assert r.exit_code == 0, r.output
    _flip(parts[0], -1 + parts[0].stat().st_size)   # the last byte of part 1: a tensor byte
    r = CliRunner().invoke(app, ["gguf", "verify-slice", str(out), "--source", str(parts[1])])
    assert r.exit_code != 0 and "was cut from artifact" in str(r.exception)


def test_slice_carrying_split_pairs_is_refused(single: Path, tmp_path: Path) -> None:
    s = slice_gguf(single, LayerRange(0, 2), tmp_path / "s.gguf", progress=False).path
    # the slice rewritten as a one-part "set": same tensors and dgr.slice.* pairs, plus split.*
    [bad] = split_like_gguf_split(s, tmp_path / "bad", 1000)
    with pytest.raises(SliceError, match="split-set pair .split\\."):
        verify_slice(bad, progress=False)


def test_slice_output_over_a_part_is_refused(parts: list[Path]) -> None:
    with pytest.raises(SliceError, match="overwrite its source"):
        slice_gguf(parts[0], LayerRange(0, 1), parts[2], progress=False)


# ---- the pinned llama-gguf-split (native build; CI builds it with --tools) ----

@pytest.mark.native
def test_pinned_gguf_split_set_and_merge_have_the_single_file_id(single: Path, tmp_path: Path) -> None:
    exe = gguf_split_tool()
    run_gguf_split(exe, "--split", "--split-max-tensors", str(PER_PART), str(single), str(tmp_path / "m"))
    parts = part_paths(tmp_path / "m-00001-of-00003.gguf")
    assert all(p.is_file() for p in parts)
    for p in parts[1:]:   # the pinned tool writes model metadata into part 1 only
        with open_gguf(p) as gf:
            assert sorted(gf.keys) == ["split.count", "split.no", "split.tensors.count"]
    one = identity.identify(single, progress=False).artifact_id
    assert identity.identify(parts[2], progress=False).artifact_id == one
    (tmp_path / "py").mkdir()   # the test helper's layout is the pinned tool's
    assert [_tensor_names(p) for p in parts] == [_tensor_names(p) for p in
                                                split_like_gguf_split(single, tmp_path / "py" / "m", PER_PART)]
    merged = tmp_path / "merged.gguf"
    run_gguf_split(exe, "--merge", str(parts[0]), str(merged))
    with open_gguf(merged) as gf:
        assert gf.get("split.count") == 0   # the merge output keeps split.* pairs, outside the digest
    assert identity.identify(merged, progress=False).artifact_id == one
    # a set the pinned tool wrote, with one part missing, is refused naming it
    parts[1].unlink()
    with pytest.raises(SplitSetError, match="m-00002-of-00003.gguf is missing"):
        identity.identify(parts[0], progress=False)


@pytest.mark.real
def test_smollm2_as_three_parts_has_the_single_file_id(smollm2_path: Path, tmp_path: Path) -> None:
    exe = gguf_split_tool()
    with open_gguf(smollm2_path) as gf:
        per_part = -(-len(gf.tensors) // 3)
    run_gguf_split(exe, "--split", "--split-max-tensors", str(per_part), str(smollm2_path), str(tmp_path / "smol"))
    parts = part_paths(tmp_path / "smol-00001-of-00003.gguf")
    ident = identity.identify(parts[1], progress=False)
    assert ident.parts == tuple(str(p.resolve()) for p in parts)
    assert ident.artifact_id == identity.identify(smollm2_path, progress=False).artifact_id \
        == "a3e57daae193ff32f1ffed53f899498f7bb1f4fb2986d4f4731e7c0263e8b857"
    _flip(parts[2], parts[2].stat().st_size - 7)   # a byte of part 3's last tensor
    assert identity.identify(parts[0], progress=False).artifact_id != ident.artifact_id


# ---- corrupt parts: always a DgrError or a valid result ----

def test_corrupt_parts_end_in_dgr_errors(single: Path, tmp_path: Path) -> None:
    """Seeded corruptions (tests/gguf_corrupt.py) of one part at a time, read by every set-aware
    reader: each ends in a DgrError or a valid result, never another exception; a corruption
    that the strict reader must refuse is refused for the set too."""
    import random

    import gguf_corrupt

    d = tmp_path / "fuzz"
    d.mkdir()
    good = [p.read_bytes() for p in split_like_gguf_split(single, d / "m", PER_PART)]
    paths = part_paths(d / "m-00001-of-00003.gguf")
    rng = random.Random(20261205)
    outcomes: dict[str, int] = {}
    for c in gguf_corrupt.corpus(good[0], 20261205, 60):
        # part 1 (every metadata pair): the corpus; parts 2-3 (split.* only): a header byte or a cut
        victim = rng.randrange(3)
        if victim == 0:
            data = c.data
        else:
            buf = bytearray(good[victim])
            if rng.random() < 0.7:
                buf[rng.randrange(min(len(buf), 400))] ^= 1 << rng.randrange(8)
            else:
                del buf[rng.randrange(len(buf)):]
            data = bytes(buf)
        for i, p in enumerate(paths):
            p.write_bytes(data if i == victim else good[i])
        try:
            identity.identify(paths[2], progress=False, use_cache=False)
            inspect_model(paths[0])
            recipe_for(paths[1], runtime=("0", "c" * 40, "d" * 64), progress=False)
            slice_gguf(paths[0], LayerRange(0, 1), tmp_path / "s.gguf", progress=False)
            outcome = "ok"
        except DgrError as exc:
            assert "\n" not in str(exc)
            outcome = type(exc).__name__
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if victim == 0 and c.must_refuse:
            assert outcome != "ok", c.kind
    print("split-set corruptions:", outcomes)
    assert sum(outcomes.values()) == 60 and len(outcomes) > 1, outcomes
