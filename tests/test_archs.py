"""Architectures beyond dense llama: Gemma 3 (certified on the real 270M model), Qwen3 and
Qwen3-MoE (synthetic only, dark recipes).

Default lane: the synthetic writers (Q/K norms, router, stacked experts), the adapters' explicit
per-layer ownership (router and experts stay with their layer, unknown per-layer tensors fail
closed) and the bytes each range owns by role.
Native lane: whole model vs 2- and 3-shard splits through dgr-parity, exact (max |diff| = 0) for
synthetic gemma3 (interleaved sliding-window / global layers), qwen3 and qwen3moe; each shard's
KV holds only its layers (both iSWA caches together); the weight buffer of a MoE shard is exactly
the bytes of the tensors it owns, experts included.
Real lane: Gemma 3 270M Q4_K_M (the gemma3 extra), 2- and 3-shard splits, >= 64-token prompt +
32 greedy tokens, exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dgr.errors import DgrError
from dgr.gguf.inspect import open_gguf
from dgr.gguf.slice import ADAPTERS, LayerRange, SliceError, range_bytes_by_role, slice_gguf
from dgr.gguf.synth import SynthSpec, synthesize
from test_parity import parity_bin  # noqa: F401  (fixture)

N_LAYER = 6
SPLITS = ["3", "2,5", "1"]  # 2 shards, 3 shards, a 1-layer head


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DGR_CACHE_DIR", str(tmp_path / "cache"))


def _model(tmp: Path, arch: str, dtype: str = "f32", tied: bool = False, seed: int = 7) -> Path:
    return synthesize(SynthSpec(arch=arch, n_layer=N_LAYER, dtype=dtype, tied=tied or arch == "gemma3", seed=seed),
                      tmp / f"{arch}-{dtype}.gguf")


# ---- synthetic writers and adapters (default lane) ----------------------------------------

def test_qwen3_synth_has_qk_norms(tmp_path: Path) -> None:
    p = _model(tmp_path, "qwen3")
    with open_gguf(p) as gf:
        names = {t.name for t in gf.tensors}
        assert gf.architecture == "qwen3" and gf.n_layer == N_LAYER
        assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight", "output.weight"} <= names
        assert not any("bias" in n or "exps" in n for n in names)
        assert gf.tensor("blk.0.attn_q_norm.weight").shape == (16,)  # head dim 64 / 4 heads


def test_qwen3moe_synth_has_router_and_experts(tmp_path: Path) -> None:
    spec = SynthSpec(arch="qwen3moe", n_layer=2, n_expert=4, n_expert_used=2, n_ff_exp=32, seed=1)
    p = synthesize(spec, tmp_path / "moe.gguf")
    with open_gguf(p) as gf:
        assert (gf.hparam("expert_count"), gf.hparam("expert_used_count"),
                gf.hparam("expert_feed_forward_length")) == (4, 2, 32)
        # GGUF dims (ne0 first): router {n_embd, n_expert}, experts {in, out, n_expert}
        assert gf.tensor("blk.1.ffn_gate_inp.weight").shape == (64, 4)
        assert gf.tensor("blk.1.ffn_gate_exps.weight").shape == (64, 32, 4)
        assert gf.tensor("blk.1.ffn_up_exps.weight").shape == (64, 32, 4)
        assert gf.tensor("blk.1.ffn_down_exps.weight").shape == (32, 64, 4)
        names = {t.name for t in gf.tensors}
        assert "blk.0.ffn_gate.weight" not in names and not any("shexp" in n for n in names)
    # same seed, same bytes; another seed, other weights
    again = synthesize(spec, tmp_path / "moe2.gguf")
    assert again.read_bytes() == p.read_bytes()
    assert synthesize(SynthSpec(arch="qwen3moe", n_layer=2, n_expert=4, n_ff_exp=32, seed=2),
                      tmp_path / "moe3.gguf").read_bytes() != p.read_bytes()


def test_qwen3moe_bad_spec_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DgrError, match="experts used"):
        synthesize(SynthSpec(arch="qwen3moe", n_expert=2, n_expert_used=3), tmp_path / "x.gguf")
    with pytest.raises(DgrError, match="multiples of 32"):
        synthesize(SynthSpec(arch="qwen3moe", dtype="q8_0", n_ff_exp=48), tmp_path / "x.gguf")


def test_cli_synth_qwen3moe(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from dgr.main import app

    out = tmp_path / "m.gguf"
    r = CliRunner().invoke(app, ["gguf", "synth", "--arch", "qwen3moe", "--layers", "3", "--experts", "4",
                                 "--experts-used", "2", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "qwen3moe, 3 layers" in r.stdout and "4 experts (top-2)" in r.stdout
    r = CliRunner().invoke(app, ["gguf", "synth", "--arch", "qwen3moe", "--experts", "1", "--experts-used", "2",
                                 "-o", str(out)])
    assert r.exit_code != 0 and isinstance(r.exception, DgrError) and "experts used" in str(r.exception)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3", "qwen3moe"])
def test_adapter_knows_every_tensor_of_its_architecture(tmp_path: Path, arch: str) -> None:
    p = _model(tmp_path, arch)
    adapter = ADAPTERS[arch]
    with open_gguf(p) as gf:
        names = [t.name for t in gf.tensors]
    for n in names:
        adapter.owner(n, N_LAYER)  # raises for a tensor it does not know
    # the ranges of a split own every tensor exactly once (tied: token_embd twice, head + tail)
    owned = [n for a, b in [(0, 2), (2, 5), (5, 6)] for n in adapter.owned(names, LayerRange(a, b), N_LAYER)]
    dup = [n for n in set(owned) if owned.count(n) > 1]
    assert sorted(set(owned)) == sorted(names)
    assert dup == (["token_embd.weight"] if arch == "gemma3" else [])


@pytest.mark.parametrize("arch,name", [("qwen3", "blk.0.ffn_gate_inp.weight"),
                                       ("qwen3moe", "blk.0.ffn_gate_inp_shexp.weight"),
                                       ("qwen3moe", "blk.0.ffn_up_shexp.weight"),
                                       ("gemma3", "blk.0.attn_q.bias"),
                                       ("qwen3", "rope_freqs.weight")])
def test_unknown_tensor_fails_closed(arch: str, name: str) -> None:
    with pytest.raises(SliceError, match="unknown to the"):
        ADAPTERS[arch].owner(name, N_LAYER)


def test_router_and_experts_stay_with_their_layer(tmp_path: Path) -> None:
    p = _model(tmp_path, "qwen3moe")
    per_layer = range_bytes_by_role(p, LayerRange(1, 2))
    assert per_layer["experts"] == 3 * 8 * 64 * 64 * 4 and per_layer["router"] == 8 * 64 * 4
    parts = [range_bytes_by_role(p, LayerRange(a, b)) for a, b in [(0, 2), (2, 5), (5, 6)]]
    assert [x["experts"] for x in parts] == [2 * per_layer["experts"], 3 * per_layer["experts"], per_layer["experts"]]
    assert "head" in parts[0] and "tail" in parts[2] and "head" not in parts[1] and "tail" not in parts[1]
    with open_gguf(p) as gf:
        total = sum(t.n_bytes for t in gf.tensors)
    assert sum(sum(x.values()) for x in parts) == total
    # a slice of a range holds exactly those bytes
    s = slice_gguf(p, LayerRange(2, 5), tmp_path / "s.gguf", progress=False).path
    with open_gguf(s) as gf:
        assert sum(t.n_bytes for t in gf.tensors) == sum(parts[1].values())


# ---- native: dgr-parity ----------------------------------------------------------------------

def _assert_exact(report: dict, n_splits: int, n_predict: int = 32) -> None:
    assert report["ok"] is True
    assert len(report["splits"]) == n_splits
    for s in report["splits"]:
        label = s["ranges"]
        assert s["prefill_top1_agree"] == s["prefill_positions"] == report["n_prompt"], label
        assert s["prefill_max_abs_diff"] == 0.0 and s["prefill_bit_identical"] is True, label
        assert s["decode_max_abs_diff"] == 0.0, label
        assert s["tokens_identical"] is True and s["tokens"] == report["whole"]["tokens"], label
        assert len(s["tokens"]) == report["n_predict"] == n_predict
        for sh, (a, b) in zip(s["shards"], s["ranges"]):
            assert (sh["start"], sh["end"]) == (a, b)
            assert sh["head"] == (a == 0) and sh["tail"] == (b == report["n_layer"])
            assert sh["kv"]["kv_layers"] == b - a  # summed over both caches for iSWA models


@pytest.mark.native
@pytest.mark.parametrize("arch,dtype", [("gemma3", "f32"), ("gemma3", "q8_0"), ("qwen3", "f32"),
                                        ("qwen3", "q8_0"), ("qwen3moe", "f32"), ("qwen3moe", "q8_0")])
def test_synthetic_splits_match_whole_model(parity_bin: Path, tmp_path: Path, arch: str, dtype: str) -> None:  # noqa: F811
    from dgr.bench.memory_probe import parity

    model = _model(tmp_path, arch, dtype)
    report = parity(parity_bin, model, SPLITS, n_random=24, n_predict=32)
    assert report["n_layer"] == N_LAYER and report["n_prompt"] == 24
    _assert_exact(report, len(SPLITS))
    assert len(set(report["whole"]["tokens"])) >= 2  # not a degenerate repetition


@pytest.mark.native
def test_qwen3moe_slices_match_whole_model(parity_bin: Path, tmp_path: Path) -> None:  # noqa: F811
    from dgr.bench.memory_probe import parity

    model = _model(tmp_path, "qwen3moe", "q8_0")
    slices = [slice_gguf(model, LayerRange(a, b), tmp_path / f"s{a}_{b}.gguf", progress=False).path
              for a, b in [(0, 2), (2, 5), (5, 6)]]
    report = parity(parity_bin, model, ["2,5"], slices=slices, n_random=20, n_predict=32)
    _assert_exact(report, 1)


@pytest.mark.native
@pytest.mark.parametrize("arch", ["qwen3moe", "gemma3"])
def test_shard_allocates_exactly_its_tensors_experts_included(parity_bin: Path, tmp_path: Path, arch: str) -> None:  # noqa: F811
    """Without mmap the weight buffer is the sum of the created tensors: it must equal the bytes
    the adapter says the range owns (experts and router included); KV holds only owned layers."""
    from dgr.bench.memory_probe import ShardSpec, probe

    model = _model(tmp_path, arch)
    for a, b in [(0, N_LAYER), (0, 3), (3, 6), (2, 5)]:
        rep = probe(parity_bin, ShardSpec(a, b, model), n_ctx=256, mmap=False)
        owned = sum(range_bytes_by_role(model, LayerRange(a, b)).values())
        assert (rep["range"], rep["head"], rep["tail"]) == ([a, b], a == 0, b == N_LAYER)
        assert abs(rep["model_buffer_mib_logged"] - owned / 2**20) <= 0.01, (a, b)
        assert rep["kv"]["kv_layers"] == b - a, (a, b)
        assert rep["token_input"] == ("accepted" if a == 0 else "INVALID_ARGUMENT")


@pytest.mark.native
def test_architecture_without_adapter_still_fails_closed(parity_bin: Path, tmp_path: Path) -> None:  # noqa: F811
    import subprocess

    model = synthesize(SynthSpec(arch="qwen2", n_layer=4, tied=True, seed=1), tmp_path / "q.gguf")
    proc = subprocess.run([str(parity_bin), "--model", str(model), "--memory", "--range", "0:2", "--n-ctx", "256"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout.strip() == ""
    assert "partial loading is not supported for architecture 'qwen2'" in proc.stderr


# ---- real lane: Gemma 3 270M ------------------------------------------------------------------

GEMMA3_PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
                 "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
                 "produce books far faster than any scribe. Within a few decades printing shops had spread to "
                 "most of the major cities of Europe, and the cost of books fell sharply. Historians still argue "
                 "about the consequences, but most agree that")
GEMMA3_SPLITS = ["9,18", "6,12,18", "4,10,18"]  # 2 shards; 3 shards; a head without a global layer


@pytest.mark.real
@pytest.mark.native
def test_gemma3_270m_splits_match_whole_model(parity_bin: Path, gemma3_path: Path) -> None:  # noqa: F811
    from dgr.bench.memory_probe import parity

    report = parity(parity_bin, gemma3_path, GEMMA3_SPLITS, prompt=GEMMA3_PROMPT, n_predict=32)
    assert report["n_layer"] == 18 and report["n_prompt"] >= 64
    _assert_exact(report, len(GEMMA3_SPLITS))
