"""One call for CLI commands: start local workers for a split and run the prompts
(:func:`run_local`, with optional parity, isolation and a stock llama.cpp yardstick), or run
sessions against workers that already run (:func:`generate_remote`)."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import DgrError
from .llama_whole import WholeLlama
from .local import LocalRoute
from .parity import compare, isolation
from .report import RouteRun
from .sessions import RunReport, run_sessions

log = logging.getLogger(__name__)


def whole_llama_baseline(model: Path | None, *, threads: int, prompts: Sequence[str], max_tokens: int,
                         sessions: tuple[int, ...],
                         backend: str = "cpu") -> tuple[WholeLlama | None, str | None]:
    """Stock whole-model llama.cpp figures: llama-server at the pin serving the same prompts
    (:func:`dgr.route.llama_whole.measure_whole_llama_server`), or ``(None, reason)`` when they
    cannot be had (no GGUF, tool missing and not buildable, the server failed): a yardstick,
    never a reason for the caller to fail."""
    from . import llama_whole

    if model is None:
        return None, "no GGUF model (fake-model workers)"
    log.info(f"whole-model llama.cpp: llama-server -np {max(sessions)} -t {threads}, the same {len(prompts)} chat "
        f"prompts, {max_tokens} tokens at most, 1 then {max(sessions)} at once (stock llama.cpp at the pin)")
    try:
        res = llama_whole.measure_whole_llama_server(model, threads=threads, prompts=list(prompts),
                                                     max_tokens=max_tokens, sessions=sessions, backend=backend)
    except Exception as exc:  # noqa: BLE001 - a failed yardstick is reported, not raised
        reason = (exc.one_line() if isinstance(exc, DgrError) else str(exc)) or type(exc).__name__
        log.warning(f"llama.cpp baseline not measured: {reason}")
        return None, reason
    if not res.rows:
        reason = "llama-server answered no request"
        log.warning(f"llama.cpp baseline not measured: {reason}")
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
              chain: bool | None = None,
              llama_baseline: bool = False, backends: Sequence[str] | None = None,
              whole_backend: str | None = None) -> RouteRun:
    """Start local workers for ``split`` and run the prompts concurrently. With ``parity``
    (greedy): also run each prompt alone on the route and on one whole-model worker (exact
    parity), check the concurrent sessions' isolation against their sequential runs, and run
    the prompts concurrently on the whole-model worker for the same figures. With
    ``llama_baseline``: afterwards (every worker stopped) measure stock whole-model llama.cpp
    (llama-server serving the same prompts, ``max_tokens``, 1 and len(prompts) sessions, the
    workers' thread count); a failure is recorded in ``llama_error``. ``backends``: one per
    Shard (default all cpu); ``whole_backend``: the whole-model worker's (default: the route's
    backend when it has one, else cpu)."""
    from .driver import Sampling

    threads = threads or os.cpu_count() or 1
    n_layer = split[-1][1]
    max_sessions = max(4, len(prompts))
    greedy = sampling is None or getattr(sampling, "temperature", 0) <= 0
    if parity and greedy:
        sampling = Sampling(top_logprobs=5, ignore_eog=getattr(sampling, "ignore_eog", False))
    kw = dict(max_tokens=max_tokens, sampling=sampling, chat=chat, stop_on_eog=stop_on_eog, chain=chain)
    label = f"route {','.join(f'{a}:{b}' for a, b in split)}"
    seq = wseq = whole = par = iso = None
    backends = list(backends or ["cpu"] * len(split))
    whole_backend = whole_backend or (backends[0] if len(set(backends)) == 1 else "cpu")
    with LocalRoute(model, split, fake=fake, slices=slices, threads=threads, max_sessions=max_sessions,
                    backend=backends) as lr:
        rep = asyncio.run(run_sessions(lr.endpoints, prompts, label=label, stats=lr.stats(),
                                       pids=[w.pid for w in lr.workers], on_text=on_text, **kw))
        if parity:
            log.info("the same prompts one at a time through the route")
            seq = asyncio.run(_sequential(lr.endpoints, prompts, label + " (sequential)", **kw))
    if parity:
        log.info(f"whole model [0:{n_layer}) on one {whole_backend} worker")
        with LocalRoute(model, [(0, n_layer)], fake=fake, threads=threads, max_sessions=max_sessions,
                        backend=whole_backend) as lw:
            whole = asyncio.run(run_sessions(lw.endpoints, prompts, label=f"whole model 0:{n_layer}",
                                             stats=lw.stats(), pids=[w.pid for w in lw.workers], **kw))
            wseq = asyncio.run(_sequential(lw.endpoints, prompts, f"whole model 0:{n_layer} (sequential)", **kw))
        if greedy:
            par = compare(seq, wseq)
            iso = isolation(rep, seq)
    llama = llama_err = None
    if llama_baseline:  # after the route and whole-worker runs: never competes with them for cores
        llama, llama_err = whole_llama_baseline(None if fake else model, threads=threads, prompts=prompts,
                                                max_tokens=max_tokens, sessions=(1, len(prompts)))
    return RouteRun(rep, whole, par, list(split), str(model) if model else "fake", iso, seq, wseq,
                    llama=llama, llama_error=llama_err, backends=backends, whole_backend=whole_backend)


def generate_remote(endpoints: Sequence[str], prompts: Sequence[str], *, max_tokens: int = 32,
                    sampling: Any = None, chat: bool = True, stop_on_eog: bool = True,
                    on_text: Callable[[int, str], None] | None = None,
                    chain: bool | None = None, tls: Any = None, standby: Sequence[str] = (),
                    max_restarts: int = 2, hops: Sequence[str] | None = None) -> RunReport:
    """Sessions against already running workers (``dgr route generate --shard …``); ``standby``:
    workers a session fails over to (docs/failover.md); ``hops``: per shard, the relay egress its
    predecessor dials ("" direct; :class:`~dgr.route.driver.RouteDriver`)."""
    from .driver import RouteError

    try:
        return asyncio.run(run_sessions(endpoints, prompts, max_tokens=max_tokens, sampling=sampling, chat=chat,
                                        stop_on_eog=stop_on_eog, on_text=on_text, chain=chain, tls=tls,
                                        standby=standby, max_restarts=max_restarts, hops=hops))
    except RouteError:
        raise
