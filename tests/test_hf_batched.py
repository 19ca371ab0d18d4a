"""The batched Transformers lanes of the release gate (dgr.bench.hf_batched): a left-padded static
batch gives every session the greedy tokens it gets alone; continuous batching reports itself as
measured or says why not; and the gate's comparison against them (pure)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROMPTS = [[1, 5, 9, 13], [1, 40, 41, 42, 43, 44, 45], [3, 7]]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny-llama-batched")
    LlamaForCausalLM(cfg).save_pretrained(str(d), safe_serialization=True)
    return d


@pytest.mark.baseline
def test_static_batch_pads_without_changing_any_sessions_tokens(tiny_ckpt):
    from dgr.bench import hf_batched

    torch, model = hf_batched._setup({"hf_dir": str(tiny_ckpt), "threads": 1})
    together = hf_batched.static_batch(torch, model, PROMPTS, 10)
    alone = [hf_batched.static_batch(torch, model, [p], 10)["tokens"][0] for p in PROMPTS]
    assert together["tokens"] == alone and together["padded_to"] == 7
    assert together["decode_tok_s"] > 0 and together["end_to_end_tok_s"] > 0


@pytest.mark.baseline
def test_the_lane_runs_as_its_own_process(tiny_ckpt, tmp_path):
    conf = tmp_path / "c.json"
    conf.write_text(json.dumps({"hf_dir": str(tiny_ckpt), "threads": 1, "prompts": PROMPTS, "n_gen": 6,
                                "modes": ["static", "continuous"]}))
    p = subprocess.run([sys.executable, "-m", "dgr.bench.hf_batched", str(conf), str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["static"]["sessions"] == 3 and len(r["static"]["tokens"][0]) == 6
    cb = r["continuous"]
    # measured (every request made its tokens), or not available with the reason
    assert (cb["available"] and cb["generated_tokens"] == [6, 6, 6]) or (not cb["available"] and cb["reason"])


def test_the_gate_compares_the_route_with_both_batched_lanes():
    from dgr.bench.gate_judge import vs_batched

    doc = {"routes": {"gguf-f32": {"timing": {"1": {"decode_tok_s": 30.0, "end_to_end_tok_s": 20.0},
                                              "4": {"decode_tok_s": 80.0, "end_to_end_tok_s": 60.0}}}},
           "transformers_batched": {
               "4": {"static": {"decode_tok_s": 40.0, "end_to_end_tok_s": 30.0},
                     "continuous": {"available": True, "end_to_end_tok_s": 50.0}},
               "1": {"static": {"decode_tok_s": 15.0, "end_to_end_tok_s": 10.0},
                     "continuous": {"available": False, "reason": "no generate_batch"}}}}
    v = vs_batched(doc, "gguf-f32")["by_sessions"]
    assert list(v) == ["1", "4"]
    assert v["4"]["decode_vs_static"] == 2.0 and v["4"]["end_to_end_vs_static"] == 2.0
    assert v["4"]["end_to_end_vs_continuous"] == 1.2 and v["4"]["continuous"] == "measured"
    assert v["1"]["end_to_end_vs_continuous"] is None and v["1"]["continuous"] == "no generate_batch"
