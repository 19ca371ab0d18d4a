"""One call for CLI commands: start local workers for a split and run the prompts
(:func:`run_local`, with optional parity, isolation and a stock llama.cpp yardstick), or run
sessions against workers that already run (:func:`generate_remote`)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import DgrError
from .llama_whole import WholeLlama
from .local import LocalRoute
from .parity import compare, isolation
from .report import RouteRun
from .sessions import RunReport, run_sessions


def whole_llama_baseline(model: Path | None, *, threads: int, n_prompt: int, n_gen: int,
                         sessions: tuple[int, ...], log: Callable[[str], None] | None = None,
                         backend: str = "cpu") -> tuple[WholeLlama | None, str | None]:
    """Stock whole-model llama.cpp figures (:func:`dgr.route.llama_whole.measure_whole_llama`), or
    ``(None, reason)`` when they cannot be had (no GGUF, tool missing and not buildable, the
    tool failed): a yardstick, never a reason for the caller to fail."""
    from . import llama_whole

    log = log or (lambda _m: None)
    if model is None:
        return None, "no GGUF model (fake-model workers)"
    log(f"whole-model llama.cpp: llama-batched-bench -npp {n_prompt} -ntg {n_gen} "
        f"-npl {','.join(str(b) for b in sorted(set(sessions)))} -t {threads} (stock llama.cpp at the pin, ~10-20 s)")
    try:
        res = llama_whole.measure_whole_llama(model, threads=threads, n_prompt=n_prompt, n_gen=n_gen,
                                              sessions=sessions, backend=backend)
    except Exception as exc:  # noqa: BLE001 - a failed yardstick is reported, not raised
        reason = (exc.one_line() if isinstance(exc, DgrError) else str(exc)) or type(exc).__name__
        log(f"llama.cpp baseline not measured: {reason}")
        return None, reason
    if not res.rows:
        reason = "llama-batched-bench printed no result rows"
        log(f"llama.cpp baseline not measured: {reason}")
        return None, reason
    return res, None


async def _sequential(endpoints: Sequence[str], prompts: Sequence[str], label: str, **kw: Any) -> RunReport:
    """Each prompt alone (one session at a time); one combined report."""
    reps = [await run_sessions(endpoints, [p], label=label, **kw) for p in prompts]
    out = RunReport(label, reps[0].route, [], sum(r.wall_s for r in reps), mode=reps[0].mode)
    for i, r in enumerate(reps):
        r.sessions[0].index = i
        out.sessions.append(r.sessions[0])
    return out


def run_local(model: Path | None, split: Sequence[tuple[int, int]], prompts: Sequence[str], *,
              max_tokens: int = 32, sampling: Any = None, parity: bool = False, fake: bool = False,
              slices: bool = False, threads: int | None = None, chat: bool = True,
              stop_on_eog: bool = True, on_text: Callable[[int, str], None] | None = None,
              log: Callable[[str], None] | None = None, chain: bool | None = None,
              llama_baseline: bool = False) -> RouteRun:
    """Start local workers for ``split`` and run the prompts concurrently. With ``parity``
    (greedy): also run each prompt alone on the route and on one whole-model worker (exact
    parity), check the concurrent sessions' isolation against their sequential runs, and run
    the prompts concurrently on the whole-model worker for the same figures. With
    ``llama_baseline``: afterwards (every worker stopped) measure stock whole-model llama.cpp
    (llama-batched-bench) at the mean prompt length, ``max_tokens``, 1 and len(prompts)
    sessions and the workers' thread count; a failure is recorded in ``llama_error``."""
    from .driver import Sampling

    log = log or (lambda _m: None)
    threads = threads or os.cpu_count() or 1
    n_layer = split[-1][1]
    max_sessions = max(4, len(prompts))
    greedy = sampling is None or getattr(sampling, "temperature", 0) <= 0
    if parity and greedy:
        sampling = Sampling(top_logprobs=5, ignore_eog=getattr(sampling, "ignore_eog", False))
    kw = dict(max_tokens=max_tokens, sampling=sampling, chat=chat, stop_on_eog=stop_on_eog, chain=chain)
    label = f"route {','.join(f'{a}:{b}' for a, b in split)}"
    seq = wseq = whole = par = iso = None
    with LocalRoute(model, split, fake=fake, slices=slices, threads=threads, max_sessions=max_sessions,
                    log=log) as lr:
        rep = asyncio.run(run_sessions(lr.endpoints, prompts, label=label, stats=lr.stats(),
                                       pids=[w.pid for w in lr.workers], on_text=on_text, **kw))
        if parity:
            log("the same prompts one at a time through the route")
            seq = asyncio.run(_sequential(lr.endpoints, prompts, label + " (sequential)", **kw))
    if parity:
        log(f"whole model [0:{n_layer}) on one worker")
        with LocalRoute(model, [(0, n_layer)], fake=fake, threads=threads, max_sessions=max_sessions, log=log) as lw:
            whole = asyncio.run(run_sessions(lw.endpoints, prompts, label=f"whole model 0:{n_layer}",
                                             stats=lw.stats(), pids=[w.pid for w in lw.workers], **kw))
            wseq = asyncio.run(_sequential(lw.endpoints, prompts, f"whole model 0:{n_layer} (sequential)", **kw))
        if greedy:
            par = compare(seq, wseq)
            iso = isolation(rep, seq)
    llama = llama_err = None
    if llama_baseline:  # after the route and whole-worker runs: never competes with them for cores
        n_prompt = round(sum(s.prompt_tokens for s in rep.sessions) / max(1, len(rep.sessions)))
        llama, llama_err = whole_llama_baseline(None if fake else model, threads=threads, n_prompt=n_prompt,
                                                n_gen=max_tokens, sessions=(1, len(prompts)), log=log)
    return RouteRun(rep, whole, par, list(split), str(model) if model else "fake", iso, seq, wseq,
                    llama=llama, llama_error=llama_err)


def generate_remote(endpoints: Sequence[str], prompts: Sequence[str], *, max_tokens: int = 32,
                    sampling: Any = None, chat: bool = True, stop_on_eog: bool = True,
                    on_text: Callable[[int, str], None] | None = None,
                    chain: bool | None = None) -> RunReport:
    """Sessions against already running workers (``dgr route generate --shard …``)."""
    from .driver import RouteError

    try:
        return asyncio.run(run_sessions(endpoints, prompts, max_tokens=max_tokens, sampling=sampling, chat=chat,
                                        stop_on_eog=stop_on_eog, on_text=on_text, chain=chain))
    except RouteError:
        raise
