"""Realistic synthetic presets (dgr gguf synth --preset): shapes read back from the file, the
Q4_K_M type layout, the directly written K-quant blocks, and (real lane) numerics in llama.cpp."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dgr.errors import DgrError
from dgr.gguf.inspect import open_gguf
from dgr.gguf.presets import PRESETS, llama3_rope_factors, q4_k_m_type, use_more_bits
from dgr.gguf.synth import padded_vocab, spec_from_preset, synthesize, tensor_plan


def test_presets_copy_the_published_shapes() -> None:
    p = PRESETS
    assert (p["llama-3.1-8b"].n_layer, p["llama-3.1-8b"].n_embd, p["llama-3.1-8b"].n_ff) == (32, 4096, 14336)
    assert (p["llama-3.2-1b"].n_head, p["llama-3.2-1b"].n_head_kv, p["llama-3.2-1b"].head_dim) == (32, 8, 64)
    assert (p["llama-3.2-3b"].n_head, p["llama-3.2-3b"].head_dim, p["llama-3.2-3b"].n_layer) == (24, 128, 28)
    assert p["qwen3-8b"].n_vocab == 151936 and p["qwen3-8b"].n_layer == 36 and p["qwen3-8b"].n_ff == 12288
    moe = p["qwen3-30b-a3b"]
    assert (moe.n_expert, moe.n_expert_used, moe.n_ff_exp, moe.real_layers) == (128, 8, 768, 48)
    assert moe.n_head * moe.head_dim == 4096 != moe.n_embd   # Q wider than the residual stream
    assert moe.note  # fewer layers than the family, said so
    for pr in p.values():
        assert pr.n_ctx >= 8192 and pr.n_vocab >= 32000 and pr.n_head % pr.n_head_kv == 0


def test_q4_k_m_layout_follows_llama_quantize() -> None:
    # use_more_bits for 32 layers: the first and last 4, and every third layer between
    more = [i for i in range(32) if use_more_bits(i, 32)]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert q4_k_m_type("output.weight", 32, False) == "Q6_K"
    assert q4_k_m_type("token_embd.weight", 32, False) == "Q4_K"
    assert q4_k_m_type("token_embd.weight", 16, True) == "Q6_K"    # tied: the embedding is the output
    assert q4_k_m_type("blk.6.attn_v.weight", 32, False) == "Q6_K"
    assert q4_k_m_type("blk.7.attn_v.weight", 32, False) == "Q4_K"
    assert q4_k_m_type("blk.7.ffn_down.weight", 32, False) == "Q4_K"
    assert q4_k_m_type("blk.0.ffn_gate.weight", 32, False) == "Q4_K"


def test_llama3_rope_factors() -> None:
    f = llama3_rope_factors(128, 500000.0, (8.0, 1.0, 4.0, 8192))
    assert f.shape == (64,) and f[0] == 1.0 and f[-1] == 8.0
    assert np.all(np.diff(f) >= 0) and np.all((f >= 1.0) & (f <= 8.0))


def test_1b_preset_read_back_from_the_file(tmp_path: Path) -> None:
    """The real per-layer shapes and vocabulary (one layer, to keep the test small)."""
    spec = spec_from_preset("llama-3.2-1b", n_layer=2)
    path = synthesize(spec, tmp_path / "l1b.gguf")
    with open_gguf(path) as gf:
        assert gf.architecture == "llama" and gf.n_layer == 2
        assert gf.hparam("embedding_length") == 2048 and gf.hparam("feed_forward_length") == 8192
        assert gf.hparam("attention.head_count") == 32 and gf.hparam("attention.head_count_kv") == 8
        assert gf.hparam("rope.dimension_count") == 64 and gf.hparam("context_length") == 131072
        assert gf.hparam("rope.freq_base") == 500000.0
        assert "synthetic" in gf.get("general.name") and "synthetic" in gf.get("general.description")
        assert gf.get("general.file_type") == 15   # LLAMA_FTYPE_MOSTLY_Q4_K_M
        assert "<|start_header_id|>" in gf.get("tokenizer.chat_template")   # llama.cpp's llama3 format
        assert len(gf.get("tokenizer.ggml.tokens")) == 128256
        emb = gf.tensor("token_embd.weight")
        assert emb.shape == (2048, 128256) and emb.type_name == "Q6_K"   # tied
        assert not gf.has_tensor("output.weight")
        assert gf.tensor("blk.0.attn_k.weight").shape == (2048, 512)
        assert gf.tensor("blk.1.ffn_down.weight").shape == (8192, 2048)
        assert gf.tensor("blk.0.attn_q.weight").type_name == "Q4_K"
        assert gf.tensor("rope_freqs.weight").shape == (32,)
        names = [t.name for t in gf.tensors]
        assert names == [n for n, _, _ in tensor_plan(spec)]
        # the directly written blocks dequantize to finite, zero-mean values of the planned std
        import gguf

        for name, std in (("blk.0.attn_q.weight", 1 / math.sqrt(2048)),
                          ("token_embd.weight", 0.25 / math.sqrt(2048)),
                          ("blk.0.ffn_down.weight", 1 / math.sqrt(2 * 2) / math.sqrt(8192))):
            t = gf.tensor(name)
            raw = np.asarray(gf.tensor_bytes(name))[: 64 * (144 if t.type_name == "Q4_K" else 210) * 8]
            x = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[t.type_name])
            assert np.all(np.isfinite(x))
            assert abs(float(x.std()) / std - 1) < 0.05 and abs(float(x.mean())) < 0.05 * std


def test_qwen3_preset_head_size_and_vocabulary() -> None:
    spec = spec_from_preset("qwen3-30b-a3b", n_layer=1)
    plan = {n: s for n, s, _ in tensor_plan(spec)}
    assert plan["blk.0.attn_q.weight"] == (4096, 2048) and plan["blk.0.attn_output.weight"] == (2048, 4096)
    assert plan["blk.0.attn_k.weight"] == (512, 2048)
    assert plan["blk.0.ffn_gate_exps.weight"] == (128, 768, 2048)
    assert plan["output.weight"] == (151936, 2048)
    assert len(padded_vocab(151936).tokens) == 151936 == len(set(padded_vocab(151936).tokens))


def test_bad_preset_requests_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(DgrError, match="unknown preset"):
        spec_from_preset("llama-9b")
    with pytest.raises(DgrError, match="f16, q8_0, q4_k_m"):
        spec_from_preset("llama-3.2-1b", dtype="f32")
    from dgr.gguf.synth import SynthSpec

    with pytest.raises(DgrError, match="multiple of 256"):
        synthesize(SynthSpec(dtype="q4_k_m"), tmp_path / "x.gguf")
    r = subprocess.run([sys.executable, "-m", "dgr.main", "gguf", "synth", "--preset", "nope", "-o", str(tmp_path / "y.gguf")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "unknown preset" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.real
@pytest.mark.native
def test_presets_are_numerically_sane_in_llama_cpp(tmp_path: Path, native_bin: Path) -> None:
    """Whole-model llama.cpp scores 512 random tokens with finite log-likelihood at every position
    (2 layers of each dense family; `dgr bench numerics --model synthetic:PRESET` runs the full
    depth over 2,048 tokens)."""
    from dgr.bench.numerics import check_numerics

    for name in ("llama-3.2-1b", "qwen3-8b"):
        path = synthesize(spec_from_preset(name, n_layer=2), tmp_path / f"{name}.gguf")
        r = check_numerics(path, n_tokens=512, work=tmp_path)
        assert r.finite and r.n_scored == 511, r
        path.unlink()


@pytest.mark.real
@pytest.mark.native
def test_bench_numerics_writes_json_for_each_model(tmp_path: Path, native_bin: Path) -> None:
    """`dgr bench numerics` scores each --model and writes one JSON row per model, labelled
    synthetic from the file's own metadata; a model it cannot read is a one-line error."""
    import json

    path = synthesize(spec_from_preset("llama-3.2-1b", n_layer=1), tmp_path / "one.gguf")
    out = tmp_path / "n.json"
    r = subprocess.run([sys.executable, "-m", "dgr.main", "bench", "numerics", "--model", str(path), "--tokens", "96",
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    (row,) = doc["results"]
    assert doc["all_finite"] and row["finite"] and row["n_scored"] == 95 and row["synthetic"], doc
    assert "finite, 95 positions scored" in r.stdout
    r = subprocess.run([sys.executable, "-m", "dgr.main", "bench", "numerics", "--model", str(tmp_path / "none.gguf"),
                        "--out", str(tmp_path / "m.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "none.gguf" in r.stderr
