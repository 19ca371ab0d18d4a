"""Numeric drift of a route against a reference whole model (mixed-backend routes).

A route whose Shards run on different backends (a CPU head and a Vulkan tail, or the reverse)
does not reproduce the CPU whole model bit for bit: the kernels sum in another order. How far
it moves is measured here, one prompt at a time (no batching noise), over ``n_tokens`` generated
tokens per prompt, against a reference whole-model worker (CPU by default):

* **greedy agreement**: the route generates freely (greedy); the fraction of positions whose
  token equals the reference's greedy token, and where the first divergence is;
* **top-1 agreement**: teacher forcing (``RouteDriver.generate(forced_tokens=…)``, dgr.route.driver): the route is
  fed the reference's tokens, so each position has the same context on both; the fraction of
  positions whose top-1 token is the reference's;
* **max |Δ logprob|**: on that forced run, the largest difference between the route's and the
  reference's log-probability of the reference's token (inf when it falls out of the route's
  top-k); also the largest over every token in both top-k lists.

A certification (cli/dgr/gguf/recipes.toml, ``tolerance``) states the bounds a plan was measured
within; :meth:`DriftReport.violations` checks a report against them.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..errors import DgrError

_log = logging.getLogger(__name__)

TOP_K = 5


@dataclass
class PromptDrift:
    prompt: str
    prompt_tokens: int
    reference: list[int]
    greedy: list[int]                 # the route's free greedy tokens
    forced_top1: list[int]            # the route's top-1 at each position, fed the reference tokens
    first_divergence: int | None      # free greedy run vs reference (None: identical)
    greedy_agree: int
    top1_agree: int
    max_abs_dlogprob: float           # of the reference's token, forced run
    max_abs_dlogprob_topk: float      # over tokens in both top-k lists, forced run


@dataclass
class DriftReport:
    model: str
    split: list[str]
    backends: list[str]
    plan: str
    reference_backend: str
    n_tokens: int
    prompts: list[PromptDrift] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(len(p.reference) for p in self.prompts)

    @property
    def greedy_agreement(self) -> float:
        return sum(p.greedy_agree for p in self.prompts) / max(1, self.tokens)

    @property
    def top1_agreement(self) -> float:
        return sum(p.top1_agree for p in self.prompts) / max(1, self.tokens)

    @property
    def max_abs_dlogprob(self) -> float:
        return max((p.max_abs_dlogprob for p in self.prompts), default=0.0)

    @property
    def max_abs_dlogprob_topk(self) -> float:
        return max((p.max_abs_dlogprob_topk for p in self.prompts), default=0.0)

    def metrics(self) -> dict[str, float]:
        return {"tokens": self.tokens, "top1_agreement": self.top1_agreement,
                "greedy_agreement": self.greedy_agreement, "max_abs_dlogprob": self.max_abs_dlogprob,
                "max_abs_dlogprob_topk": self.max_abs_dlogprob_topk}

    def violations(self, tolerance: dict[str, float]) -> list[str]:
        """Each bound of ``tolerance`` this report breaks (keys: tokens, top1_agreement_min,
        greedy_agreement_min, max_abs_dlogprob); an unknown key is itself a violation."""
        m = self.metrics()
        out = []
        for key, bound in tolerance.items():
            if key == "tokens":
                ok = m["tokens"] >= bound
            elif key.endswith("_min") and key[:-4] in m:
                ok = m[key[:-4]] >= bound
            elif key in ("max_abs_dlogprob", "max_abs_dlogprob_topk"):
                ok = m[key] <= bound
            else:
                out.append(f"unknown tolerance {key}")
                continue
            if not ok:
                what = key[:-4] if key.endswith("_min") else key
                out.append(f"{what} = {m[what]:.4g} breaks the tolerance {key} = {bound:g}")
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(self.metrics())
        for k in ("max_abs_dlogprob", "max_abs_dlogprob_topk"):
            d[k] = _finite(d[k])
        for p in d["prompts"]:
            for k in ("max_abs_dlogprob", "max_abs_dlogprob_topk"):
                p[k] = _finite(p[k])
        return d


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else "inf"


def compare_prompt(prompt: str, n_prompt: int, ref: tuple[list[int], list[list[tuple[int, float]]]],
                   greedy: list[int], forced: tuple[list[int], list[list[tuple[int, float]]]]) -> PromptDrift:
    """One prompt's drift from the reference's greedy tokens + top-k, the route's free greedy
    tokens and its forced run (top-1 tokens + top-k)."""
    ref_toks, ref_top = ref
    f_toks, f_top = forced
    n = len(ref_toks)
    div = next((i for i in range(min(n, len(greedy))) if greedy[i] != ref_toks[i]), None)
    if div is None and len(greedy) != n:
        div = min(n, len(greedy))
    g_agree = sum(1 for a, b in zip(greedy, ref_toks) if a == b)
    t_agree = sum(1 for a, b in zip(f_toks, ref_toks) if a == b)
    worst = worst_k = 0.0
    for i in range(n):
        rt = dict(ref_top[i]) if i < len(ref_top) else {}
        ft = dict(f_top[i]) if i < len(f_top) else {}
        tok = ref_toks[i]
        if tok in rt and tok in ft:
            worst = max(worst, abs(rt[tok] - ft[tok]))
        else:
            worst = math.inf
        for t in set(rt) & set(ft):
            worst_k = max(worst_k, abs(rt[t] - ft[t]))
    if len(f_toks) < n:
        worst = math.inf
    return PromptDrift(prompt, n_prompt, list(ref_toks), list(greedy), list(f_toks), div, g_agree, t_agree,
                       worst, worst_k)


async def _runs(endpoints: Sequence[str], token_prompts: Sequence[Sequence[int]], n_tokens: int,
                forced: Sequence[Sequence[int]] | None = None) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    from .driver import RouteDriver, Sampling

    driver = await RouteDriver(list(endpoints), chain=False).connect()
    try:
        out = []
        for i, toks in enumerate(token_prompts):
            r = await driver.generate(list(toks), max_tokens=n_tokens, stop_on_eog=False,
                                      sampling=Sampling(top_logprobs=TOP_K, ignore_eog=True),
                                      forced_tokens=forced[i] if forced is not None else None)
            if r.error is not None:
                raise DgrError(f"route {','.join(endpoints)}: {r.error}")
            out.append((list(r.tokens), [list(x) for x in r.top_logprobs]))
        return out
    finally:
        await driver.close()


async def _tokenize(endpoints: Sequence[str], prompts: Sequence[str], chat: bool) -> list[list[int]]:
    from .driver import RouteDriver
    from .sessions import prompt_tokens

    driver = await RouteDriver(list(endpoints), chain=False).connect()
    try:
        return await prompt_tokens(driver, prompts, chat=chat)
    finally:
        await driver.close()


def measure(model: Path, split: Sequence[tuple[int, int]], backends: Sequence[str], prompts: Sequence[str], *,
            n_tokens: int = 64, reference_backend: str = "cpu", threads: int | None = None, chat: bool = True,
            ) -> DriftReport:
    """Run the reference whole model, then the route (free greedy and forced), one prompt at a
    time; every worker is local and stopped afterwards."""
    import os
    import time

    from ..gguf.recipe import backend_plan
    from .local import LocalRoute

    if n_tokens < 1:
        raise DgrError("the drift needs at least one generated token per prompt")
    threads = threads or os.cpu_count() or 1
    n_layer = split[-1][1]
    t0 = time.perf_counter()
    _log.info(f"reference: whole model [0:{n_layer}) on {reference_backend}, {len(prompts)} prompt(s) x {n_tokens} tokens")
    with LocalRoute(model, [(0, n_layer)], threads=threads, backend=reference_backend) as lw:
        toks = asyncio.run(_tokenize(lw.endpoints, prompts, chat))
        ref = asyncio.run(_runs(lw.endpoints, toks, n_tokens))
    plan = backend_plan(list(backends))
    _log.info(f"route {','.join(f'{a}:{b}' for a, b in split)} on {','.join(backends)} (plan {plan}): greedy, then "
        "teacher-forced on the reference tokens")
    with LocalRoute(model, split, threads=threads, backend=list(backends)) as lr:
        greedy = asyncio.run(_runs(lr.endpoints, toks, n_tokens))
        forced = asyncio.run(_runs(lr.endpoints, toks, n_tokens, forced=[r[0] for r in ref]))
    rep = DriftReport(str(model), [f"{a}:{b}" for a, b in split], list(backends), plan, reference_backend, n_tokens)
    for p, t, r, g, f in zip(prompts, toks, ref, greedy, forced):
        rep.prompts.append(compare_prompt(p, len(t), r, g[0], f))
    rep.wall_s = time.perf_counter() - t0
    return rep


def summary(rep: DriftReport) -> str:
    lines = [f"route {','.join(rep.split)} on {','.join(rep.backends)} (plan {rep.plan}) vs whole model on "
             f"{rep.reference_backend}: {len(rep.prompts)} prompt(s), {rep.tokens} tokens"]
    lines.append(f"  top-1 agreement (teacher-forced): {rep.top1_agreement:.4f}")
    lines.append(f"  greedy agreement (free run):      {rep.greedy_agreement:.4f}  first divergence per prompt: "
                 + ", ".join("none" if p.first_divergence is None else str(p.first_divergence) for p in rep.prompts))
    lines.append(f"  max |d logprob| of the reference token: {rep.max_abs_dlogprob:.4g} nats "
                 f"(over shared top-{TOP_K}: {rep.max_abs_dlogprob_topk:.4g})")
    return "\n".join(lines)
