"""The Transformers/safetensors recipe of the DGR-001 baseline (PyTorch, fp32 or bf16).

Runs in its own process (``python -m dgr.bench.hf_lane CONFIG.json``) so each precision's peak RSS is
its own, and so the core toolkit never imports torch. It does, on token ids given by the caller
(identical for every recipe), exactly what the llama.cpp probe does:

- ``gen``: prefill each fixed prompt (logits of every prompt position saved as float32 .npy),
  then greedy decoding with a KV cache, timing the first token and every later one;
- ``perf``: prefill timing of the performance prompt (reps) and timed greedy decodes (rounds);
- ``concurrency``: the same with 1 and 4 equal-length sessions batched (aggregate throughput);
- ``score``: log-likelihood of the shipped text in non-overlapping chunks (the same chunking).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable


def _setup(cfg: dict[str, Any]):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(int(cfg["threads"]))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg["dtype"]]
    model = AutoModelForCausalLM.from_pretrained(cfg["hf_dir"], dtype=dtype)
    model.to(cfg["device"])
    model.eval()
    return torch, model


def _sync(torch, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _greedy(torch, model, ids: list[list[int]], n_gen: int, device: str, keep_logits: bool = False):
    """Batched greedy decoding with a KV cache; returns tokens per row, TTFT, per-step latencies,
    and (optionally) the prompt logits of row 0."""
    x = torch.tensor(ids, dtype=torch.long, device=device)
    with torch.inference_mode():
        _sync(torch, device)
        t0 = time.perf_counter()
        out = model(input_ids=x, use_cache=True, logits_to_keep=0 if keep_logits else 1)
        nxt = out.logits[:, -1, :].float().argmax(-1)
        _sync(torch, device)
        ttft = time.perf_counter() - t0
        prompt_logits = out.logits[0].float().cpu().numpy() if keep_logits else None
        past = out.past_key_values
        toks = [nxt]
        lat = []
        for _ in range(1, n_gen):
            t1 = time.perf_counter()
            out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1, :].float().argmax(-1)
            _sync(torch, device)
            lat.append(time.perf_counter() - t1)
            toks.append(nxt)
    tokens = torch.stack(toks, dim=1).cpu().tolist()
    return tokens, ttft, lat, prompt_logits


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    torch, model = _setup(cfg)
    dev = cfg["device"]
    res: dict[str, Any] = {"dtype": cfg["dtype"], "device": dev, "torch": torch.__version__,
                           "threads": torch.get_num_threads()}
    # warm-up: one short forward so the first timed call pays no one-time costs
    _greedy(torch, model, [cfg["perf"]["ids"][:8]], 2, dev)

    speed_only = cfg.get("mode") == "speed"  # a later timing round: no prompts, logits or scoring
    gens = []
    logits_rows = []
    for ids in ([] if speed_only else cfg["prompts"]):
        tokens, ttft, lat, pl = _greedy(torch, model, [ids], cfg["gen_tokens"], dev, keep_logits=True)
        gens.append({"tokens": tokens[0], "ttft_s": ttft, "token_latency_s": lat})
        logits_rows.append(pl)
    if not speed_only:
        np.save(cfg["logits_out"], np.concatenate(logits_rows, axis=0).astype(np.float32))
    res["gen"] = gens

    perf = cfg["perf"]
    x = torch.tensor([perf["ids"]], dtype=torch.long, device=dev)
    times = []
    with torch.inference_mode():
        for _ in range(perf["reps"]):
            _sync(torch, dev)
            t0 = time.perf_counter()
            model(input_ids=x, use_cache=True, logits_to_keep=1)
            _sync(torch, dev)
            times.append(time.perf_counter() - t0)
    res["prefill_seconds"] = times
    runs = []
    for _ in range(perf.get("rounds", 1)):
        tokens, ttft, lat, _ = _greedy(torch, model, [perf["ids"]], perf["n_gen"], dev)
        runs.append({"ttft_s": ttft, "token_latency_s": lat, "tokens": tokens[0]})
    res["perf_runs"] = runs

    conc = {}
    for c in cfg["concurrency"]:
        rows = cfg["c_prompts"][:c]
        samples = []
        for _ in range(perf.get("rounds", 1)):
            t0 = time.perf_counter()
            tokens, ttft, lat, _ = _greedy(torch, model, rows, perf["n_gen"], dev)
            total = time.perf_counter() - t0
            samples.append({"decode_tokens_per_second": c * len(lat) / sum(lat) if lat else None,
                            "prefill_tokens_per_second": c * len(rows[0]) / ttft,
                            "total_tokens_per_second": c * (len(rows[0]) + perf["n_gen"]) / total})
        conc[str(c)] = samples
    res["concurrency"] = conc

    res["vram_peak_bytes"] = int(torch.cuda.max_memory_allocated()) if dev.startswith("cuda") else None
    if speed_only:
        return res
    score = cfg["score"]
    ids, chunk = score["ids"], score["chunk"]
    nll, n, top1 = 0.0, 0, []
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            part = ids[start:start + chunk]
            if len(part) < 2:
                break
            lg = model(input_ids=torch.tensor([part], device=dev)).logits[0].float()
            lp = torch.log_softmax(lg[:-1].double(), dim=-1)
            tgt = torch.tensor(part[1:], device=dev)
            nll += float(-lp.gather(1, tgt[:, None]).sum())
            n += len(part) - 1
            top1 += lg[:-1].argmax(-1).cpu().tolist()
    res["score"] = {"nll_sum": nll, "n_scored": n, "top1": top1}
    return res


def child_main(module: str, run_fn: Callable[[dict[str, Any]], Any], argv: list[str] | None = None) -> int:
    """The entry of a measuring child process (``python -m MODULE CONFIG.json RESULT.json``): reads
    the config, runs offline, writes the result as JSON. Shared by the Transformers lanes."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(f"usage: python -m {module} CONFIG.json RESULT.json", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(run_fn(cfg)) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    return child_main("dgr.bench.hf_lane", run, argv)


if __name__ == "__main__":
    sys.exit(main())
