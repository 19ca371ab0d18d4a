"""Batched Transformers lanes of the release gate (DGR-014): the fair baseline beside the
unbatched safetensors route.

The gate's "current route" lane (:mod:`dgr.bench.hf_worker` shards, one session step at a time)
loses to any batched runtime by construction once several sessions run. These lanes give the
Transformers side its own batching, on the whole model in one process (``python -m
dgr.bench.hf_batched CONFIG.json RESULT.json``, so the toolkit never imports torch):

- ``static``: one batch of all sessions' prompts, left-padded to the longest with an attention
  mask and explicit positions, then greedy decoding of every row in lockstep with a KV cache
  (what a batched ``generate`` does, timed per step);
- ``continuous``: Transformers' own continuous batching (``model.generate_batch``), when the
  installed version has it; greedy, every request asked for the same new tokens. It reports
  end-to-end throughput only (its per-step times are not exposed). Its manager is kept between
  the untimed warm-up and the timed call (``persistent_manager``): a fresh one costs about 11 s of
  start-up per call on this host, which would measure the start-up, not the batching. When it is missing or fails on
  this host, the result says so with the reason.

Every lane reports end-to-end throughput (sessions x new tokens / wall time, prefill included),
the same definition the gate computes for its routes, so the two can be compared.
"""

from __future__ import annotations

import sys
import time
from typing import Any


def _setup(cfg: dict[str, Any]):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(int(cfg["threads"]))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    model = AutoModelForCausalLM.from_pretrained(cfg["hf_dir"], dtype=torch.float32)
    model.eval()
    return torch, model


def static_batch(torch, model, prompts: list[list[int]], n_gen: int, pad_id: int = 0) -> dict[str, Any]:
    """Greedy decoding of all prompts as one left-padded batch; tokens and timings."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1, :].float().argmax(-1)
        ttft = time.perf_counter() - t0
        past, last = out.past_key_values, pos[:, -1]
        toks, lat = [nxt], []
        for _ in range(1, n_gen):
            t1 = time.perf_counter()
            mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=torch.long)], dim=1)
            last = last + 1
            out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None],
                        past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1, :].float().argmax(-1)
            lat.append(time.perf_counter() - t1)
            toks.append(nxt)
        wall = time.perf_counter() - t0
    c = len(prompts)
    return {"sessions": c, "tokens": torch.stack(toks, dim=1).tolist(), "ttft_s": ttft,
            "prefill_tok_s": sum(len(p) for p in prompts) / ttft,
            "decode_tok_s": c * len(lat) / sum(lat) if lat else None,
            "end_to_end_tok_s": c * n_gen / wall, "wall_s": wall, "padded_to": width}


def continuous_batch(model, prompts: list[list[int]], n_gen: int) -> dict[str, Any]:
    """Transformers' continuous batching over all prompts at once (greedy); end-to-end figures."""
    if not hasattr(model, "generate_batch"):
        return {"available": False, "reason": "this transformers has no generate_batch (continuous batching)"}
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=n_gen, do_sample=False, eos_token_id=-1, pad_token_id=0)
    try:
        # warm-up, untimed; the manager persists, or every call pays its start-up (~11 s measured)
        model.generate_batch(inputs=[list(prompts[0])], generation_config=gc, persistent_manager=True)
        t0 = time.perf_counter()
        res = model.generate_batch(inputs=[list(p) for p in prompts], generation_config=gc,
                                   persistent_manager=True)
        wall = time.perf_counter() - t0
    except Exception as exc:  # a lane this host cannot run is reported, not fatal to the gate
        return {"available": False, "reason": f"generate_batch failed: {type(exc).__name__}: {exc}"[:400]}
    made = [len(getattr(r, "generated_tokens", []) or []) for r in res.values()]
    return {"available": True, "sessions": len(prompts), "generated_tokens": made, "wall_s": wall,
            "end_to_end_tok_s": sum(made) / wall if wall > 0 else None,
            "tokens": [list(getattr(r, "generated_tokens", []) or []) for r in res.values()]}


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    torch, model = _setup(cfg)
    prompts, n_gen = cfg["prompts"], int(cfg["n_gen"])
    static_batch(torch, model, [prompts[0][:8]], 2)      # warm-up: no one-time costs in the timed runs
    out: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    import transformers

    out["transformers"] = transformers.__version__
    if "static" in cfg["modes"]:
        out["static"] = static_batch(torch, model, prompts, n_gen)
    if "continuous" in cfg["modes"]:
        out["continuous"] = continuous_batch(model, prompts, n_gen)
    return out


def main(argv: list[str] | None = None) -> int:
    from .hf_lane import child_main

    return child_main("dgr.bench.hf_batched", run, argv)


if __name__ == "__main__":
    sys.exit(main())
