"""Synthetic models: tiny random-weight GGUFs (seeded, byte-identical per seed) for default tests.

`synthesize(SynthSpec(...), out)` writes a model that the pinned llama.cpp loads and runs, with a
small real SentencePiece-style ("llama") vocabulary: <unk>, <s>, </s>, the 256 byte-fallback
tokens <0x00>..<0xFF> and a few hundred word pieces, so tokenize/detokenize work and every token
id is valid. Each architecture is one entry in ``ARCHS`` (hyper-parameter keys + tensor list),
so adding one is a table entry, not a new writer.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import DgrError

DTYPES = ("f32", "f16", "q8_0", "q4_k_m")

# Word pieces after the byte tokens (SentencePiece marks a leading space with U+2581).
_SP = "\u2581"
_WORDS = ("the of and to in is it you that he was for on are with as his they be at one have this from"
          " or had by hot word but what some we can out other were all there when up use your how said"
          " an each she which do their time if will way about many then them write would like so these"
          " her long make thing see him two has look more day could go come did number sound no most"
          " people my over know water than call first who may down side been now find hello world model"
          " token layer shard route seam cache").split()
_BIGRAMS = ("th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha as ou io le"
            " ve co me de hi ri ro ic ne ea ra ce li ch ll be ma si om ur").split()


@dataclass(frozen=True)
class Vocab:
    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]     # llama_token_type: 1 normal, 2 unknown, 3 control, 6 byte
    bos: int = 1
    eos: int = 2
    unk: int = 0


def spm_vocab() -> Vocab:
    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    types: list[int] = [2, 3, 3]
    scores: list[float] = [0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(6)
        scores.append(0.0)
    pieces: list[str] = [_SP] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += [_SP + chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += list(_BIGRAMS) + [_SP + w for w in _WORDS]
    seen: set[str] = set()
    for i, p in enumerate(pieces):
        if p in seen:
            continue
        seen.add(p)
        tokens.append(p)
        types.append(1)
        scores.append(-float(i))  # earlier pieces merge first; longer words listed last still win by length
    return Vocab(tuple(tokens), tuple(scores), tuple(types))


@dataclass(frozen=True)
class SynthSpec:
    arch: str = "llama"
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 192
    n_ctx: int = 256
    tied: bool = False
    dtype: str = "f32"
    seed: int = 0
    name: str = field(default="")
    n_expert: int = 8          # qwen3moe only: experts per layer
    n_expert_used: int = 2     # qwen3moe only: top-k
    n_ff_exp: int = 64         # qwen3moe only: hidden size of one expert
    key_length: int = 0        # head size when it is not n_embd / n_head (0: n_embd / n_head)
    n_vocab: int = 0           # pad the vocabulary with filler pieces to this size (0: dgr's small one)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    rope_scaling: tuple[float, float, float, int] | None = None   # Llama 3 RoPE frequency factors
    preset: str = ""           # the realistic shape this spec copies (dgr gguf synth --preset)
    chat_template: str = ""    # tokenizer.chat_template (presets: the family's chat format)

    @property
    def head_dim(self) -> int:
        return self.key_length or self.n_embd // self.n_head

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim


# A tensor plan: (name, numpy shape (rows, cols) = GGUF (ne1, ne0), kind) where kind picks the
# initialisation: "norm" (ones), "embd", "in" (1/sqrt(fan_in)), "out" (residual-scaled), "bias".
Plan = list[tuple[str, tuple[int, ...], str]]


def _llama_plan(s: SynthSpec, with_bias: bool = False) -> Plan:
    kv = s.n_head_kv * s.head_dim
    plan: Plan = []
    for i in range(s.n_layer):
        b = f"blk.{i}"
        plan += [(f"{b}.attn_norm.weight", (s.n_embd,), "norm"),
                 (f"{b}.attn_q.weight", (s.q_dim, s.n_embd), "in"),
                 (f"{b}.attn_k.weight", (kv, s.n_embd), "in"),
                 (f"{b}.attn_v.weight", (kv, s.n_embd), "in")]
        if with_bias:
            plan += [(f"{b}.attn_q.bias", (s.q_dim,), "bias"), (f"{b}.attn_k.bias", (kv,), "bias"),
                     (f"{b}.attn_v.bias", (kv,), "bias")]
        plan += [(f"{b}.attn_output.weight", (s.n_embd, s.q_dim), "out"),
                 (f"{b}.ffn_norm.weight", (s.n_embd,), "norm"),
                 (f"{b}.ffn_gate.weight", (s.n_ff, s.n_embd), "in"),
                 (f"{b}.ffn_up.weight", (s.n_ff, s.n_embd), "in"),
                 (f"{b}.ffn_down.weight", (s.n_embd, s.n_ff), "out")]
    return plan


def _gemma3_plan(s: SynthSpec) -> Plan:
    kv = s.n_head_kv * s.head_dim
    plan: Plan = []
    for i in range(s.n_layer):
        b = f"blk.{i}"
        plan += [(f"{b}.attn_norm.weight", (s.n_embd,), "norm"),
                 (f"{b}.attn_q.weight", (s.q_dim, s.n_embd), "in"),
                 (f"{b}.attn_k.weight", (kv, s.n_embd), "in"),
                 (f"{b}.attn_v.weight", (kv, s.n_embd), "in"),
                 (f"{b}.attn_q_norm.weight", (s.head_dim,), "norm"),
                 (f"{b}.attn_k_norm.weight", (s.head_dim,), "norm"),
                 (f"{b}.attn_output.weight", (s.n_embd, s.q_dim), "out"),
                 (f"{b}.post_attention_norm.weight", (s.n_embd,), "norm"),
                 (f"{b}.ffn_norm.weight", (s.n_embd,), "norm"),
                 (f"{b}.ffn_gate.weight", (s.n_ff, s.n_embd), "in"),
                 (f"{b}.ffn_up.weight", (s.n_ff, s.n_embd), "in"),
                 (f"{b}.ffn_down.weight", (s.n_embd, s.n_ff), "out"),
                 (f"{b}.post_ffw_norm.weight", (s.n_embd,), "norm")]
    return plan


def _qwen3_attn(b: str, s: SynthSpec) -> Plan:
    kv = s.n_head_kv * s.head_dim
    return [(f"{b}.attn_norm.weight", (s.n_embd,), "norm"),
            (f"{b}.attn_q.weight", (s.q_dim, s.n_embd), "in"),
            (f"{b}.attn_k.weight", (kv, s.n_embd), "in"),
            (f"{b}.attn_v.weight", (kv, s.n_embd), "in"),
            (f"{b}.attn_q_norm.weight", (s.head_dim,), "norm"),
            (f"{b}.attn_k_norm.weight", (s.head_dim,), "norm"),
            (f"{b}.attn_output.weight", (s.n_embd, s.q_dim), "out"),
            (f"{b}.ffn_norm.weight", (s.n_embd,), "norm")]


def _qwen3_plan(s: SynthSpec) -> Plan:
    plan: Plan = []
    for i in range(s.n_layer):
        b = f"blk.{i}"
        plan += _qwen3_attn(b, s)
        plan += [(f"{b}.ffn_gate.weight", (s.n_ff, s.n_embd), "in"),
                 (f"{b}.ffn_up.weight", (s.n_ff, s.n_embd), "in"),
                 (f"{b}.ffn_down.weight", (s.n_embd, s.n_ff), "out")]
    return plan


def _qwen3moe_plan(s: SynthSpec) -> Plan:
    # GGUF shapes: ffn_gate_inp {n_embd, n_expert}; *_exps {in, out, n_expert} (numpy: reversed)
    plan: Plan = []
    for i in range(s.n_layer):
        b = f"blk.{i}"
        plan += _qwen3_attn(b, s)
        plan += [(f"{b}.ffn_gate_inp.weight", (s.n_expert, s.n_embd), "router"),
                 (f"{b}.ffn_gate_exps.weight", (s.n_expert, s.n_ff_exp, s.n_embd), "in"),
                 (f"{b}.ffn_up_exps.weight", (s.n_expert, s.n_ff_exp, s.n_embd), "in"),
                 (f"{b}.ffn_down_exps.weight", (s.n_expert, s.n_embd, s.n_ff_exp), "out")]
    return plan


def _common_hparams(s: SynthSpec) -> dict[str, tuple[str, object]]:
    return {
        "context_length": ("u32", s.n_ctx),
        "embedding_length": ("u32", s.n_embd),
        "block_count": ("u32", s.n_layer),
        "feed_forward_length": ("u32", s.n_ff),
        "attention.head_count": ("u32", s.n_head),
        "attention.head_count_kv": ("u32", s.n_head_kv),
        "attention.layer_norm_rms_epsilon": ("f32", s.rms_eps),
        "rope.freq_base": ("f32", s.rope_theta),
    }


def _llama_hparams(s: SynthSpec) -> dict[str, tuple[str, object]]:
    hp = _common_hparams(s)
    hp["rope.dimension_count"] = ("u32", s.head_dim)
    return hp


def _gemma3_hparams(s: SynthSpec) -> dict[str, tuple[str, object]]:
    hp = _common_hparams(s)
    hp["attention.key_length"] = ("u32", s.head_dim)
    hp["attention.value_length"] = ("u32", s.head_dim)
    hp["attention.sliding_window"] = ("u32", 64)
    return hp


def _qwen3_hparams(s: SynthSpec) -> dict[str, tuple[str, object]]:
    hp = _common_hparams(s)
    hp["attention.key_length"] = ("u32", s.head_dim)
    hp["attention.value_length"] = ("u32", s.head_dim)
    return hp


def _qwen3moe_hparams(s: SynthSpec) -> dict[str, tuple[str, object]]:
    hp = _qwen3_hparams(s)
    hp["expert_count"] = ("u32", s.n_expert)
    hp["expert_used_count"] = ("u32", s.n_expert_used)
    hp["expert_feed_forward_length"] = ("u32", s.n_ff_exp)
    return hp


@dataclass(frozen=True)
class ArchWriter:
    hparams: Callable[[SynthSpec], dict[str, tuple[str, object]]]
    blocks: Callable[[SynthSpec], Plan]
    supports_untied: bool = True


ARCHS: dict[str, ArchWriter] = {
    "llama": ArchWriter(_llama_hparams, _llama_plan),
    "qwen2": ArchWriter(_common_hparams, lambda s: _llama_plan(s, with_bias=True)),
    "gemma3": ArchWriter(_gemma3_hparams, _gemma3_plan, supports_untied=False),
    "qwen3": ArchWriter(_qwen3_hparams, _qwen3_plan),
    "qwen3moe": ArchWriter(_qwen3moe_hparams, _qwen3moe_plan),
}


def _check(spec: SynthSpec) -> None:
    if spec.arch not in ARCHS:
        raise DgrError(f"synth: unknown architecture {spec.arch!r}", hint=f"one of {', '.join(ARCHS)}")
    if spec.dtype not in DTYPES:
        raise DgrError(f"synth: unknown dtype {spec.dtype!r}", hint=f"one of {', '.join(DTYPES)}")
    if spec.n_layer < 1 or spec.n_layer > 256:
        raise DgrError(f"synth: --layers must be 1..256, got {spec.n_layer}")
    if spec.key_length == 0 and spec.n_embd % spec.n_head or spec.n_head % spec.n_head_kv:
        raise DgrError("synth: n_embd must divide by n_head and n_head by n_head_kv")
    widths = [spec.n_embd, spec.n_ff, spec.n_head_kv * spec.head_dim, spec.q_dim]
    if spec.arch == "qwen3moe":
        widths.append(spec.n_ff_exp)
    if spec.dtype == "q8_0" and any(w % 32 for w in widths):
        raise DgrError("synth: q8_0 needs n_embd, n_ff (n_ff_exp) and the KV width to be multiples of 32")
    if spec.dtype == "q4_k_m" and any(w % 256 for w in widths):
        raise DgrError("synth: q4_k_m needs every matrix row (n_embd, n_ff, n_ff_exp, the Q and KV widths) "
                       "to be a multiple of 256", hint="use a --preset, or --dtype q8_0")
    if spec.arch == "qwen3moe" and not (1 <= spec.n_expert_used <= spec.n_expert <= 256):
        raise DgrError("synth: qwen3moe needs 1 <= experts used <= experts <= 256")
    if not spec.tied and not ARCHS[spec.arch].supports_untied:
        raise DgrError(f"synth: {spec.arch} models always tie the output embedding", hint="pass --tied")
    if spec.n_vocab and spec.n_vocab < len(spm_vocab().tokens):
        raise DgrError(f"synth: a vocabulary needs at least {len(spm_vocab().tokens)} tokens")


def padded_vocab(n_vocab: int) -> Vocab:
    """dgr's small vocabulary, padded with unique filler pieces ("▁t<id>") to ``n_vocab`` tokens."""
    v = spm_vocab()
    if n_vocab <= len(v.tokens):
        return v
    extra = range(len(v.tokens), n_vocab)
    return Vocab(v.tokens + tuple(f"{_SP}t{i}" for i in extra), v.scores + tuple(-1000.0 - i for i in extra),
                 v.types + (1,) * len(extra), v.bos, v.eos, v.unk)


def spec_from_preset(name: str, *, dtype: str = "q4_k_m", n_layer: int | None = None, seed: int = 0) -> SynthSpec:
    """The SynthSpec of a realistic preset (cli/dgr/gguf/presets.py); ``n_layer`` overrides the depth."""
    from .presets import CHAT_TEMPLATES, PRESET_DTYPES, preset

    p = preset(name)
    if dtype not in PRESET_DTYPES:
        raise DgrError(f"synth: a preset is written in {', '.join(PRESET_DTYPES)}, not {dtype!r}")
    layers = p.n_layer if n_layer is None else n_layer
    return SynthSpec(arch=p.arch, n_layer=layers, n_embd=p.n_embd, n_head=p.n_head, n_head_kv=p.n_head_kv,
                     n_ff=p.n_ff, n_ctx=p.n_ctx, tied=p.tied, dtype=dtype, seed=seed,
                     name=f"dgr-synth-{p.name}-{layers}L-{dtype} (synthetic)",
                     n_expert=p.n_expert or 8, n_expert_used=p.n_expert_used or 2, n_ff_exp=p.n_ff_exp or 64,
                     key_length=p.head_dim if p.head_dim != p.n_embd // p.n_head else 0,
                     n_vocab=p.n_vocab, rope_theta=p.rope_theta, rms_eps=p.rms_eps,
                     rope_scaling=p.rope_scaling, preset=p.name, chat_template=CHAT_TEMPLATES[p.arch])


def tensor_plan(spec: SynthSpec) -> Plan:
    """Every tensor of the model in file order: (name, numpy shape, initialisation kind)."""
    n_vocab = len(padded_vocab(spec.n_vocab).tokens)
    plan: Plan = [("token_embd.weight", (n_vocab, spec.n_embd), "embd")]
    if spec.rope_scaling is not None:
        plan.append(("rope_freqs.weight", (spec.head_dim // 2,), "rope_freqs"))
    plan += ARCHS[spec.arch].blocks(spec)
    plan.append(("output_norm.weight", (spec.n_embd,), "norm"))
    if not spec.tied:
        plan.append(("output.weight", (n_vocab, spec.n_embd), "embd"))
    return plan


def _ggml_type(spec: SynthSpec, name: str, shape: tuple[int, ...], kind: str) -> str:
    """The ggml type of one tensor: matrices (and stacked experts) take the model dtype, the
    router stays F32 as in real conversions, vectors (norms, biases, RoPE factors) are F32."""
    if len(shape) < 2 or kind == "router":
        return "F32"
    if spec.dtype == "q4_k_m":
        from .presets import q4_k_m_type

        return q4_k_m_type(name, spec.n_layer, spec.tied)
    return spec.dtype.upper()


def _std(spec: SynthSpec, shape: tuple[int, ...], kind: str) -> float:
    # Logits ~ N(0, 2) from a separate output matrix. A tied embedding is kept small so the
    # layers, not the input token's own row, steer the final state (else greedy repeats it).
    embd_gain = 0.25 if spec.tied else 2.0
    residual_scale = 1.0 / math.sqrt(2.0 * spec.n_layer)
    return {"embd": embd_gain, "in": 1.0, "out": residual_scale}[kind] / math.sqrt(shape[-1])


def _tensor_data(spec: SynthSpec, rng: np.random.Generator, name: str, shape: tuple[int, ...], kind: str,
                 ggml_type: str) -> np.ndarray:
    """One tensor's bytes or values, made when it is written (memory: about one tensor)."""
    if kind == "norm":
        return np.ones(shape, dtype=np.float32)
    if kind == "rope_freqs":
        from .presets import llama3_rope_factors

        assert spec.rope_scaling is not None
        return llama3_rope_factors(spec.head_dim, spec.rope_theta, spec.rope_scaling)
    if kind == "bias":
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
    if kind == "router":
        # spread router logits so top-k picks differ from token to token
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(4.0 / math.sqrt(shape[-1]))
    std = _std(spec, shape, kind)
    if ggml_type in ("Q4_K", "Q6_K"):
        from .presets import kquant_blocks

        return kquant_blocks(ggml_type, rng, int(np.prod(shape)), std)
    data = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)
    if ggml_type == "F16":
        return data.astype(np.float16)
    if ggml_type == "Q8_0":
        import gguf

        return gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
    return data


def _tensor_info(ggml_type: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], np.dtype, int, object]:
    """(shape as the writer wants it, numpy dtype, byte count, raw ggml type or None)."""
    import gguf

    n = int(np.prod(shape))
    if ggml_type == "F32":
        return shape, np.dtype(np.float32), 4 * n, None
    if ggml_type == "F16":
        return shape, np.dtype(np.float16), 2 * n, None
    qt = gguf.GGMLQuantizationType[ggml_type]
    block, type_size = gguf.GGML_QUANT_SIZES[qt]
    byte_shape = (*shape[:-1], shape[-1] // block * type_size)
    return byte_shape, np.dtype(np.uint8), n // block * type_size, qt


_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_k_m": "MOSTLY_Q4_K_M"}


SYNTHETIC_MARK = "dgr synthetic model"   # how general.description of every synthesized model begins


def synthetic_description(path: str | Path) -> str | None:
    """The description a synthesized GGUF carries (random weights, which preset), or None for any
    other model. Evidence built on such a file says so: it never certifies a recipe."""
    from .inspect import open_gguf

    with open_gguf(path) as g:
        desc = g.get("general.description")
    return desc if isinstance(desc, str) and desc.startswith(SYNTHETIC_MARK) else None


def synthesize(spec: SynthSpec, out: str | Path, *, progress: bool = False) -> Path:
    """Write the synthetic model to ``out`` (atomically) and return its path.

    Tensors are written one at a time as they are made, so memory stays near one tensor: an
    8B-shaped Q4_K_M (about 4.6 GiB) is written in well under a minute on 2 cores."""
    import gguf

    from ..console import Progress
    from ..paths import refuse_home

    _check(spec)
    out = Path(out)
    refuse_home(out.parent, "output folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    arch = ARCHS[spec.arch]
    vocab = padded_vocab(spec.n_vocab)
    rng = np.random.default_rng(spec.seed)

    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    w = gguf.GGUFWriter(tmp, spec.arch)
    w.add_name(spec.name or f"dgr-synth-{spec.arch}-{spec.n_layer}L-{spec.dtype}{'-tied' if spec.tied else ''}")
    shape_note = f"; shapes of the {spec.preset} preset" if spec.preset else ""
    w.add_string("general.description",
                 f"{SYNTHETIC_MARK}, seed {spec.seed}; random weights, not a language model{shape_note}")
    w.add_file_type(int(gguf.LlamaFileType[_FILE_TYPES[spec.dtype]]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, (kind, val) in arch.hparams(spec).items():
        k = f"{spec.arch}.{key}"
        if kind == "u32":
            w.add_uint32(k, int(val))  # type: ignore[arg-type]
        else:
            w.add_float32(k, float(val))  # type: ignore[arg-type]
    w.add_uint32(f"{spec.arch}.vocab_size", len(vocab.tokens))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(list(vocab.tokens))
    w.add_token_scores(list(vocab.scores))
    w.add_token_types(list(vocab.types))
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    w.add_unk_token_id(vocab.unk)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if spec.chat_template:
        w.add_chat_template(spec.chat_template)

    plan = [(name, shape, kind, _ggml_type(spec, name, shape, kind)) for name, shape, kind in tensor_plan(spec)]
    total = 0
    for name, shape, _kind, ggml_type in plan:
        wshape, dtype, nbytes, raw = _tensor_info(ggml_type, shape)
        w.add_tensor_info(name, wshape, dtype, nbytes, raw_dtype=raw)  # type: ignore[arg-type]
        total += nbytes
    bar = Progress(f"writing {out.name} (synthetic)", total) if progress else None
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, shape, kind, ggml_type in plan:
            data = _tensor_data(spec, rng, name, shape, kind, ggml_type)
            w.write_tensor_data(data)
            if bar:
                bar.update(data.nbytes)
            del data
        w.close()
        tmp.replace(out)
    finally:
        if bar:
            bar.close()
        tmp.unlink(missing_ok=True)
    return out
