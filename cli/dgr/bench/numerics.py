"""Are a (synthetic) model's activations finite over a long prompt?

Random weights can overflow where trained ones do not (a residual stream that grows layer by
layer, attention logits past f16's range). A model is "numerically sane" when whole-model
llama.cpp scores a prompt of ``n_tokens`` random token ids in one chunk and every scored
position's log-likelihood is finite: one NaN or infinity anywhere in a position's activations
reaches its logits and so its log-softmax. The pinned ``dgr-llama-probe`` does the scoring.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DgrError
from ..gguf.inspect import open_gguf
from .llama_lane import backend_for, probe_binary
from .llama_tools import CommandLog, run_measured


@dataclass(frozen=True)
class Numerics:
    model: str
    n_tokens: int
    n_scored: int
    nll_per_token: float
    finite: bool

    def to_json(self) -> dict:
        return {"model": self.model, "n_tokens": self.n_tokens, "n_scored": self.n_scored,
                "nll_per_token": self.nll_per_token if self.finite else None, "finite": self.finite}


def check_numerics(model: Path, *, n_tokens: int = 2048, threads: int = 2, seed: int = 0,
                   work: Path, device: str = "cpu") -> Numerics:
    """Score ``n_tokens`` seeded random ids in one chunk with whole-model llama.cpp."""
    with open_gguf(model) as gf:
        tokens = gf.get("tokenizer.ggml.tokens")
        n_vocab = len(tokens) if isinstance(tokens, list) else 0
    if n_vocab < 2:
        raise DgrError(f"{model.name}: no vocabulary to draw a prompt from")
    ids = np.random.default_rng(seed).integers(3, n_vocab, size=n_tokens).tolist()
    jobs = work / "numerics.jobs"
    jobs.write_text(f"score {n_tokens} {' '.join(map(str, ids))}\n")
    exe = probe_binary(backend_for(device))
    m = run_measured([exe, "-m", model, "-t", str(threads), "-c", str(n_tokens), "--jobs", jobs],
                     log=CommandLog())
    if m.returncode != 0:
        raise DgrError(f"dgr-llama-probe failed on {model.name} (exit {m.returncode}): {m.stderr.strip()[-300:]}")
    line = next((x for x in m.stdout.splitlines() if x.startswith("{")), "")
    try:
        row = json.loads(line)
        nll, n_scored = float(row["nll_sum"]), int(row["n_scored"])
    except (ValueError, KeyError, TypeError):
        # printf writes a NaN or infinite sum as "nan"/"inf", which is not JSON
        return Numerics(model.name, n_tokens, n_tokens - 1, math.nan, False)
    finite = math.isfinite(nll) and n_scored == n_tokens - 1
    return Numerics(model.name, n_tokens, n_scored, nll / max(n_scored, 1), finite)
