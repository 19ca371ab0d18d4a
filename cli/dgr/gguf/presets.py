"""Realistic model shapes for synthetic GGUFs (`dgr gguf synth --preset NAME`), and the K-quant
blocks they are written in.

A preset copies the shapes of a published model family: layer count, width, attention and KV
heads, head size, FFN size, vocabulary size, RoPE base (and Llama 3's RoPE frequency factors),
RMS epsilon, training context and whether the output is tied to the token embedding. The
weights are random (seeded) and the tokenizer is dgr's small SentencePiece vocabulary padded
with filler pieces to the real vocabulary size: a preset has the compute and memory profile of
the real model, never its behaviour. Files made from a preset are always labelled synthetic.

Q4_K_M is written directly, block by block, without a float copy of the weights: random 4-bit
(Q4_K) or 6-bit (Q6_K) quants under one scale per tensor chosen so that the dequantized values
have the standard deviation the float initialisation would have used. Which tensor gets which
type follows llama.cpp's ``llama-quantize`` rules for Q4_K_M at the pin (``llama-quant.cpp``):
the output matrix (or the token embedding when it is tied) in Q6_K; ``attn_v`` and ``ffn_down``
in Q6_K in the layers ``use_more_bits`` picks (the first and last eighth, every third layer
between); every other matrix in Q4_K; vectors in F32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

QK_K = 256
Q4_K_BLOCK = 144   # d (f16), dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of 4-bit quants
Q6_K_BLOCK = 210   # 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, d (f16)

# Q4_K: every sub-block scale and min = 32 (6 bits each, packed as llama.cpp's get_scale_min_k4).
_Q4_K_SCALES = np.array([160] * 8 + [0] * 4, dtype=np.uint8)
_Q4_K_SC = 32
_Q4_STD = math.sqrt((16 * 16 - 1) / 12)       # std of a uniform 4-bit quant (0..15)
_Q6_K_SCALE = 16
_Q6_STD = math.sqrt((64 * 64 - 1) / 12)       # std of a uniform 6-bit quant (-32..31)


@dataclass(frozen=True)
class Preset:
    name: str
    arch: str
    family: str              # the published model whose shapes this copies
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx: int               # the family's training context (context_length)
    rope_theta: float
    rms_eps: float
    tied: bool
    # Llama 3 RoPE frequency factors: (factor, low_freq_factor, high_freq_factor, original context)
    rope_scaling: tuple[float, float, float, int] | None = None
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    real_layers: int = 0     # when the preset keeps fewer layers than the family: the real count
    note: str = ""


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("llama-3.2-1b", "llama", "Llama 3.2 1B", n_layer=16, n_embd=2048, n_head=32, n_head_kv=8,
           head_dim=64, n_ff=8192, n_vocab=128256, n_ctx=131072, rope_theta=500000.0, rms_eps=1e-5,
           tied=True, rope_scaling=(32.0, 1.0, 4.0, 8192)),
    Preset("llama-3.2-3b", "llama", "Llama 3.2 3B", n_layer=28, n_embd=3072, n_head=24, n_head_kv=8,
           head_dim=128, n_ff=8192, n_vocab=128256, n_ctx=131072, rope_theta=500000.0, rms_eps=1e-5,
           tied=True, rope_scaling=(32.0, 1.0, 4.0, 8192)),
    Preset("llama-3.1-8b", "llama", "Llama 3.1 8B", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8,
           head_dim=128, n_ff=14336, n_vocab=128256, n_ctx=131072, rope_theta=500000.0, rms_eps=1e-5,
           tied=False, rope_scaling=(8.0, 1.0, 4.0, 8192)),
    Preset("qwen3-8b", "qwen3", "Qwen3 8B", n_layer=36, n_embd=4096, n_head=32, n_head_kv=8,
           head_dim=128, n_ff=12288, n_vocab=151936, n_ctx=40960, rope_theta=1000000.0, rms_eps=1e-6,
           tied=False),
    Preset("qwen3-30b-a3b", "qwen3moe", "Qwen3 30B-A3B", n_layer=8, n_embd=2048, n_head=32, n_head_kv=4,
           head_dim=128, n_ff=6144, n_vocab=151936, n_ctx=40960, rope_theta=1000000.0, rms_eps=1e-6,
           tied=False, n_expert=128, n_expert_used=8, n_ff_exp=768, real_layers=48,
           note="8 of the real model's 48 layers by default (every layer has the real shapes; "
                "--layers 48 writes the full depth, about 17 GiB in Q4_K_M)"),
)}

PRESET_DTYPES = ("f16", "q8_0", "q4_k_m")

# The families' chat formats, as short templates llama.cpp's llama_chat_apply_template recognises
# (the markers are plain text to the synthetic vocabulary, as any unknown text would be).
CHAT_TEMPLATES = {
    "llama": ("{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
              "{{ message['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
              "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "qwen3": ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
}
CHAT_TEMPLATES["qwen3moe"] = CHAT_TEMPLATES["qwen3"]


def preset(name: str) -> Preset:
    from ..errors import DgrError

    if name not in PRESETS:
        raise DgrError(f"synth: unknown preset {name!r}", hint=f"one of {', '.join(PRESETS)}")
    return PRESETS[name]


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quantize's choice of the layers that keep more bits in the *_M mixes."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def q4_k_m_type(name: str, n_layer: int, tied: bool) -> str:
    """The ggml type llama-quantize gives a matrix in a Q4_K_M file: 'Q4_K' or 'Q6_K'."""
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down", "ffn_down_exps"):
        if use_more_bits(int(parts[1]), n_layer):
            return "Q6_K"
    return "Q4_K"


def kquant_bytes(ggml_type: str, n_elements: int) -> int:
    block = {"Q4_K": Q4_K_BLOCK, "Q6_K": Q6_K_BLOCK}[ggml_type]
    return n_elements // QK_K * block


def q4_k_blocks(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """Random Q4_K blocks whose dequantized values are uniform, zero-mean, of the given std."""
    d = std / (_Q4_K_SC * _Q4_STD)
    head = np.empty(4, dtype=np.uint8)
    head[:2] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    head[2:] = np.frombuffer(np.float16(d * 7.5).tobytes(), dtype=np.uint8)  # dmin*min centres the quants
    blocks = np.empty((n_blocks, Q4_K_BLOCK), dtype=np.uint8)
    blocks[:, :4] = head
    blocks[:, 4:16] = _Q4_K_SCALES
    blocks[:, 16:] = np.frombuffer(rng.bytes(n_blocks * 128), dtype=np.uint8).reshape(n_blocks, 128)
    return blocks


def q6_k_blocks(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """Random Q6_K blocks whose dequantized values are uniform, near zero-mean, of the given std."""
    d = std / (_Q6_K_SCALE * _Q6_STD)
    blocks = np.empty((n_blocks, Q6_K_BLOCK), dtype=np.uint8)
    blocks[:, :192] = np.frombuffer(rng.bytes(n_blocks * 192), dtype=np.uint8).reshape(n_blocks, 192)
    blocks[:, 192:208] = _Q6_K_SCALE
    blocks[:, 208:] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    return blocks


def kquant_blocks(ggml_type: str, rng: np.random.Generator, n_elements: int, std: float) -> np.ndarray:
    n_blocks = n_elements // QK_K
    return (q4_k_blocks if ggml_type == "Q4_K" else q6_k_blocks)(rng, n_blocks, std)


def llama3_rope_factors(head_dim: int, base: float, scaling: tuple[float, float, float, int]) -> np.ndarray:
    """Llama 3's rope_freqs.weight, as the llama.cpp converter computes it."""
    factor, low_freq_factor, high_freq_factor, old_ctx = scaling
    low_freq_wavelen = old_ctx / low_freq_factor
    high_freq_wavelen = old_ctx / high_freq_factor
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / (base ** (i / head_dim))
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(1.0)
        elif wavelen > low_freq_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)
