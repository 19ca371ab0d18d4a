"""Whole model vs the same model as disjoint layer ranges (dgr-parity, the range patches).

Default lane: synthetic llama models (tied and untied, f32 and q8_0), whole vs 2-range and
3-range splits including uneven and 1-layer shards, from the full GGUF and from slice files.
The certified tolerance (docs/patches.md) is exact: with an f32 boundary on the same backend and
thread count, every prefill logit is bit-identical and the greedy tokens are the same.

Real lane: SmolLM2-135M, a >= 64-token prompt + 32 greedy tokens for splits 15:30, 7:23:30, 1:30.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dgr.bench.memory_probe import ShardSpec, owned_tensors, parity, probe

pytestmark = pytest.mark.native

N_LAYER = 6
SPLITS = ["3", "2,5", "1", "5"]  # [0,3)[3,6) · [0,2)[2,5)[5,6) · 1-layer head · 1-layer tail


@pytest.fixture(scope="session")
def parity_bin(request: pytest.FixtureRequest) -> Path:
    """dgr-parity of the native build (DGR_PARITY_BIN overrides, e.g. for a private build tree)."""
    override = os.environ.get("DGR_PARITY_BIN")
    if override:
        return Path(override)
    exe = request.getfixturevalue("native_bin") / "dgr-parity"
    if not exe.is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{exe} missing in CI: build the dgr-tools target first")
        pytest.skip("dgr-parity not built: run `dgr build --tests`")
    return exe


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DGR_CACHE_DIR", str(tmp_path / "cache"))


def _synth(tmp: Path, *, tied: bool, dtype: str, seed: int) -> Path:
    from dgr.gguf.synth import SynthSpec, synthesize

    return synthesize(SynthSpec(arch="llama", n_layer=N_LAYER, tied=tied, dtype=dtype, seed=seed),
                      tmp / f"llama-{'tied' if tied else 'untied'}-{dtype}.gguf")


def _assert_exact(report: dict, n_splits: int) -> None:
    assert report["ok"] is True
    assert len(report["splits"]) == n_splits
    for s in report["splits"]:
        label = s["ranges"]
        assert s["prefill_top1_agree"] == s["prefill_positions"] == report["n_prompt"], label
        assert s["prefill_max_abs_diff"] == 0.0, label
        assert s["prefill_bit_identical"] is True, label
        assert s["decode_max_abs_diff"] == 0.0, label
        assert s["tokens_identical"] is True and s["tokens"] == report["whole"]["tokens"], label
        assert len(s["tokens"]) == report["n_predict"] == 32
        # the model reports the range it loaded, and the roles follow from it
        for sh, (a, b) in zip(s["shards"], s["ranges"]):
            assert (sh["start"], sh["end"]) == (a, b)
            assert sh["head"] == (a == 0) and sh["tail"] == (b == report["n_layer"])
            assert sh["kv"]["kv_layers"] == b - a


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_synthetic_splits_match_whole_model(parity_bin: Path, tmp_path: Path, tied: bool, dtype: str) -> None:
    model = _synth(tmp_path, tied=tied, dtype=dtype, seed=11)
    report = parity(parity_bin, model, SPLITS, n_random=24, n_predict=32)
    assert report["n_layer"] == N_LAYER and report["n_prompt"] == 24
    _assert_exact(report, len(SPLITS))


def test_text_prompt_through_the_head_tokenizer(parity_bin: Path, tmp_path: Path) -> None:
    model = _synth(tmp_path, tied=True, dtype="f32", seed=3)
    report = parity(parity_bin, model, ["4"], prompt="hello world the model layer shard route seam cache",
                    n_predict=32)
    assert report["n_prompt"] > 8
    _assert_exact(report, 1)


@pytest.mark.parametrize("kv_per_seq", [False, True], ids=["unified-kv", "kv-per-seq"])
def test_several_sequences_per_batch_match_whole_model(parity_bin: Path, tmp_path: Path, kv_per_seq: bool) -> None:
    """Continuous batching: 4 sequences share every batch; boundary rows must stay in batch order."""
    model = _synth(tmp_path, tied=False, dtype="q8_0", seed=13)
    report = parity(parity_bin, model, ["3", "2,5"], n_random=16, n_predict=32, n_seq=4, kv_per_seq=kv_per_seq)
    assert report["n_seq"] == 4
    per_seq = report["whole"]["tokens_per_seq"]
    assert len(per_seq) == 4 and len({tuple(t) for t in per_seq}) > 1  # the sequences really differ
    for s in report["splits"]:
        assert s["prefill_positions"] == 4 * report["n_prompt"]
        assert s["prefill_bit_identical"] is True and s["decode_max_abs_diff"] == 0.0
        assert s["tokens_identical"] is True and s["tokens_per_seq"] == per_seq


def test_other_thread_count_on_the_shards_is_still_exact(parity_bin: Path, tmp_path: Path) -> None:
    model = _synth(tmp_path, tied=True, dtype="q8_0", seed=17)
    report = parity(parity_bin, model, ["3", "2,5"], n_random=40, n_predict=32, threads=2,
                    extra=("--shard-threads", "1"))
    _assert_exact(report, 2)


def test_the_harness_reports_a_real_difference(parity_bin: Path, tmp_path: Path) -> None:
    """A different n_ubatch changes llama.cpp's arithmetic even for the whole model: the harness
    must see it (so its 'bit-identical' verdicts mean something)."""
    model = _synth(tmp_path, tied=False, dtype="q8_0", seed=19)
    report = parity(parity_bin, model, ["6"], n_random=64, n_predict=4, extra=("--shard-ubatch", "16"))
    s = report["splits"][0]
    assert s["ranges"] == [[0, 6]]
    assert s["prefill_bit_identical"] is False and s["prefill_max_abs_diff"] > 0.0
    assert report["ok"] is False or s["prefill_max_abs_diff"] <= report["tolerance"]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_slice_files_match_whole_model(parity_bin: Path, tmp_path: Path, tied: bool) -> None:
    from dgr.gguf.slice import LayerRange, slice_gguf

    model = _synth(tmp_path, tied=tied, dtype="q8_0", seed=5)
    ranges = [(0, 2), (2, 5), (5, 6)]
    slices = [slice_gguf(model, LayerRange(a, b), tmp_path / f"s{a}_{b}.gguf", progress=False).path
              for a, b in ranges]
    report = parity(parity_bin, model, ["2,5"], slices=slices, n_random=20, n_predict=32)
    _assert_exact(report, 1)
    assert [sh["file"] for sh in report["splits"][0]["shards"]] == [str(p) for p in slices]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_shard_allocates_exactly_its_tensors_and_kv(parity_bin: Path, tmp_path: Path, tied: bool) -> None:
    """Without mmap the weight buffer is the sum of the created tensors: it must equal the bytes
    of the tensors the range owns (recomputed from the GGUF), and KV must hold only owned layers."""
    model = _synth(tmp_path, tied=tied, dtype="f32", seed=9)
    whole_kv = None
    for a, b in [(0, N_LAYER), (0, 2), (2, 5), (5, 6)]:
        rep = probe(parity_bin, ShardSpec(a, b, model), n_ctx=256, mmap=False)
        _, owned_bytes, n_layer = owned_tensors(model, a, b)
        assert (rep["range"], rep["head"], rep["tail"]) == ([a, b], a == 0, b == n_layer)
        assert abs(rep["model_buffer_mib_logged"] - owned_bytes / 2**20) <= 0.01, (a, b)
        assert rep["kv"]["kv_layers"] == b - a
        if (a, b) == (0, N_LAYER):
            whole_kv = rep["kv"]["kv_bytes"]
        else:
            assert rep["kv"]["kv_bytes"] * N_LAYER == whole_kv * (b - a)
        # a shard without the token embedding refuses token ids
        assert rep["token_input"] == ("accepted" if a == 0 else "INVALID_ARGUMENT")


@pytest.mark.real
def test_smollm2_splits_match_whole_model(parity_bin: Path, smollm2_path: Path) -> None:
    prompt = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
              "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
              "produce books far faster than any scribe. Within a few decades printing shops had spread to "
              "most of the major cities of Europe, and the cost of books fell sharply. Historians still argue "
              "about the consequences, but most agree that")
    report = parity(parity_bin, smollm2_path, ["15,30", "7,23,30", "1,30"], prompt=prompt, n_predict=32)
    assert report["n_layer"] == 30 and report["n_prompt"] >= 64
    _assert_exact(report, 3)


def test_range_parity_ctest(parity_bin: Path) -> None:
    """The self-contained C++ check (worker/tests/range_parity_test.cpp, also run by CTest)."""
    import subprocess

    exe = parity_bin.parent / "range_parity_test"
    if not exe.is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{exe} missing in CI: build the dgr-tests target first")
        pytest.skip("range_parity_test not built: run `dgr build --tests`")
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "range_parity_test: ok" in proc.stdout
