"""`dgr drill --soak MINUTES`: a bounded chaos soak through the gateway.

Over 500 lines on purpose, for now: the soak's load, fault chooser and invariant checks share its
state; the chooser and the checks could move out once they settle.

The one-fault drill (:mod:`dgr.lab.drill`) measures a single recovery on the route driver. The
soak runs `dgr serve`'s gateway (:class:`~dgr.serve.server.Gateway`, in this process) over a
2-shard route with standby workers, keeps ``concurrency`` streaming OpenAI-API requests running
through it over HTTP for MINUTES, and injects a random action every ``fault_every_s`` (±50 %,
seeded):

| action | what is done | lifted |
|---|---|---|
| ``kill`` | ``SIGKILL`` to one worker | the worker is gone; ``restart`` replaces it |
| ``stop`` | ``SIGSTOP`` | ``SIGCONT`` after ``hold_s`` (±50 %), always before the end |
| ``term`` | ``SIGTERM``: the worker drains 1 s and exits | ``restart`` replaces it |
| ``blackhole`` | the link proxy in front of the worker stops delivering | after ``hold_s`` (±50 %) |
| ``restart`` | a new worker process for a range short of ``workers_per_range`` | added to the gateway's standby pool |

Rules: a fault only hits a worker whose range keeps another usable worker (alive, not faulted,
not excluded by the gateway's failover), so a request never fails because the soak took a
whole range down. A worker that was stopped or blackholed gets a settling time once resumed
(``SETTLE_S``, above the 3 s detection bound); if the gateway excluded it meanwhile, it is
retired: what it still holds is read (``GetMetrics``: sessions, KV cells, queued steps, polled
while the releases land) and it is ended. A worker the gateway excluded without a fault is
reported (``collateral_exclusions``) and retired the same way.

Invariants checked at the end (each breach is a line in ``violations``; exit 1 when any):

- every request completed: HTTP 200, no error event, ``finish_reason`` ``length``, usage
  ``completion_tokens`` == ``max_tokens`` (``ignore_eos``: every answer runs to its budget);
- every streamed answer equals the reference for its prompt (greedy; computed once up front on
  the clean route through the gateway): the same text, delta by delta, none lost or repeated;
- every surviving worker (and every retired one, when it was retired) holds 0 sessions, 0 KV
  cells and 0 queued steps;
- the gateway's ``dgr_gateway_in_flight_requests`` is back to 0;
- every process the soak started has ended (SIGCONT first), and no lab proxy of it is left.

Also reported: each fault (time, kind, target), requests ok and failed (with the gateway's error
body), the time from each fault to the next delta of every stream in flight at the fault
(p50/p99/max), the gateway's failover counters, the commit and the load average.

Placement is the drill's (:class:`dgr.lab.drill.Placement`): synthetic fake-model workers or a
GGUF on local processes, or the hosts of a running lab. Every wait is bounded: the whole soak
by MINUTES plus ``grace_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import DgrError
from .drill import TEXT_PROMPTS, DrillConfig, DrillWorker, LinkProxies, Placement, _drained, compare
from .faults import LabLinks, signal_worker

_log = logging.getLogger(__name__)

SCHEMA = "dgr.soak/1"
KINDS = ("kill", "stop", "term", "blackhole", "restart")
FAULT_KINDS = ("kill", "stop", "term", "blackhole")      # the disruptive ones
MAX_MINUTES = 120.0
SETTLE_S = 3.5            # after a stop/blackhole is lifted: the 3 s detection bound, and a margin
TERM_WAIT_S = 15.0        # a SIGTERMed worker drains 1 s; SIGKILL after this
MODEL_ID = "dgr-soak"
MAX_VIOLATIONS = 200      # listed; the count goes on
ON_ROUTE_SHARE = 2 / 3    # of the faults, aimed at a worker of the route in use


@dataclass
class SoakConfig:
    minutes: float
    fault_every_s: float = 4.0
    seed: int = 0
    concurrency: int = 8
    max_tokens: int = 0               # 0: 64 synthetic, 32 with a model
    split: Sequence[tuple[int, int]] = ((0, 4), (4, 8))
    model: Path | None = None         # None: synthetic (fake-model workers)
    lab: str | None = None
    workers_per_range: int = 2        # the pool kept per range: the route's worker and its standbys
    hold_s: float = 2.0               # stop / blackhole last hold_s * U(0.5, 1.5)
    max_restarts: int = 5             # the gateway's restarts per request
    fake_delay_ms: int = 5
    threads: int | None = None
    kinds: Sequence[str] = KINDS
    drain_wait_s: float = 10.0
    grace_s: float = 180.0            # setup, the last requests and the checks, beyond the soak
    request_timeout_s: float = 60.0
    # True: each request sends its prompt as token ids (tokenized once up front by the route's
    # head), so the gateway tokenizes nothing; False: text, tokenized by the gateway (the usual way)
    prompt_ids: bool = False
    failure_backoff_s: float = 0.25   # a lane waits this long after a failed request (a client's backoff)
    worker_sessions: int = 0          # each worker's session slots (0: twice the concurrency)
    # tests only: called with the reference answers (a list of Reference) before the load starts
    reference_hook: Callable[[list["Reference"]], None] | None = None

    def validate(self) -> None:
        if not (isinstance(self.minutes, (int, float)) and math.isfinite(self.minutes)
                and 0 < self.minutes <= MAX_MINUTES):
            raise DgrError(f"--soak takes minutes in (0, {MAX_MINUTES:g}], got {self.minutes}")
        if not 0.2 <= self.fault_every_s <= 600:
            raise DgrError(f"--fault-every-s must be in 0.2..600, got {self.fault_every_s}")
        if not 1 <= self.concurrency <= 64:
            raise DgrError(f"--sessions must be in 1..64, got {self.concurrency}")
        if not 2 <= self.workers_per_range <= 6:
            raise DgrError(f"--workers-per-range must be in 2..6, got {self.workers_per_range}")
        if not 0 < self.hold_s <= 60:
            raise DgrError(f"--hold-s must be in (0, 60] for a soak, got {self.hold_s}")
        if self.max_restarts < 0 or self.seed < 0:
            raise DgrError("--max-restarts and --seed must be >= 0")
        bad = [k for k in self.kinds if k not in KINDS]
        if bad or not self.kinds:
            raise DgrError(f"--kinds: unknown {', '.join(bad) or '(none given)'}; any of {', '.join(KINDS)}")
        if not any(k in FAULT_KINDS for k in self.kinds):
            raise DgrError("--kinds needs at least one of kill, stop, term, blackhole")
        if len(self.split) < 2:
            raise DgrError("a soak needs a route of at least 2 shards")
        if self.model is None and self.fake_delay_ms < 1:
            raise DgrError("a synthetic soak needs --fake-delay-ms >= 1 (the answers must take time)")
        if self.model is not None and not Path(self.model).is_file():
            raise DgrError(f"model file not found: {self.model}")

    @property
    def tokens(self) -> int:
        return self.max_tokens or (64 if self.model is None else 32)


@dataclass
class Reference:
    prompt: str | list[int]
    deltas: list[str]           # the text of each streamed delta, in order
    finish_reason: str | None
    completion_tokens: int | None

    @property
    def text(self) -> str:
        return "".join(self.deltas)


# ---- workers ------------------------------------------------------------------------------------

@dataclass
class SoakWorker:
    """One worker process of the soak and what has been done to it."""

    id: int
    dw: DrillWorker                     # range, process, own address, the endpoint the route dials
    host: str | None = None             # lab host
    state: str = "live"                 # live | stopped | blackholed | probation | killed | terminating
    #                                     | ended | retired
    faulted: str | None = None          # the fault it got (None: never)
    lift_at: float = 0.0                # stop / blackhole: when to lift it
    settle_until: float = 0.0           # probation: when to decide
    term_at: float = 0.0
    retired: dict[str, Any] | None = None
    proxy_pids: list[int] = field(default_factory=list)   # lab link proxies started for it

    @property
    def range(self) -> tuple[int, int]:
        return self.dw.range

    @property
    def name(self) -> str:
        return f"w{self.id}[{self.range[0]}:{self.range[1]})@{self.dw.endpoint}"

    @property
    def pid(self) -> int:
        return self.dw.proc.pid

    def alive(self) -> bool:
        return self.dw.proc.proc.poll() is None


class _Spawner:
    """Starts one more worker for a range, as the drill's placement starts them: a local process
    (behind a loopback link proxy when ``proxies`` is given) or a process on a lab host (behind
    the lab's link proxy when the lab has one)."""

    def __init__(self, cfg: SoakConfig, pl: Placement, proxies: LinkProxies | None) -> None:
        from ..route.local import ensure_worker

        self.cfg, self.pl, self.proxies = cfg, pl, proxies
        self.binary = ensure_worker()
        self.recipe = None
        self._lab_routes: dict[str, Any] = {}
        if cfg.model is not None and not cfg.lab:
            from ..gguf.recipe import recipe_for
            self.recipe = recipe_for(cfg.model, progress=False)

    def _lab_route(self, host: str) -> Any:
        from .route import LabRoute

        lr = self._lab_routes.get(host)
        if lr is None:
            cfg = self.cfg
            extra = ["--drain-timeout-s", "1"] + (["--fake-delay-ms", str(cfg.fake_delay_ms)]
                                                  if cfg.model is None and cfg.fake_delay_ms else [])
            lr = LabRoute(self.pl.lab, cfg.model, list(cfg.split), placement=[host] * len(cfg.split),
                          slices=cfg.model is not None, max_sessions=self.pl.cfg.sessions, ctx_per_session=1024,
                          extra_args=extra, fake=cfg.model is None)
            lr._prepare()      # the recipe and the slice files (made once, then found again)
            self._lab_routes[host] = lr
        return lr

    def spawn(self, rng: tuple[int, int], host: str | None) -> tuple[DrillWorker, list[int]]:
        """(the worker, pids of link proxies started for it); blocking (run it on a thread)."""
        from ..route.supervisor import WorkerProcess

        a, b = rng
        if host is None:
            w = WorkerProcess.start(self.pl._worker_args(a, b, self.recipe), binary=self.binary, ready_timeout=120)
            ep = self.proxies.add(w.target) if self.proxies is not None else w.target
            return DrillWorker("spare", rng, w, w.target, ep), []
        lab = self.pl.lab
        lr = self._lab_route(host)
        h = lab.host(host)
        args = lr.worker_args(list(self.cfg.split).index(rng))
        w = WorkerProcess.start(args, binary=lab.wrapper(h, self.binary), listen=f"{h.ip}:0", ready_timeout=120,
                                credentials=lr.tls.grpc_credentials())
        try:
            before = {pr["pid"] for pr in lab.state["proxies"]}
            ep = lab.expose(h, w.port)
        except BaseException:
            w.kill()
            raise
        pids = [pr["pid"] for pr in lab.state["proxies"] if pr["pid"] not in before]
        return DrillWorker("spare", rng, w, w.target, ep), pids


# ---- the soak -----------------------------------------------------------------------------------

def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))
    return round(s[k], 4)


def _stats(xs: Sequence[float]) -> dict[str, Any]:
    return {"n": len(xs), "p50": _pct(xs, 0.5), "p99": _pct(xs, 0.99),
            "max": round(max(xs), 4) if xs else None}


def _commit() -> dict[str, Any]:
    root = Path(__file__).resolve().parents[3]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                            text=True, timeout=20)
        return {"sha": sha or None, "clean": st.returncode == 0 and not st.stdout.strip(),
                "changed_files": len(st.stdout.splitlines())}
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "clean": None}


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _started(pid: int) -> tuple[int, int | None]:
    """(pid, its start time): a pid names the same process only while both match."""
    from .system import start_ticks

    return pid, start_ticks(pid)


def _pid_running(proc: tuple[int, int | None]) -> bool:
    """The process recorded by :func:`_started` still runs (not a zombie, not a reused pid)."""
    pid, start = proc
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rpartition(")")[2].split()
    return fields[0] != "Z" and start is not None and int(fields[19]) == start


@dataclass
class _Stream:
    """One request in flight: the faults waiting for its next delta."""
    waiting: list[tuple[str, float]] = field(default_factory=list)   # (fault kind, monotonic time)


class Soak:
    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)                 # faults: kind, target, interval, hold
        self.prompt_rng = random.Random(cfg.seed + 1)      # which prompt each request asks
        self.t0 = time.monotonic()
        self.workers: list[SoakWorker] = []
        self.pl: Placement | None = None
        self.proxies: LinkProxies | None = None
        self.links: Any = None                             # LinkProxies | LabLinks | None
        self.blackhole_note: str | None = None
        self.gw: Any = None
        self.spawner: _Spawner | None = None
        self.refs: list[Reference] = []
        self.faults: list[dict[str, Any]] = []
        self.skipped: dict[str, int] = {}
        self.notes: list[str] = []
        self.collateral: list[dict[str, Any]] = []
        self.violations: list[str] = []
        self.n_violations = 0
        self.requests: dict[str, Any] = {"started": 0, "ok": 0, "failed": 0}
        self.failures: dict[str, dict[str, Any]] = {}     # reason -> {count, example}
        self.after_fault: dict[str, list[float]] = {k: [] for k in FAULT_KINDS}
        self.no_next_delta = 0
        self.inflight: set[int] = set()
        self.streams: dict[int, _Stream] = {}
        self.started_pids: list[tuple[int, int | None]] = []      # (pid, start time)
        self.lab_proxy_pids: list[tuple[int, int | None]] = []
        self.endpoints_seen: set[str] = set()
        self.soak_s = 0.0
        self.load_start = _loadavg()
        self.stopping = False
        self.retire_tasks: list[asyncio.Task[Any]] = []
        self.timed_out = False
        self._lab_lock = threading.Lock()     # the lab's state file: spawns and ends on threads

    # ---- helpers --------------------------------------------------------------------------

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 4)

    def violation(self, text: str) -> None:
        self.n_violations += 1
        if len(self.violations) < MAX_VIOLATIONS:
            self.violations.append(text)
        _log.warning("violation: %s", text)

    @property
    def router(self) -> Any:
        return self.gw.engine.router if self.gw is not None and self.gw.engine is not None else None

    def failed_set(self) -> set[str]:
        r = self.router
        for _ in range(5):
            try:
                return set(r.failed) if r is not None else set()
            except RuntimeError:      # changed size while read (the gateway's thread)
                continue
        return set()

    def on_route(self) -> list[str]:
        r = self.router
        return list(r.route.endpoints) if r is not None and r.route is not None else []

    def usable(self, rng: tuple[int, int], failed: set[str]) -> list[SoakWorker]:
        return [w for w in self.workers if w.range == rng and w.state == "live" and w.dw.endpoint not in failed
                and w.alive()]

    def _add(self, dw: DrillWorker, host: str | None, proxy_pids: Sequence[int] = ()) -> SoakWorker:
        w = SoakWorker(len(self.workers) + 1, dw, host, proxy_pids=list(proxy_pids))
        self.workers.append(w)
        self.started_pids.append(_started(w.pid))
        self.lab_proxy_pids += [_started(p) for p in proxy_pids]
        self.endpoints_seen.update({dw.endpoint, dw.target})
        return w

    # ---- setup ----------------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.cfg
        # the drill's placement: the route's worker and a standby per range; twice the load's
        # sessions per worker, so that a failover's new sessions never wait for the old ones' release
        dcfg = DrillConfig(fault="kill", sessions=cfg.worker_sessions or min(64, 2 * cfg.concurrency),
                           max_tokens=cfg.tokens,
                           split=cfg.split, model=cfg.model, lab=cfg.lab, max_restarts=cfg.max_restarts,
                           fake_delay_ms=cfg.fake_delay_ms, threads=cfg.threads)
        if not cfg.lab:
            self.proxies = LinkProxies()
        self.pl = Placement(dcfg, self.proxies)
        self.pl.start()
        hosts: list[str | None] = [None] * len(self.pl.workers)
        if cfg.lab:
            names = [h.name for h in self.pl.lab.hosts]
            n = len(cfg.split)
            hosts = [names[i % len(names)] for i in range(n)] + [names[(i + 1) % len(names)] for i in range(n)]
            if self.pl.lab.shaping.get("delay_mechanism") == "proxy":
                self.links = LabLinks(self.pl.lab)
                self.lab_proxy_pids += [_started(pr["pid"]) for pr in self.pl.lab.state["proxies"]
                                        if pr["target"] in {w.target for w in self.pl.workers}]
            else:
                self.blackhole_note = (f"blackhole skipped: lab {cfg.lab} shapes links by "
                                       f"{self.pl.lab.shaping.get('delay_mechanism')}, not by its link proxy "
                                       "(bring it up with --shaper proxy)")
        else:
            # every worker behind its own loopback link proxy (the drill proxies the route's only)
            for w in self.pl.workers:
                if w.endpoint == w.target:
                    w.endpoint = self.proxies.add(w.target)
            self.links = self.proxies
        for dw, host in zip(self.pl.workers, hosts):
            self._add(dw, host)
        self.spawner = _Spawner(cfg, self.pl, self.proxies)
        # more standbys up to workers_per_range
        for rng in cfg.split:
            for _ in range(cfg.workers_per_range - 2):
                self._spawn_now(tuple(rng))
        if self.blackhole_note:
            self.notes.append(self.blackhole_note)

    def _lab_host_for(self, rng: tuple[int, int]) -> str | None:
        if not self.cfg.lab:
            return None
        names = [h.name for h in self.pl.lab.hosts]
        busy = {n: sum(1 for w in self.workers if w.host == n and w.alive()) for n in names}
        same = {n: sum(1 for w in self.workers if w.host == n and w.range == rng and w.alive()) for n in names}
        return min(names, key=lambda n: (same[n], busy[n], names.index(n)))

    def _spawn_now(self, rng: tuple[int, int]) -> SoakWorker:
        """Starts a worker for ``rng`` (blocking); refuses an endpoint seen before (the gateway
        never takes back an endpoint its failover excluded)."""
        assert self.spawner is not None
        failed = self.failed_set()
        for _ in range(3):
            host = self._lab_host_for(rng)
            with self._lab_lock:
                dw, pids = self.spawner.spawn(rng, host)
            if dw.endpoint not in self.endpoints_seen and dw.endpoint not in failed:
                w = self._add(dw, host, pids)
                if isinstance(self.links, LabLinks):
                    self.links = LabLinks(self.pl.lab)      # with the proxy in front of the new worker
                return w
            self.notes.append(f"a new worker got the endpoint {dw.endpoint} of an earlier one; started another")
            self.started_pids.append(_started(dw.proc.pid))
            self.lab_proxy_pids += [_started(p) for p in pids]
            self._end_process(dw, pids)
        raise DgrError(f"could not start a worker for [{rng[0]}:{rng[1]}) on a fresh endpoint")

    def _end_process(self, dw: DrillWorker, proxy_pids: Sequence[int] = ()) -> None:
        """SIGCONT, SIGTERM, wait (SIGKILL after 10 s); the lab's link proxy in front of it too."""
        signal_worker(dw.proc, signal.SIGCONT)
        try:
            dw.proc.terminate(10)
        except Exception:   # noqa: BLE001
            dw.proc.kill()
        if self.cfg.lab and self.pl is not None:
            with self._lab_lock:
                self.pl.lab.unexpose({dw.target})

    def start_gateway(self) -> None:
        from ..serve.server import Gateway

        assert self.pl is not None
        ranges = [tuple(r) for r in self.cfg.split]
        first = {r: next(w for w in self.workers if w.range == r) for r in ranges}
        route = [first[r].dw.endpoint for r in ranges]
        standby = [w.dw.endpoint for w in self.workers if w.dw.endpoint not in route]
        self.gw = Gateway(route, model_id=MODEL_ID, standby=standby, max_restarts=self.cfg.max_restarts,
                          route_tls=self.pl.tls).start(60)

    # ---- load -----------------------------------------------------------------------------

    def _body(self, prompt: str | list[int]) -> dict[str, Any]:
        return {"model": MODEL_ID, "prompt": prompt, "max_tokens": self.cfg.tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async def _request(self, client: Any, prompt: str | list[int], rid: int | None) -> dict[str, Any]:
        """One streamed request: its deltas, finish reason, usage, or the error (status and body)."""
        out: dict[str, Any] = {"deltas": [], "finish_reason": None, "completion_tokens": None, "error": None}
        st = self.streams.get(rid) if rid is not None else None

        def delta() -> None:
            if st is not None and st.waiting:
                t = time.monotonic()
                for kind, tf in st.waiting:
                    self.after_fault[kind].append(t - tf)
                st.waiting.clear()

        try:
            async with client.stream("POST", self.gw.url + "/v1/completions", json=self._body(prompt)) as r:
                if r.status_code != 200:
                    body = (await r.aread()).decode(errors="replace")
                    out["error"] = f"HTTP {r.status_code}: {body[:400]}"
                    return out
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        out["error"] = f"error event: {json.dumps(ev['error'])[:400]}"
                        continue
                    if ev.get("usage"):
                        out["completion_tokens"] = ev["usage"].get("completion_tokens")
                    for ch in ev.get("choices") or []:
                        if ch.get("text"):
                            out["deltas"].append(ch["text"])
                            delta()
                        if ch.get("finish_reason"):
                            out["finish_reason"] = ch["finish_reason"]
                            delta()
        except Exception as exc:   # noqa: BLE001 - a transport failure is the request's outcome
            out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return out

    def _check(self, rid: int, k: int, got: dict[str, Any]) -> None:
        ref = self.refs[k]
        n = self.cfg.tokens
        if got["error"]:
            self.requests["failed"] += 1
            reason = _reason(got["error"])
            f = self.failures.setdefault(reason, {"count": 0, "example": got["error"], "at_s": []})
            f["count"] += 1
            if len(f["at_s"]) < 20:
                f["at_s"].append(self.now())
            self.violation(f"request {rid} (prompt {k}) failed at {self.now()} s: {got['error']}")
            return
        bad = []
        if got["finish_reason"] != "length":
            bad.append(f"finish_reason {got['finish_reason']!r}, expected 'length'")
        if got["completion_tokens"] != n:
            bad.append(f"completion_tokens {got['completion_tokens']}, expected {n}")
        if got["deltas"] != ref.deltas:
            lost, dup, mism = compare(ref.deltas, got["deltas"])
            bad.append(f"answer differs from the reference: {lost} deltas lost, {dup} repeated, {mism} mismatched "
                       f"({len(got['deltas'])} vs {len(ref.deltas)} deltas; text equal: "
                       f"{''.join(got['deltas']) == ref.text})")
        if bad:
            self.requests["failed"] += 1
            reason = "incomplete or wrong answer"
            f = self.failures.setdefault(reason, {"count": 0, "example": "; ".join(bad), "at_s": []})
            f["count"] += 1
            if len(f["at_s"]) < 20:
                f["at_s"].append(self.now())
            self.violation(f"request {rid} (prompt {k}) at {self.now()} s: " + "; ".join(bad))
        else:
            self.requests["ok"] += 1

    async def reference(self, client: Any) -> None:
        n = max(8, self.cfg.concurrency)
        prompts: list[Any] = [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] + ("" if i < len(TEXT_PROMPTS) else f" ({i})")
                              for i in range(n)]
        if self.cfg.prompt_ids:
            from ..route.driver import RouteDriver

            d = await RouteDriver(self.on_route(), tls=self.pl.tls if self.pl else None).connect()
            try:   # as the gateway tokenizes a completion's text prompt
                prompts = [await d.tokenize(p, add_special=True, parse_special=False) for p in prompts]
            finally:
                await d.close()
        _log.info("reference: %s prompts x %s tokens on the clean route, through the gateway", n, self.cfg.tokens)
        got = await asyncio.gather(*(self._request(client, p, None) for p in prompts))
        for p, g in zip(prompts, got):
            if g["error"] or g["finish_reason"] != "length" or g["completion_tokens"] != self.cfg.tokens:
                raise DgrError(f"the reference run failed for {p!r}: {g['error'] or g['finish_reason']} "
                               f"({g['completion_tokens']} tokens)")
            self.refs.append(Reference(p, g["deltas"], g["finish_reason"], g["completion_tokens"]))
        if self.cfg.reference_hook is not None:
            self.cfg.reference_hook(self.refs)

    async def lane(self, client: Any, counter: list[int]) -> None:
        while not self.stopping:
            rid = counter[0]
            counter[0] += 1
            k = self.prompt_rng.randrange(len(self.refs))
            self.requests["started"] += 1
            self.streams[rid] = st = _Stream()
            try:
                got = await asyncio.wait_for(self._request(client, self.refs[k].prompt, rid),
                                             self.cfg.request_timeout_s * 2)
            except TimeoutError:
                got = {"error": f"no answer within {self.cfg.request_timeout_s * 2:.0f} s", "deltas": []}
            finally:
                self.streams.pop(rid, None)
            self.no_next_delta += len(st.waiting)
            self._check(rid, k, got)
            if got["error"] and not self.stopping:
                await asyncio.sleep(self.cfg.failure_backoff_s)

    # ---- faults ---------------------------------------------------------------------------

    def _links_for(self, w: SoakWorker) -> bool:
        return self.links is not None and w.dw.endpoint in self.links.links

    def choose(self) -> tuple[str, Any] | None:
        """(kind, target) among what may be done now: a fault on a worker whose range keeps
        another usable worker, or a restart for a range short of workers."""
        failed = self.failed_set()
        ranges = [tuple(r) for r in self.cfg.split]
        options: dict[str, list[Any]] = {}
        for kind in self.cfg.kinds:
            if kind == "restart":
                # short of usable workers (a faulted one that comes back later adds to the pool)
                short = [r for r in ranges if len(self.usable(r, failed)) < self.cfg.workers_per_range]
                if short:
                    options[kind] = short
                continue
            if kind == "blackhole" and self.blackhole_note:
                continue
            cands = [w for r in ranges if len(u := self.usable(r, failed)) >= 2 for w in u]
            if kind == "blackhole":
                cands = [w for w in cands if self._links_for(w)]
            if cands:
                options[kind] = cands
        if not options:
            return None
        kind = self.rng.choice(sorted(options))
        cands = options[kind]
        if kind != "restart":
            # two faults in three hit the route in use (when one of its workers may be faulted):
            # a fault on an idle standby tests less
            route = set(self.on_route())
            busy = [w for w in cands if w.dw.endpoint in route]
            if busy and self.rng.random() < ON_ROUTE_SHARE:
                cands = busy
        return kind, self.rng.choice(cands)

    async def inject(self) -> None:
        pick = self.choose()
        if pick is None:
            self.skipped["nothing_allowed"] = self.skipped.get("nothing_allowed", 0) + 1
            return
        kind, target = pick
        t = time.monotonic()
        rec: dict[str, Any] = {"t_s": self.now(), "kind": kind}
        if kind == "restart":
            rng = target
            t_start = time.monotonic()
            try:
                w = await asyncio.to_thread(self._spawn_now, rng)
                self.gw.engine.add_standby(w.dw.endpoint)
            except Exception as exc:   # noqa: BLE001 - the pool stays short; no fault takes its last worker
                self.skipped["restart_failed"] = self.skipped.get("restart_failed", 0) + 1
                self.notes.append(f"{rec['t_s']} s: restart [{rng[0]}:{rng[1]}) failed: {str(exc)[:300]}")
                _log.warning("restart [%s:%s) failed: %s", rng[0], rng[1], exc)
                return
            rec.update({"range": f"{rng[0]}:{rng[1]}", "target": w.name, "pid": w.pid, "host": w.host,
                        "direct": w.dw.target,
                        "start_s": round(time.monotonic() - t_start, 3)})
            _log.info("%.1f s: restart [%s:%s) -> %s", rec["t_s"], rng[0], rng[1], w.name)
            self.faults.append(rec)
            return
        w: SoakWorker = target
        rec.update({"target": w.name, "range": f"{w.range[0]}:{w.range[1]}", "pid": w.pid, "host": w.host,
                    "direct": w.dw.target, "on_route": w.dw.endpoint in self.on_route()})
        hold = self.cfg.hold_s * self.rng.uniform(0.5, 1.5)
        if kind in ("kill", "stop", "term"):
            sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}[kind]
            if not signal_worker(w.dw.proc, sig):
                self.notes.append(f"{kind}: {w.name} had already ended")
                w.state = "ended"
                return
            w.state = {"kill": "killed", "stop": "stopped", "term": "terminating"}[kind]
            w.term_at = t
        else:
            self.links.set(w.dw.endpoint, blackhole=True)
            w.state = "blackholed"
        w.faulted = kind
        if kind in ("stop", "blackhole"):
            w.lift_at = t + hold
            rec["hold_s"] = round(hold, 3)
        for st in list(self.streams.values()):
            st.waiting.append((kind, t))
        self.faults.append(rec)
        _log.info("%.1f s: %s %s%s", rec["t_s"], kind, w.name, " (on the route)" if rec["on_route"] else "")

    def _lift(self, w: SoakWorker) -> None:
        if w.state == "stopped":
            signal_worker(w.dw.proc, signal.SIGCONT)
        elif w.state == "blackholed":
            self.links.set(w.dw.endpoint, blackhole=False)
        w.state = "probation"
        w.settle_until = time.monotonic() + SETTLE_S

    def housekeeping(self) -> None:
        now = time.monotonic()
        failed = self.failed_set()
        for w in self.workers:
            if w.state in ("stopped", "blackholed") and now >= w.lift_at:
                self._lift(w)
            elif w.state in ("killed", "terminating"):
                if not w.alive():
                    w.state = "ended"
                    self._unexpose(w)
                elif w.state == "terminating" and now - w.term_at > TERM_WAIT_S:
                    self.violation(f"{w.name} did not exit within {TERM_WAIT_S:.0f} s of SIGTERM; killed")
                    signal_worker(w.dw.proc, signal.SIGKILL)
                    w.state = "killed"
            elif w.state == "probation" and now >= w.settle_until:
                if w.dw.endpoint in failed:
                    self._retire(w, "excluded by the gateway after its fault")
                else:
                    w.state = "live"
            elif w.state == "live" and w.dw.endpoint in failed:
                if w.alive():
                    self.collateral.append({"t_s": self.now(), "worker": w.name,
                                            "why": self.router.failed.get(w.dw.endpoint, "")[:300]})
                    self._retire(w, "excluded by the gateway without a fault")
                else:
                    w.state = "ended"
                    self._unexpose(w)
            elif w.state == "live" and not w.alive():
                self.violation(f"{w.name} ended without a fault (exit {w.dw.proc.proc.returncode})")
                w.state = "ended"
                self._unexpose(w)

    def _unexpose(self, w: SoakWorker) -> None:
        """A lab worker that ended: the lab's link proxy in front of it goes too (on a thread)."""
        if not self.cfg.lab or self.pl is None:
            return

        def go() -> None:
            with self._lab_lock:
                self.pl.lab.unexpose({w.dw.target})
        self.retire_tasks.append(asyncio.ensure_future(asyncio.to_thread(go)))

    def _retire(self, w: SoakWorker, why: str) -> None:
        w.state = "retired"

        async def go() -> None:
            st = await _drained(w.dw.target, self.pl.tls if self.pl else None, self.cfg.drain_wait_s)
            w.retired = {"t_s": self.now(), "why": why, **st}
            if not st.get("idle"):
                self.violation(f"{w.name}, taken out of the route ({why}), still holds {_holds(st)} after "
                               f"{st.get('waited_s')} s")
            await asyncio.to_thread(self._end_process, w.dw, w.proxy_pids)
        self.retire_tasks.append(asyncio.ensure_future(go()))

    # ---- the run --------------------------------------------------------------------------

    async def run(self) -> None:
        import httpx

        cfg = self.cfg
        limits = httpx.Limits(max_connections=cfg.concurrency + 8, max_keepalive_connections=cfg.concurrency + 8)
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            await self.reference(client)
            counter = [0]
            t_start = time.monotonic()
            self.t_load = self.now()
            deadline = t_start + cfg.minutes * 60
            lanes = [asyncio.ensure_future(self.lane(client, counter)) for _ in range(cfg.concurrency)]
            _log.info("soak: %s streams, an action every ~%.1f s, for %.2f min", cfg.concurrency,
                      cfg.fault_every_s, cfg.minutes)
            next_at = t_start + cfg.fault_every_s * self.rng.uniform(0.5, 1.5)
            try:
                while time.monotonic() < deadline:
                    await asyncio.sleep(max(0.0, min(0.1, next_at - time.monotonic(), deadline - time.monotonic())))
                    self.housekeeping()
                    if any(ln.done() for ln in lanes):
                        break      # a lane ended early: its exception is raised below
                    if time.monotonic() >= next_at and time.monotonic() < deadline:
                        await self.inject()
                        next_at = time.monotonic() + cfg.fault_every_s * self.rng.uniform(0.5, 1.5)
            finally:
                self.soak_s = round(time.monotonic() - t_start, 3)
                self.stopping = True
                self.lift_all()
            # the requests in flight finish (each bounded by its own timeout)
            done, pending = await asyncio.wait(lanes, timeout=cfg.request_timeout_s * 2 + 10)
            for ln in pending:
                ln.cancel()
                self.violation("a request did not finish after the soak ended")
            for ln in done:
                if ln.exception() is not None:
                    raise ln.exception()
            self.t_unload = self.now()
            # the faulted workers settle, then every worker is checked
            end = time.monotonic() + TERM_WAIT_S
            while any(w.state in ("killed", "terminating") for w in self.workers) and time.monotonic() < end:
                self.housekeeping()
                await asyncio.sleep(0.1)
            self.housekeeping()
            if self.retire_tasks:
                await asyncio.gather(*self.retire_tasks)
            await self.final_checks(client)

    def lift_all(self) -> None:
        """SIGCONT every stopped worker and lift every blackhole (also after a failure)."""
        for w in self.workers:
            if w.state in ("stopped", "blackholed"):
                try:
                    self._lift(w)
                except Exception as exc:   # noqa: BLE001 - best effort; the process is ended later
                    self.notes.append(f"lifting {w.name}: {exc}")
            if w.faulted == "stop":
                signal_worker(w.dw.proc, signal.SIGCONT)

    async def final_checks(self, client: Any) -> None:
        # the gateway's in-flight gauge back to 0 (the last streams' ends are counted just after)
        gauge = None
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                text = (await client.get(self.gw.url + "/metrics")).text
                gauge = next((float(ln.split()[-1]) for ln in text.splitlines()
                              if ln.startswith("dgr_gateway_in_flight_requests ")), None)
            except Exception as exc:   # noqa: BLE001
                self.notes.append(f"/metrics: {exc}")
            if gauge == 0:
                break
            await asyncio.sleep(0.1)
        self.in_flight_end = gauge
        if gauge != 0:
            self.violation(f"dgr_gateway_in_flight_requests is {gauge} after the load ended")
        try:
            self.health = (await client.get(self.gw.url + "/health")).json()
        except Exception as exc:   # noqa: BLE001
            self.health = {"error": str(exc)}
        # every worker still running: nothing held (a stopped one was resumed by lift_all)
        alive = [w for w in self.workers if w.state not in ("ended", "retired") and w.alive()]
        tls = self.pl.tls if self.pl else None
        got = await asyncio.gather(*(_drained(w.dw.target, tls, self.cfg.drain_wait_s) for w in alive))
        self.survivors = []
        for w, st in zip(alive, got):
            self.survivors.append({"worker": w.name, "faulted": w.faulted, "state": w.state, **st})
            if not st.get("idle"):
                self.violation(f"{w.name} still holds {_holds(st)} after the soak "
                               f"(waited {st.get('waited_s')} s)")

    def teardown(self) -> None:
        """Ends every process the soak started (SIGCONT first), the gateway, the link proxies."""
        for w in self.workers:
            signal_worker(w.dw.proc, signal.SIGCONT)
        if self.links is not None:
            for w in self.workers:
                if w.state == "blackholed" or w.faulted == "blackhole":
                    try:
                        self.links.set(w.dw.endpoint, blackhole=False)
                    except Exception:   # noqa: BLE001
                        pass
        if self.gw is not None:
            self.gw.stop()
        for w in self.workers:
            if w.alive():
                self._end_process(w.dw, w.proxy_pids)
            else:
                w.dw.proc.kill()        # reaps it
        if self.cfg.lab and self.pl is not None:
            with self._lab_lock:        # the link proxies in front of every worker, ended or not
                self.pl.lab.unexpose({w.dw.target for w in self.workers})
        if self.spawner is not None:
            for lr in self.spawner._lab_routes.values():
                lr.stop()               # started nothing itself; its relays (none) and placed (none)
        if self.pl is not None:
            self.pl.stop()              # the placement's own (already ended) workers and lab proxies
        if self.proxies is not None:
            self.proxies.close()

    def leaks(self) -> list[str]:
        out = [f"worker pid {p[0]}" for p in self.started_pids if _pid_running(p)]
        out += [f"lab link proxy pid {p[0]}" for p in self.lab_proxy_pids if _pid_running(p)]
        if self.cfg.lab and self.pl is not None:
            mine = {w.dw.target for w in self.workers}
            out += [f"lab state still lists the proxy in front of {pr['target']}"
                    for pr in self.pl.lab.state["proxies"] if pr["target"] in mine]
        return out

    # ---- the report -------------------------------------------------------------------------

    def document(self, t_total: float) -> dict[str, Any]:
        cfg = self.cfg
        by_kind: dict[str, int] = {k: 0 for k in cfg.kinds}
        for f in self.faults:
            by_kind[f["kind"]] = by_kind.get(f["kind"], 0) + 1
        all_after = [x for xs in self.after_fault.values() for x in xs]
        faults_on_route = sum(1 for f in self.faults if f.get("on_route"))
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "mode": "synthetic" if cfg.model is None else "model",
            "placement": f"lab:{cfg.lab}" if cfg.lab else "local",
            "model": str(cfg.model) if cfg.model else None,
            "config": {"minutes": cfg.minutes, "fault_every_s": cfg.fault_every_s, "seed": cfg.seed,
                       "concurrency": cfg.concurrency, "max_tokens": cfg.tokens,
                       "split": [f"{a}:{b}" for a, b in cfg.split], "workers_per_range": cfg.workers_per_range,
                       "worker_max_sessions": self.pl.cfg.sessions if self.pl else None,
                       "hold_s": cfg.hold_s, "max_restarts": cfg.max_restarts,
                       "fake_delay_ms": cfg.fake_delay_ms if cfg.model is None else None,
                       "kinds": list(cfg.kinds), "prompts": "token ids" if cfg.prompt_ids else "text",
                       "drain_wait_s": cfg.drain_wait_s, "grace_s": cfg.grace_s,
                       "hard_bound_s": round(cfg.minutes * 60 + cfg.grace_s, 1)},
            "commit": _commit(),
            "load_average": {"start": self.load_start, "end": _loadavg(), "cpus": os.cpu_count()},
            "faults": {
                "injected": len(self.faults),
                "disruptive": sum(by_kind.get(k, 0) for k in FAULT_KINDS),
                "on_route": faults_on_route,
                "by_kind": by_kind,
                "skipped": {**self.skipped, **({"blackhole": self.blackhole_note} if self.blackhole_note else {})},
                "events": self.faults,
            },
            "requests": {**self.requests, "failures": self.failures},
            "next_delta_after_fault_s": {**_stats(all_after), "streams_without_a_next_delta": self.no_next_delta,
                                         "by_kind": {k: _stats(v) for k, v in self.after_fault.items() if v}},
            "gateway": {"in_flight_at_end": getattr(self, "in_flight_end", None),
                        "failovers": (self.health or {}).get("failovers") if hasattr(self, "health") else None,
                        "failed_shards": len((getattr(self, "health", None) or {}).get("failed_shards") or []),
                        "restarted_requests": self.gw.engine.restarts if self.gw and self.gw.engine else None},
            "workers": {"started": len(self.workers),
                        "collateral_exclusions": self.collateral,
                        "retired": [{"worker": w.name, "faulted": w.faulted, **(w.retired or {})}
                                    for w in self.workers if w.retired is not None],
                        "survivors": getattr(self, "survivors", [])},
            "leaked_processes": getattr(self, "leaked", []),
            "notes": self.notes,
            "violations": self.violations,
            "violations_total": self.n_violations,
            "soak_s": self.soak_s,
            "duration_s": round(t_total, 3),
        }
        return doc


def _holds(st: dict[str, Any]) -> str:
    if "error" in st:
        return f"(unreadable: {st['error']})"
    return f"{st['sessions']} sessions, {st['kv_cells_used']} KV cells, {st['queued_steps']} queued steps"


def _reason(err: str) -> str:
    """A failure's class, for the counts (the full body is kept as the example)."""
    for key in ("no_standby", "recipe_mismatch", "capacity", "unreachable", "gave up after", "over_capacity",
                "head shard", "route_error", "cancelled", "Timeout", "no answer within"):
        if key in err:
            return key
    return err.split(":")[0][:60]


def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    """Runs one soak (see the module docstring) and returns its JSON document (schema
    ``dgr.soak/1``); progress goes to this module's logger at INFO."""
    cfg.validate()
    t0 = time.monotonic()
    s = Soak(cfg)
    bound = cfg.minutes * 60 + cfg.grace_s
    try:
        s.setup()
        s.start_gateway()
        _log.info("gateway %s over %s, standbys %s", s.gw.url, s.on_route(),
                  [w.dw.endpoint for w in s.workers if w.dw.endpoint not in s.on_route()])

        async def bounded() -> None:
            try:
                await asyncio.wait_for(s.run(), max(1.0, bound - (time.monotonic() - t0)))
            except TimeoutError:
                s.timed_out = True
                s.violation(f"the soak did not end within its hard bound ({bound:.0f} s)")
            except Exception as exc:   # noqa: BLE001 - reported; the processes are ended below
                _log.error("the soak ended early", exc_info=exc)
                s.violation(f"the soak ended early: {type(exc).__name__}: {str(exc)[:300]}")
            finally:
                s.lift_all()
        asyncio.run(bounded())
    finally:
        try:
            s.lift_all()
        finally:
            s.teardown()
    s.leaked = s.leaks()
    for p in s.leaked:
        s.violation(f"leaked process: {p}")
    return s.document(time.monotonic() - t0)
