"""The Transformers side of the Python Shard worker (:mod:`dgr.bench.hf_worker`): one layer range
of a safetensors Llama-family checkpoint (:class:`RangeModel`: only the owned tensors loaded, one
``DynamicCache`` per session), the tail's sampling contract on its logits (:func:`sample`), and
the identity values the worker advertises (recipe JSON, fingerprint, artifact id).

Needs the ``baseline`` extra (torch, transformers, safetensors), imported when a model is loaded.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from ..shard.v1 import shard_runtime_pb2 as pb

BACKEND = "transformers"


def recipe_json(artifact_id: str, dtype: str, n_layer: int) -> str:
    return json.dumps({"runtime": BACKEND, "weights": f"safetensors-{dtype}", "activation_dtype": "f32",
                       "compute_dtype": dtype, "kv": f"DynamicCache-{dtype}", "boundary": "residual-f32/v1",
                       "artifact": artifact_id, "n_layer": n_layer}, sort_keys=True)


def fingerprint_of(recipe: str) -> str:
    return hashlib.sha256(recipe.encode()).hexdigest()


def artifact_id_of(model_dir: Path) -> str:
    """sha256 of the single safetensors file (or of "name sha" lines for several), as DGR-001."""
    from .hf_export import sha256_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"dgr-hf-worker: no *.safetensors in {model_dir}")
    if len(files) == 1:
        return sha256_file(files[0])
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name} {sha256_file(f)}\n".encode())
    return h.hexdigest()


# ---- the model range ------------------------------------------------------------------------

class RangeModel:
    """Layers [start, end) of a Llama-family checkpoint, loaded from safetensors."""

    def __init__(self, model_dir: Path, start: int, end: int, *, dtype: str = "fp32", threads: int = 0) -> None:
        import torch
        from safetensors import safe_open
        from transformers import AutoConfig, AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        cfg = AutoConfig.from_pretrained(str(model_dir))
        self.n_layer = int(cfg.num_hidden_layers)
        if not 0 <= start < end <= self.n_layer:
            raise SystemExit(f"dgr-hf-worker: range {start}:{end} outside [0, {self.n_layer})")
        self.start, self.end = start, end
        self.head, self.tail = start == 0, end == self.n_layer
        self.n_embd, self.n_vocab = int(cfg.hidden_size), int(cfg.vocab_size)
        self.eos = {int(x) for x in np.atleast_1d(cfg.eos_token_id if cfg.eos_token_id is not None else [])}
        tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        local = type(cfg).from_dict({**cfg.to_dict(), "num_hidden_layers": end - start})
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(local, attn_implementation="sdpa", dtype=tdtype)
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        want_embed = self.head or (self.tail and tied)
        state: dict[str, Any] = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    new = self._local_name(name, want_embed)
                    if new is not None:
                        state[new] = sf.get_tensor(name).to(tdtype)
        if self.tail and "lm_head.weight" not in state and tied:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        # drop what this range never runs before materializing (memory scales with owned tensors)
        if not want_embed:
            model.model.embed_tokens = None
        if not self.tail:
            model.model.norm = torch.nn.Identity()
            model.lm_head = None
        model.to_empty(device="cpu")
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        missing = [m for m in missing if "rotary_emb" not in m]
        if missing or unexpected:
            raise SystemExit(f"dgr-hf-worker: checkpoint does not fit the range: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]}")
        if self.tail and tied:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.model.rotary_emb = type(model.model.rotary_emb)(config=local)  # buffers computed on CPU
        model.eval()
        self.model = model
        self.weight_bytes = sum(t.numel() * t.element_size() for t in {id(v): v for v in state.values()}.values())
        self.kv_bytes_per_cell = 2 * (end - start) * int(cfg.num_key_value_heads) * \
            (self.n_embd // int(cfg.num_attention_heads)) * (4 if dtype == "fp32" else 2)

    def _local_name(self, name: str, want_embed: bool) -> str | None:
        if name.startswith("model.layers."):
            idx = int(name.split(".")[2])
            if not self.start <= idx < self.end:
                return None
            rest = name.split(".", 3)[3]
            return f"model.layers.{idx - self.start}.{rest}"
        if name == "model.embed_tokens.weight":
            return name if want_embed else None
        if name in ("model.norm.weight", "lm_head.weight"):
            return name if self.tail else None
        return None

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache()

    def forward(self, cache: Any, pos0: int, tokens: list[int] | None, residual: np.ndarray | None) -> np.ndarray:
        """Runs positions [pos0, pos0 + n) through the range; returns the boundary residual
        (non-tail) or the last position's logits (tail), float32."""
        torch = self.torch
        n = len(tokens) if tokens is not None else residual.shape[0]
        cache_position = torch.arange(pos0, pos0 + n)
        kw: dict[str, Any] = {"past_key_values": cache, "use_cache": True, "cache_position": cache_position,
                              "position_ids": cache_position[None]}
        with torch.inference_mode():
            if tokens is not None:
                kw["input_ids"] = torch.tensor([tokens], dtype=torch.long)
            else:
                kw["inputs_embeds"] = torch.from_numpy(residual).to(self.model.dtype)[None]
            out = self.model.model(**kw).last_hidden_state
            if not self.tail:
                return out[0].float().numpy()
            return self.model.lm_head(out[:, -1:, :])[0, -1].float().numpy()


# ---- sampling (the tail's contract) ----------------------------------------------------------

def sample(logits: np.ndarray, s: pb.SamplingParams, rng: np.random.Generator) -> tuple[int, float, list[tuple[int, float]]]:
    x = logits.astype(np.float64)
    lse = float(np.log(np.exp(x - x.max()).sum()) + x.max())
    if s.mode == pb.SAMPLING_MODE_STOCHASTIC:
        order = np.argsort(-x, kind="stable")
        if s.top_k:
            order = order[: s.top_k]
        p = np.exp(x[order] - x[order[0]])
        p /= p.sum()
        keep = len(order)
        if 0 < s.top_p < 1:
            keep = max(1, int(np.searchsorted(np.cumsum(p), s.top_p) + 1))
        if s.min_p > 0:
            keep = max(1, min(keep, int((p >= s.min_p * p[0]).sum())))
        w = np.exp((x[order[:keep]] - x[order[0]]) / s.temperature)
        tok = int(order[rng.choice(keep, p=w / w.sum())])
    else:
        tok = int(np.argmax(x))
    top = []
    if s.top_logprobs:
        k = min(int(s.top_logprobs), len(x))
        idx = np.argsort(-x, kind="stable")[:k]
        top = [(int(i), float(x[i] - lse)) for i in idx]
    return tok, float(x[tok] - lse), top
