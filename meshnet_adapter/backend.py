"""The GGUF Shard backend Meshnet's node service calls.

Meshnet's node service drives model backends through one small surface (the Transformers
backend implements the same one). This module documents that surface as :class:`ShardBackend`
and implements it for dgr as :class:`GgufShardBackend`, which supervises one ``dgr-worker``
process and talks to it only over its gRPC API (``dgr.shard.v1.ShardRuntimeService``)::

    backend = GgufShardBackend(BackendConfig(model=Path("m.gguf"), start=0, end=15))
    reg = backend.load(node_id="node-a", registry=load_registry())   # -> ShardRegistration for the Tracker
    s = backend.open_session("sess-1", epoch=1, request_id="req-9")   # one Route Session on this Shard
    out = s.step(tokens=[1, 2, 3])                                    # head: token ids in
    rows = out.boundary                                               # non-tail: residual rows out
    s.release()                                                       # or backend.cancel_session("sess-1")
    backend.telemetry()                                               # work records + worker load
    backend.close()

Interface (every method is thread-safe; failures the node can hit are :class:`BackendError`):

==================  =========================================================================
``load``            start (or adopt) the worker, wait for SERVING, return the registration
``capability``      current :class:`~meshnet_adapter.registration.Capacity` (sessions, KV)
``open_session``    a :class:`BackendSession` (one session stream on the worker)
``BackendSession.step``   one PREFILL chunk / DECODE row; returns boundary rows or a sampled token
``release_session`` free the session's Hot KV State (idempotent)
``cancel_session``  abort in-flight work and release (idempotent)
``telemetry``       per-session work records (request id, status, tokens, busy time) + load
``health``          SERVING / NOT_SERVING / DOWN / FAILED
``close``           SIGTERM the worker (drains), stop supervising
==================  =========================================================================

Supervision: a monitor thread checks the process and grpc.health.v1 every
``health_period_s``; a dead or unhealthy worker is restarted under :class:`RestartPolicy`
(at most ``max_restarts`` within ``window_s``, exponential backoff). Sessions held by a worker
that died are marked ``failed`` in telemetry — Hot KV State is never recovered;
the route restarts from token zero. Worker stdout/stderr go to ``log_path``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from dgr.errors import DgrError
from dgr.protocol import client as client_mod
from dgr.route.supervisor import WorkerArgs, WorkerProcess, WorkerStartError, default_binary
from dgr.shard.v1 import shard_runtime_pb2 as pb

from .registration import Capacity, ShardRegistration, make_registration, measurement_of_capability


class BackendError(DgrError):
    """A backend operation failed; ``reason`` is the protocol ErrorReason name when known."""

    def __init__(self, message: str, *, reason: str = "", terminated: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.terminated = terminated


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3
    window_s: float = 300.0
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    unhealthy_checks: int = 3      # consecutive failed health checks that count as down


@dataclass(frozen=True)
class BackendConfig:
    model: Path | None             # GGUF (whole artifact or a slice); None with fake=True
    start: int
    end: int
    backend: str = "cpu"
    fake: bool = False             # deterministic fake model (tests); n_layer from fake_n_layer
    fake_n_layer: int = 8
    listen: str = "127.0.0.1:0"
    threads: int | None = None
    max_sessions: int = 16
    ctx_per_session: int = 2048
    extra_args: tuple[str, ...] = ()
    binary: Path | None = None
    log_path: Path | None = None
    health_period_s: float = 1.0
    restart: RestartPolicy = RestartPolicy()


@dataclass
class WorkRecord:
    """Attribution for one session on this node (billing: completed / cancelled / failed)."""
    session_id: str
    route_epoch: int
    request_id: str
    status: str = "running"       # running, completed, cancelled, failed
    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps: int = 0
    busy_s: float = 0.0
    error: str | None = None
    opened_at: float = field(default_factory=time.time)
    closed_at: float | None = None


@dataclass
class StepOutput:
    boundary: np.ndarray | None = None   # non-tail: [n_rows, n_embd] f32 residual leaving the shard
    token: int | None = None             # tail: sampled token (when sampling was asked)
    finish_reason: str = ""
    cached_positions: int = 0


class ShardBackend(Protocol):
    """The model-backend surface of Meshnet's node service (see the module docstring)."""

    def load(self, *, node_id: str, registry: Any) -> ShardRegistration: ...
    def capability(self) -> Capacity: ...
    def open_session(self, session_id: str, *, epoch: int = 1, request_id: str = "",
                     sampling: client_mod.Sampling | None = None) -> "BackendSession": ...
    def release_session(self, session_id: str, epoch: int = 0) -> bool: ...
    def cancel_session(self, session_id: str, epoch: int = 0) -> bool: ...
    def telemetry(self) -> dict[str, Any]: ...
    def health(self) -> str: ...
    def close(self) -> None: ...


class BackendSession:
    """One Route Session on this Shard: an ordered stream of steps."""

    def __init__(self, backend: "GgufShardBackend", stream: client_mod.SessionStream, record: WorkRecord,
                 generation: int) -> None:
        self.backend, self.stream, self.record, self.generation = backend, stream, record, generation
        self.cap = stream.cap

    @property
    def session_id(self) -> str:
        return self.record.session_id

    def step(self, *, tokens: Sequence[int] | None = None, rows: np.ndarray | None = None,
             decode: bool = False, sample: bool = True) -> StepOutput:
        """One step: a PREFILL chunk (any rows up to max_prefill_chunk_tokens) or, with
        ``decode=True``, one DECODE row. Head shards take ``tokens``, others ``rows``."""
        if (tokens is None) == (rows is None):
            raise BackendError("give exactly one of tokens (head) or rows (boundary input)")
        if self.generation != self.backend._generation:
            self._fail("the worker restarted; this session's KV state is gone (restart from token zero)",
                       "ERROR_REASON_UNKNOWN_SESSION")
        t0 = time.perf_counter()
        n = len(tokens) if tokens is not None else int(rows.shape[0])
        try:
            if decode:
                if n != 1:
                    raise BackendError("a decode step carries exactly one row", reason="ERROR_REASON_CHUNK_TOO_LARGE")
                if tokens is not None:
                    resp = self.stream.decode_step(int(tokens[0]), fast=self.stream.step > 0)
                else:
                    resp = self.stream._applied(self.stream.exchange(
                        self.stream._input_frame(pb.PHASE_DECODE, None, rows, True)))
            else:
                resp = self.stream.prefill_chunk(tokens, rows=rows, sample=sample)
        except client_mod.ShardError as exc:
            if exc.terminated:
                self._fail(str(exc), exc.reason_name)
            raise BackendError(str(exc), reason=exc.reason_name) from None
        except (client_mod.WorkerError, TimeoutError) as exc:
            self._fail(f"worker {self.backend.endpoint}: {exc}", getattr(getattr(exc, "code", None), "name", "DEADLINE_EXCEEDED"))
        rec = self.record
        rec.steps += 1
        rec.busy_s += time.perf_counter() - t0
        if decode:
            rec.decode_tokens += n
        else:
            rec.prefill_tokens += n
        out = StepOutput(cached_positions=resp.header.cached_positions)
        if resp.HasField("boundary"):
            out.boundary = client_mod.boundary_rows(resp, self.cap.identity.n_embd)
        elif resp.HasField("tail") and resp.tail.tokens:
            t = resp.tail.tokens[0]
            out.token = t.token_id
            if t.finish_reason:
                out.finish_reason = pb.FinishReason.Name(t.finish_reason).removeprefix("FINISH_REASON_").lower()
        return out

    def _fail(self, message: str, reason: str) -> None:
        self.backend._close_record(self.record, "failed", message)
        raise BackendError(message, reason=reason, terminated=True)

    def release(self, *, completed: bool = True) -> None:
        try:
            if self.generation == self.backend._generation:
                self.stream.release()
        except (client_mod.ShardError, client_mod.WorkerError, TimeoutError):
            pass
        finally:
            self.stream.close()
            self.backend._close_record(self.record, "completed" if completed else "cancelled")

    def __enter__(self) -> "BackendSession":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.record.status == "running":
            self.release()


class GgufShardBackend:
    """:class:`ShardBackend` over one supervised dgr-worker process."""

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self._lock = threading.RLock()
        self._proc: WorkerProcess | None = None
        self._client: client_mod.WorkerClient | None = None
        self._generation = 0
        self._restarts: list[float] = []
        self._state = "NOT_LOADED"
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._records: dict[tuple[str, int], WorkRecord] = {}
        self._recipe: Any = None
        self._log = None
        self.events: list[str] = []

    # ---- process supervision ----
    def _args(self) -> WorkerArgs:
        c = self.config
        common = dict(layers=(c.start, c.end), max_sessions=c.max_sessions, ctx_per_session=c.ctx_per_session,
                      threads=c.threads or None, extra=tuple(c.extra_args))
        if c.fake:
            return WorkerArgs(fake_model=True, n_layer=c.fake_n_layer, **common)
        ident = {} if self._recipe is None else dict(fingerprint=self._recipe.fingerprint(),
                                                     artifact_id=self._recipe.artifact_id)
        return WorkerArgs(model=c.model, **ident, **common)

    def _spawn(self) -> None:
        c = self.config
        try:
            proc = WorkerProcess.start(self._args(), binary=c.binary or default_binary(c.backend), listen=c.listen,
                                       ready_timeout=120)
        except WorkerStartError as exc:
            raise BackendError(f"worker for layers {c.start}:{c.end} did not start: {exc}") from None
        old = self._client
        self._proc = proc
        self._client = proc.client()
        self._generation += 1
        if old is not None:
            old.close()
        self._event(f"worker started pid {proc.pid} on {proc.target} (generation {self._generation})")

    def _event(self, msg: str) -> None:
        line = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {msg}"
        self.events.append(line)
        if self._log is not None:
            self._log.write(f"[backend] {line}\n")
            self._log.flush()

    def _flush_logs(self) -> None:
        """Copy new worker stdout/stderr lines to the log file."""
        if self._log is None or self._proc is None:
            return
        p = self._proc
        for attr, tag in (("stdout_lines", "out"), ("stderr_lines", "err")):
            lines = getattr(p, attr)
            done = getattr(p, f"_flushed_{tag}", 0)
            for ln in lines[done:]:
                self._log.write(f"[worker {tag}] {ln}\n")
            setattr(p, f"_flushed_{tag}", len(lines))
        self._log.flush()

    def _monitor_loop(self) -> None:
        bad = 0
        while not self._stop.wait(self.config.health_period_s):
            with self._lock:
                self._flush_logs()
                proc, cl = self._proc, self._client
            alive = proc is not None and proc.proc.poll() is None
            healthy = False
            if alive and cl is not None:
                try:
                    healthy = cl.health(timeout=2.0) == "SERVING"
                except client_mod.WorkerError:
                    healthy = False
            bad = 0 if healthy else bad + 1
            if not alive or bad >= self.config.restart.unhealthy_checks:
                if self._stop.is_set():
                    return
                self._restart(f"exit code {proc.proc.poll()}" if not alive else f"{bad} failed health checks")
                bad = 0

    def _restart(self, why: str) -> None:
        pol = self.config.restart
        with self._lock:
            self._flush_logs()
            self._event(f"worker down ({why})")
            for rec in self._records.values():   # Hot KV State is gone with the process
                if rec.status == "running":
                    self._close_record(rec, "failed", f"worker down ({why})")
            if self._proc is not None:
                self._proc.kill()
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < pol.window_s]
            if len(self._restarts) >= pol.max_restarts:
                self._state = "FAILED"
                self._event(f"restart policy exhausted ({pol.max_restarts} restarts in {pol.window_s:.0f}s)")
                self._stop.set()
                return
            self._state = "RESTARTING"
        delay = min(pol.backoff_max_s, pol.backoff_s * (2 ** len(self._restarts)))
        if self._stop.wait(delay):
            return
        with self._lock:
            self._restarts.append(time.monotonic())
            try:
                self._spawn()
                self._state = "SERVING"
            except BackendError as exc:
                self._event(str(exc))
                self._state = "DOWN"

    # ---- the interface ----
    def load(self, *, node_id: str, registry: Any) -> ShardRegistration:
        c = self.config
        if not c.fake:
            if c.model is None:
                raise BackendError("BackendConfig.model is required (or fake=True)")
            from dgr.gguf.recipe import recipe_for

            self._recipe = recipe_for(c.model, backend=c.backend, progress=False)
        if c.log_path is not None:
            c.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(c.log_path, "a", encoding="utf-8")
        with self._lock:
            self._spawn()
            self._state = "SERVING"
        self._monitor = threading.Thread(target=self._monitor_loop, name="dgr-backend-monitor", daemon=True)
        self._monitor.start()
        return self.registration(node_id=node_id, registry=registry)

    @property
    def endpoint(self) -> str:
        return self._proc.target if self._proc else ""

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc else 0

    @property
    def restarts(self) -> int:
        return self._generation - 1 if self._generation else 0

    def _require_client(self) -> client_mod.WorkerClient:
        with self._lock:
            if self._state == "FAILED":
                raise BackendError("the worker failed permanently (restart policy exhausted); see the log")
            if self._client is None:
                raise BackendError("the backend is not loaded", reason="ERROR_REASON_UNAVAILABLE")
            return self._client

    def registration(self, *, node_id: str, registry: Any) -> ShardRegistration:
        cl = self._require_client()
        cap = cl.capability(refresh=True)
        ident = cap.identity
        recipe = self._recipe
        if recipe is None:   # fake model: a stand-in recipe (never certified)
            from dgr.gguf.recipe import RuntimeRecipe

            recipe = RuntimeRecipe(
                artifact_id=ident.artifact_id, tokenizer_digest="fake", arch_adapter=ident.architecture,
                arch_adapter_version=0, weight_types_digest="fake", weight_types=(), activation_dtype="f32",
                compute_dtype="f32", kv_dtype="f32", kv_layout="fake", backend=self.config.backend,
                dgr_version=cap.runtime.dgr_version, pin_commit=cap.runtime.llama_commit,
                patch_digest=cap.runtime.patch_digest, boundary_schema_version=1)
        elif recipe.fingerprint() != ident.compatibility_fingerprint:
            raise BackendError(f"worker reports fingerprint {ident.compatibility_fingerprint[:12]}, the recipe "
                               f"is {recipe.fingerprint()[:12]}: refusing to register",
                               reason="ERROR_REASON_FINGERPRINT_MISMATCH")
        # the device the range computes on, as the worker reports it: certification is per device
        # class ("" for an accelerator worker that reports none: registered, never certified)
        from dgr.gguf.recipe import device_class_of_capability

        recipe = recipe.with_(device_class=device_class_of_capability(cap))
        # the worker's own measurement of its range (started with --probe-budget-s), for route
        # ranking; an absurd one is refused with the registration, not carried to the Tracker
        try:
            reg = make_registration(node_id=node_id, endpoint=self.endpoint, recipe=recipe,
                                    architecture=ident.architecture, n_layer=ident.n_layer, start=ident.range.start,
                                    end=ident.range.end, capacity=self.capability(), registry=registry,
                                    measured=measurement_of_capability(cap))
        except BackendError:
            raise
        except DgrError as exc:
            raise BackendError(f"refusing to register: {exc}") from None
        return reg

    def capability(self) -> Capacity:
        cl = self._require_client()
        try:
            cap = cl.capability()
            load = cl.load()
        except client_mod.WorkerError as exc:
            raise BackendError(f"worker {self.endpoint}: {exc}", reason="ERROR_REASON_UNAVAILABLE") from None
        return Capacity(max_sessions=cap.capacity.max_sessions, active_sessions=load.active_sessions,
                        kv_cells_total=load.kv_cells_total, kv_cells_used=load.kv_cells_used,
                        max_batch_tokens=cap.capacity.max_batch_tokens)

    def open_session(self, session_id: str, *, epoch: int = 1, request_id: str = "",
                     sampling: client_mod.Sampling | None = None, step_timeout: float = 60.0) -> BackendSession:
        cl = self._require_client()
        with self._lock:
            rec = WorkRecord(session_id, epoch, request_id or session_id)
            self._records[(session_id, epoch)] = rec
            gen = self._generation
        stream = cl.open_session(session_id, epoch, sampling=sampling, step_timeout=step_timeout)
        return BackendSession(self, stream, rec, gen)

    def release_session(self, session_id: str, epoch: int = 0) -> bool:
        cl = self._require_client()
        try:
            r = cl.release(session_id, epoch)
        except client_mod.WorkerError as exc:
            raise BackendError(f"release failed: {exc}") from None
        self._close_matching(session_id, epoch, "completed")
        return r.released

    def cancel_session(self, session_id: str, epoch: int = 0) -> bool:
        cl = self._require_client()
        try:
            r = cl.cancel(session_id, epoch)
        except client_mod.WorkerError as exc:
            raise BackendError(f"cancel failed: {exc}") from None
        self._close_matching(session_id, epoch, "cancelled")
        return r.cancelled

    def _close_matching(self, session_id: str, epoch: int, status: str) -> None:
        with self._lock:
            for (sid, ep), rec in self._records.items():
                if sid == session_id and (epoch == 0 or ep == epoch) and rec.status == "running":
                    self._close_record(rec, status)

    def _close_record(self, rec: WorkRecord, status: str, error: str | None = None) -> None:
        with self._lock:
            if rec.status != "running":
                return
            rec.status, rec.error, rec.closed_at = status, error, time.time()

    def telemetry(self) -> dict[str, Any]:
        with self._lock:
            records = [asdict(r) for r in self._records.values()]
            state, gen = self._state, self._generation
        out: dict[str, Any] = {"state": state, "endpoint": self.endpoint, "pid": self.pid, "restarts": max(0, gen - 1),
                               "sessions": records, "load": None}
        try:
            m = self._require_client().metrics(timeout=2.0)
            out["load"] = {"active_sessions": m.load.active_sessions, "kv_cells_used": m.load.kv_cells_used,
                           "kv_cells_total": m.load.kv_cells_total, "queued_steps": m.load.queued_steps}
            out["metrics"] = {s.name: s.value for s in m.samples if not s.labels}
        except (BackendError, client_mod.WorkerError):
            pass
        return out

    def health(self) -> str:
        with self._lock:
            if self._state in ("FAILED", "NOT_LOADED", "RESTARTING", "DOWN"):
                return self._state
            cl = self._client
        try:
            return cl.health(timeout=2.0) if cl else "DOWN"
        except client_mod.WorkerError:
            return "DOWN"

    def close(self) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        with self._lock:
            self._flush_logs()
            if self._client is not None:
                self._client.close()
            if self._proc is not None:
                try:
                    self._proc.terminate(15)
                except Exception:
                    self._proc.kill()
                self._flush_logs()
            self._state = "CLOSED"
            if self._log is not None:
                self._log.close()
                self._log = None

    def __enter__(self) -> "GgufShardBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
