"""`dgr drill`: run a route under N sessions, inject one fault, measure the recovery.

The drill starts a route (one worker per range) and a standby worker per range, runs the
sessions once uninterrupted (the reference answers, greedy), then again through a
:class:`~dgr.route.failover.FailoverRouter` and, once every session has delivered
``after_tokens`` tokens, injects one fault into one shard or the link into it:

| fault | what is done | expected |
|---|---|---|
| ``kill`` | ``SIGKILL`` to the shard's process | detected <= 1 s, sessions restart on the standby |
| ``stop`` | ``SIGSTOP`` (``SIGCONT`` at the end, always) | silent: detected <= 3 s (keepalive), restart |
| ``term`` | ``SIGTERM``: the worker drains (``--drain-timeout-s``, 1 s here) and exits | restart once it ends the sessions |
| ``blackhole`` | the link proxy into the shard stops delivering (lifted at the end) | silent: detected <= 3 s, restart |
| ``latency`` | the link proxy adds ``latency_ms`` one way for ``hold_s`` | no failover below the keepalive timeout (1 s) |
| ``loss`` | each chunk through the proxy costs one 200 ms retransmission timeout with probability ``loss``, for ``hold_s`` | no failover |

Every worker of the route sits behind its own userspace link proxy (:mod:`dgr.lab.proxy`, run on
a thread of this process) when the fault is a link fault, so both the driver -> head hop and the
worker -> worker hops cross it; the proxy works on loopback, no namespace needed.

It reports (JSON, schema ``dgr.drill/1``): time to detect (fault -> the session sees the failure),
time to the first token on the new route, tokens lost and duplicated against the reference
(each session's delivered tokens vs the uninterrupted answer), sessions recovered, the work
records, and per surviving worker what it still holds after the drill (sessions, KV cells,
queued steps, read from ``GetMetrics``; polled for up to ``drain_wait_s`` while the releases land).

Placement: ``synthetic`` (fake-model workers, local processes: CI), a GGUF on local processes
(``model``), or the hosts of a running lab (``lab``: see docs/multi-host.md). Every wait is
bounded; the drill ends only the processes it started.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import DgrError
from .faults import LabLinks, LinkProxies, signal_worker as _signal

_log = logging.getLogger(__name__)

SCHEMA = "dgr.drill/1"
FAULTS = ("kill", "stop", "term", "blackhole", "latency", "loss")
PROCESS_FAULTS = ("kill", "stop", "term")
LINK_FAULTS = ("blackhole", "latency", "loss")
SYNTH_PROMPTS = [[256, *b"hello world"], [256, *b"route sessions are isolated"], [256, *b"x"],
                 [256, *b"a longer prompt for the drill"], [256, *b"failover"], [256, *b"standby shard"],
                 [256, *b"restart from token zero"], [256, *b"no duplicated tokens"]]
TEXT_PROMPTS = ["Why is the sky blue?", "Write a haiku about the sea.", "List three prime numbers.",
                "What is a GGUF file?", "Explain failover in one sentence.", "Name a river in Europe.",
                "What does a compiler do?", "Describe a cat."]


@dataclass
class DrillConfig:
    fault: str
    target: str = "tail"              # head | tail | shard index (0-based)
    sessions: int = 8
    max_tokens: int = 0               # 0: 160 synthetic, 48 with a model
    after_tokens: int = 8
    split: Sequence[tuple[int, int]] = ((0, 4), (4, 8))
    model: Path | None = None         # None: synthetic (fake-model workers)
    lab: str | None = None            # run the workers on this lab's hosts
    latency_ms: float = 300.0
    loss: float = 0.3
    hold_s: float = 2.0
    max_restarts: int = 2
    fake_delay_ms: int = 5
    threads: int | None = None
    drain_wait_s: float = 10.0
    timeout_s: float = 180.0

    def validate(self) -> None:
        if self.fault not in FAULTS:
            raise DgrError(f"unknown fault {self.fault!r}; one of {', '.join(FAULTS)}")
        if not 1 <= self.sessions <= 64:
            raise DgrError(f"--sessions must be in 1..64, got {self.sessions}")
        if self.after_tokens < 1:
            raise DgrError("--after-tokens must be >= 1")
        if self.latency_ms < 0 or not 0 <= self.loss < 1 or self.hold_s <= 0:
            raise DgrError("--latency-ms >= 0, --loss in [0, 1) and --hold-s > 0")
        if self.model is not None and not Path(self.model).is_file():
            raise DgrError(f"model file not found: {self.model}")
        self.shard_index()

    def shard_index(self) -> int:
        n = len(self.split)
        t = self.target
        i = 0 if t == "head" else n - 1 if t == "tail" else int(t) if t.isdigit() else -1
        if not 0 <= i < n:
            raise DgrError(f"--target must be head, tail or a shard index 0..{n - 1}, got {t!r}")
        return i

    @property
    def tokens(self) -> int:
        return self.max_tokens or (160 if self.model is None else 48)


# ---- workers ------------------------------------------------------------------------------------

@dataclass
class DrillWorker:
    role: str                 # primary | standby
    range: tuple[int, int]
    proc: Any                 # WorkerProcess
    target: str               # the worker's own address
    endpoint: str             # what the route dials (the proxy's, for link faults)
    faulted: bool = False

    @property
    def name(self) -> str:
        return f"{self.role}[{self.range[0]}:{self.range[1]})@{self.endpoint}"


class Placement:
    """Starts the primary and standby workers (local or on lab hosts) and stops them."""

    def __init__(self, cfg: DrillConfig, proxies: LinkProxies | None) -> None:
        self.cfg, self.proxies = cfg, proxies
        self.workers: list[DrillWorker] = []
        self.tls = None
        self._lab_routes: list[Any] = []

    def start(self) -> None:
        if self.cfg.lab:
            self._start_lab()
        else:
            self._start_local()

    def _worker_args(self, a: int, b: int, recipe) -> Any:
        from ..route.supervisor import WorkerArgs

        n_layer = self.cfg.split[-1][1]
        common = dict(layers=(a, b), max_sessions=max(8, self.cfg.sessions), drain_timeout_s=1.0)
        if self.cfg.model is None:
            return WorkerArgs(fake_model=True, n_layer=n_layer, fake_delay_ms=self.cfg.fake_delay_ms or None, **common)
        return WorkerArgs(model=self.cfg.model, fingerprint=recipe.fingerprint(), artifact_id=recipe.artifact_id,
                          threads=self.cfg.threads, ctx_per_session=1024, **common)

    def _start_local(self) -> None:
        from ..route.local import ensure_worker
        from ..route.supervisor import WorkerProcess

        binary = ensure_worker()
        recipe = None
        if self.cfg.model is not None:
            from ..gguf.recipe import recipe_for
            recipe = recipe_for(self.cfg.model, progress=False)
        for role in ("primary", "standby"):
            for a, b in self.cfg.split:
                w = WorkerProcess.start(self._worker_args(a, b, recipe), binary=binary, ready_timeout=120)
                ep = w.target
                if role == "primary" and self.proxies is not None:
                    ep = self.proxies.add(w.target)
                self.workers.append(DrillWorker(role, (a, b), w, w.target, ep))
                _log.info("%s worker [%s:%s) pid %s at %s%s", role, a, b, w.pid, w.target,
                          f" via proxy {ep}" if ep != w.target else "")

    def _start_lab(self) -> None:
        from .hosts import Lab
        from .route import LabRoute

        lab = Lab.load(self.cfg.lab)
        hosts = [h.name for h in lab.hosts]
        n = len(self.cfg.split)
        # primary shard i on host i, its standby on the next host (another host serving the range)
        plans = {"primary": [hosts[i % len(hosts)] for i in range(n)],
                 "standby": [hosts[(i + 1) % len(hosts)] for i in range(n)]}
        extra = ["--drain-timeout-s", "1"] + (["--fake-delay-ms", str(self.cfg.fake_delay_ms)]
                                              if self.cfg.model is None and self.cfg.fake_delay_ms else [])
        for role, placement in plans.items():
            lr = LabRoute(lab, self.cfg.model, list(self.cfg.split), placement=placement, slices=self.cfg.model is not None,
                          max_sessions=max(8, self.cfg.sessions), ctx_per_session=1024, extra_args=extra,
                          fake=self.cfg.model is None)
            self._lab_routes.append(lr)
            lr.start()
            self.tls = lr.tls
            for p in lr.placed:
                self.workers.append(DrillWorker(role, p.range, p.worker, p.direct, p.endpoint))
        self.lab = lab

    def primary(self) -> list[DrillWorker]:
        return [w for w in self.workers if w.role == "primary"]

    def standby(self) -> list[DrillWorker]:
        return [w for w in self.workers if w.role == "standby"]

    def stop(self) -> None:
        for w in self.workers:
            _signal(w.proc, signal.SIGCONT)     # never leave a stopped process behind
        for lr in self._lab_routes:
            lr.stop()
        if self._lab_routes:
            # the lab's link proxies in front of these workers go with them
            self.lab.unexpose({w.target for w in self.workers})
        else:
            for w in self.workers:
                try:
                    w.proc.terminate(10)
                except Exception:   # noqa: BLE001
                    w.proc.kill()


# ---- the drill ----------------------------------------------------------------------------------

@dataclass
class SessionOutcome:
    index: int
    status: str
    restarts: int
    delivered: int
    reference: int
    equal: bool
    lost: int
    duplicated: int
    mismatched: int
    detect_s: float | None
    first_new_token_s: float | None
    error: str | None
    record: dict = field(default_factory=dict)


def compare(ref: Sequence[int], got: Sequence[int]) -> tuple[int, int, int]:
    """(lost, duplicated, mismatched) of ``got`` against the reference answer ``ref``.

    A duplicated token is one delivered twice in a row where the reference has it once at that
    place (a replayed token); lost is the reference's tokens missing at the end; mismatched
    counts positions that differ otherwise."""
    dup = 0
    i = j = 0
    mism = 0
    while i < len(ref) and j < len(got):
        if ref[i] == got[j]:
            i += 1
            j += 1
        elif j > 0 and got[j] == got[j - 1]:
            dup += 1
            j += 1
        else:
            mism += 1
            i += 1
            j += 1
    dup += len(got) - j
    return len(ref) - i, dup, mism


async def _load(ep: str, tls) -> dict[str, Any]:
    from ..protocol.client import AsyncWorkerClient

    c = AsyncWorkerClient(ep, timeout=2.0, credentials=tls.grpc_credentials() if tls else None)
    try:
        m = await c.metrics()
        ld = m.load
        return {"sessions": ld.active_sessions, "kv_cells_used": ld.kv_cells_used, "queued_steps": ld.queued_steps}
    except Exception as exc:   # noqa: BLE001
        return {"error": str(exc).splitlines()[0][:200]}
    finally:
        await c.close()


async def _drained(ep: str, tls, wait_s: float) -> dict[str, Any]:
    """The worker's load once idle (polled up to ``wait_s``) with the time it took."""
    t0 = time.monotonic()
    while True:
        ld = await _load(ep, tls)
        idle = "error" not in ld and not (ld["sessions"] or ld["kv_cells_used"] or ld["queued_steps"])
        if idle or time.monotonic() - t0 > wait_s:
            return {**ld, "idle": idle, "waited_s": round(time.monotonic() - t0, 3)}
        await asyncio.sleep(0.1)


async def _drill(cfg: DrillConfig, pl: Placement, proxies: LinkProxies | None) -> dict[str, Any]:
    from ..route.driver import RouteDriver
    from ..route.failover import FailoverRouter, PoolRouteFinder
    from ..route.work_records import summarize

    prim, stby = pl.primary(), pl.standby()
    route = [w.endpoint for w in prim]
    n = cfg.tokens
    # prompts (text prompts through the head's tokenizer with a model)
    ref_d = await RouteDriver(route, tls=pl.tls).connect()
    try:
        if cfg.model is None:
            prompts = [SYNTH_PROMPTS[i % len(SYNTH_PROMPTS)] for i in range(cfg.sessions)]
        else:
            prompts = [await ref_d.tokenize(TEXT_PROMPTS[i % len(TEXT_PROMPTS)]) for i in range(cfg.sessions)]
        _log.info("reference: %s sessions x %s tokens, uninterrupted, on the route", cfg.sessions, n)
        t_ref = time.monotonic()
        ref = await asyncio.wait_for(asyncio.gather(*(ref_d.generate(p, max_tokens=n, stop_on_eog=False)
                                                      for p in prompts)), cfg.timeout_s)
        ref_s = time.monotonic() - t_ref
    finally:
        await ref_d.close()
    if any(r.error for r in ref):
        raise DgrError(f"the reference run failed: {next(r.error for r in ref if r.error)}")

    events: list[dict[str, Any]] = []
    t_origin = time.monotonic()

    def on_event(kind: str, d: dict) -> None:
        events.append({"t_s": round(time.monotonic() - t_origin, 4), "event": kind, **d})

    fr = await FailoverRouter(route, max_restarts=cfg.max_restarts, tls=pl.tls, on_event=on_event).connect()
    head_cap = fr.route.head.capability.identity
    fr.finder = PoolRouteFinder(route + [w.endpoint for w in stby], fingerprint=head_cap.compatibility_fingerprint,
                                artifact_id=head_cap.artifact_id, tls=pl.tls)
    victim = prim[cfg.shard_index()]
    counts = [0] * cfg.sessions
    ready = asyncio.Event()

    def counter(i: int) -> Callable[[int], None]:
        def f(_t: int) -> None:
            counts[i] += 1
            if min(counts) >= cfg.after_tokens:
                ready.set()
        return f

    tasks = [asyncio.create_task(fr.generate(p, max_tokens=n, stop_on_eog=False, session_id=f"drill-{i}",
                                             on_token=counter(i))) for i, p in enumerate(prompts)]
    fault: dict[str, Any] = {"kind": cfg.fault, "target": victim.name, "shard_range": list(victim.range)}
    lifted = False
    try:
        try:
            await asyncio.wait_for(ready.wait(), min(60.0, cfg.timeout_s))
        except TimeoutError:
            raise DgrError(f"the sessions did not reach {cfg.after_tokens} tokens each within 60 s") from None
        fault["injected_after_tokens"] = list(counts)
        t_fault = time.monotonic()
        fault["t_s"] = round(t_fault - t_origin, 4)
        _log.info("fault: %s on %s", cfg.fault, victim.name)
        if cfg.fault in PROCESS_FAULTS:
            sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}[cfg.fault]
            if not _signal(victim.proc, sig):
                raise DgrError(f"the victim {victim.name} was not running")
            victim.faulted = True
        else:
            assert proxies is not None
            victim.faulted = cfg.fault == "blackhole"
            proxies.set(victim.endpoint, blackhole=True if cfg.fault == "blackhole" else None,
                        delay_ms=cfg.latency_ms if cfg.fault == "latency" else None,
                        loss=cfg.loss if cfg.fault == "loss" else None)
            if cfg.fault in ("latency", "loss"):
                async def lift() -> None:
                    await asyncio.sleep(cfg.hold_s)
                    proxies.set(victim.endpoint, delay_ms=0.0, loss=0.0)
                    on_event("fault_lifted", {"after_s": cfg.hold_s})
                asyncio.get_running_loop().create_task(lift())
        res = await asyncio.wait_for(asyncio.gather(*tasks), cfg.timeout_s)
        run_s = time.monotonic() - t_origin
    finally:
        for t in tasks:
            t.cancel()
        # lift what stays until the end: the stopped process, the blackhole
        if cfg.fault == "stop":
            lifted = _signal(victim.proc, signal.SIGCONT)
        if cfg.fault == "blackhole" and proxies is not None:
            proxies.set(victim.endpoint, blackhole=False)
            lifted = True
        await fr.close()
    fault["lifted_at_end"] = lifted

    outcomes = []
    for i, (r, f) in enumerate(zip(ref, res)):
        lost, dup, mism = compare(r.tokens, f.tokens)
        outcomes.append(SessionOutcome(
            i, f.record.status, f.record.restarts, len(f.tokens), len(r.tokens), f.tokens == r.tokens, lost, dup, mism,
            None if f.failure_at is None else round(f.failure_at - t_fault, 4),
            None if f.first_new_token_at is None else round(f.first_new_token_at - t_fault, 4),
            None if f.error is None else str(f.error), f.record.to_json()))
    # what every worker still holds (the stopped victim was resumed above; a killed one is gone)
    survivors = []
    for w in pl.workers:
        if w is victim and cfg.fault in ("kill", "term") and w.proc.proc.poll() is not None:
            survivors.append({"worker": w.name, "state": "ended", "exit_code": w.proc.proc.returncode})
            continue
        if w is victim and cfg.fault == "term":
            try:
                w.proc.proc.wait(5)
                survivors.append({"worker": w.name, "state": "ended", "exit_code": w.proc.proc.returncode})
                continue
            except Exception:   # noqa: BLE001
                pass
        st = await _drained(w.target, pl.tls, cfg.drain_wait_s)
        state = "alive" if w is not victim else {"stop": "resumed", "blackhole": "link restored"}.get(cfg.fault, "alive")
        survivors.append({"worker": w.name, "state": state, **st})

    detect = [o.detect_s for o in outcomes if o.detect_s is not None]
    first_new = [o.first_new_token_s for o in outcomes if o.first_new_token_s is not None]
    ttft_new = [a["ttft_s"] for o in outcomes for a in o.record["attempts"][1:]]
    # first new token minus the new route's re-prefill time: detection + forming the route
    overhead = [o.first_new_token_s - o.record["attempts"][1]["ttft_s"] for o in outcomes
                if o.first_new_token_s is not None and len(o.record["attempts"]) > 1]
    summary = {
        "sessions": cfg.sessions,
        "sessions_failed_over": sum(1 for o in outcomes if o.restarts),
        "sessions_recovered": sum(1 for o in outcomes if o.restarts and o.status == "completed"),
        "sessions_completed": sum(1 for o in outcomes if o.status == "completed"),
        "sessions_failed": sum(1 for o in outcomes if o.status != "completed"),
        "answers_equal_reference": sum(1 for o in outcomes if o.equal),
        "tokens_lost": sum(o.lost for o in outcomes),
        "tokens_duplicated": sum(o.duplicated for o in outcomes),
        "tokens_mismatched": sum(o.mismatched for o in outcomes),
        "time_to_detect_s": {"min": min(detect), "max": max(detect)} if detect else None,
        "time_to_first_new_token_s": {"min": min(first_new), "max": max(first_new)} if first_new else None,
        "reprefill_ttft_s": {"min": min(ttft_new), "max": max(ttft_new)} if ttft_new else None,
        "first_new_token_minus_reprefill_s": {"min": round(min(overhead), 4), "max": round(max(overhead), 4)}
        if overhead else None,
        "survivors_holding": [s["worker"] for s in survivors
                              if s.get("state") != "ended" and not s.get("idle", False)],
        "routes": fr.routes,
        "reference_run_s": round(ref_s, 3),
        "faulted_run_s": round(run_s, 3),
    }
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "mode": "synthetic" if cfg.model is None else "model",
        "placement": f"lab:{cfg.lab}" if cfg.lab else "local",
        "model": str(cfg.model) if cfg.model else None,
        "split": [f"{a}:{b}" for a, b in cfg.split],
        "max_tokens": n,
        "fault": fault,
        "config": {"latency_ms": cfg.latency_ms, "loss": cfg.loss, "hold_s": cfg.hold_s,
                   "max_restarts": cfg.max_restarts, "after_tokens": cfg.after_tokens,
                   "fake_delay_ms": cfg.fake_delay_ms if cfg.model is None else None},
        "summary": summary,
        "work": summarize([_record(o.record) for o in outcomes]),
        "survivors": survivors,
        "sessions": [o.__dict__ for o in outcomes],
        "events": events,
    }
    if proxies is not None:
        doc["links"] = {w.endpoint: proxies.counters(w.endpoint) for w in prim if w.endpoint in proxies.links}
    return doc


def _record(d: dict) -> Any:
    from ..route.work_records import AttemptRecord, SessionWorkRecord, ShardWork

    atts = [AttemptRecord(**{**a, "shards": [ShardWork(**s) for s in a["shards"]]}) for a in d["attempts"]]
    return SessionWorkRecord(**{**d, "attempts": atts})


def run_drill(cfg: DrillConfig) -> dict[str, Any]:
    """Runs one drill (see the module docstring) and returns its JSON document; its progress
    (workers started, the reference run, the fault) goes to this module's logger at INFO."""
    cfg.validate()
    if cfg.fault in LINK_FAULTS and cfg.model is None and cfg.fake_delay_ms < 1:
        raise DgrError("a synthetic link drill needs --fake-delay-ms >= 1 (the sessions must still run)")
    proxies: Any = None
    if cfg.fault in LINK_FAULTS:
        if cfg.lab:
            from .hosts import Lab
            proxies = LabLinks(Lab.load(cfg.lab))
        else:
            proxies = LinkProxies()
    pl = Placement(cfg, None if cfg.lab else proxies)
    try:
        pl.start()
        if cfg.lab and proxies is not None:
            proxies = LabLinks(pl.lab)      # the lab as the placement left it (its proxies listed)
        return asyncio.run(_drill(cfg, pl, proxies))
    finally:
        pl.stop()
        if proxies is not None:
            proxies.close()
