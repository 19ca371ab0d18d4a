"""Local Inference Routes: one dgr-worker process per Shard of a split on this machine.

A split is a list of contiguous layer ranges (``0:15,15:30``); :class:`LocalRoute` starts one
worker per range (the model file, or per-range slice files) and stops them. Also the model facts
the route needs (layer count, KV bytes per cached position) and the worker binary, built when
missing.

Used by ``dgr route run``, ``dgr demo``, ``dgr bench route`` and ``dgr accept DGR-010``. No Typer here.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import DgrError
from .sessions import WorkerStats

if TYPE_CHECKING:
    from .supervisor import WorkerArgs

_log = logging.getLogger(__name__)

COLOCATED_SPINCOUNT = "10000"


def parse_split(text: str) -> list[tuple[int, int]]:
    """``"0:15,15:30"`` -> [(0, 15), (15, 30)]; must be contiguous from 0."""
    out: list[tuple[int, int]] = []
    for part in text.split(","):
        try:
            a, b = (int(x) for x in part.strip().split(":"))
        except ValueError:
            raise DgrError(f"bad split {text!r}", hint="write START:END,START:END,… e.g. 0:15,15:30") from None
        if a < 0 or b <= a:
            raise DgrError(f"bad shard range {part!r} in the split: need 0 <= START < END")
        out.append((a, b))
    pos = 0
    for a, b in out:
        if a != pos:
            raise DgrError(f"split {text!r} is not contiguous at layer {pos}", hint="ranges must chain: 0:A,A:B,…")
        pos = b
    return out


def model_n_layer(model: Path) -> int:
    from ..gguf.inspect import open_gguf

    with open_gguf(model) as gf:
        return int(gf.n_layer)


def kv_bytes_per_cell(model: Path, start: int, end: int, kv_dtype_bytes: int = 2) -> int:
    """K and V bytes one cached position costs for layers [start, end) (f16 KV by default)."""
    from ..gguf.inspect import open_gguf

    try:
        with open_gguf(model) as gf:
            n_embd = int(gf.hparam("embedding_length"))
            n_head = int(gf.hparam("attention.head_count"))
            n_head_kv = int(gf.hparam("attention.head_count_kv", n_head))
            head_dim = int(gf.hparam("attention.key_length", n_embd // n_head))
    except Exception:
        return 0
    return 2 * (end - start) * head_dim * n_head_kv * kv_dtype_bytes


VULKAN_DEFAULT_DEVICE = "0"   # GGML_VK_VISIBLE_DEVICES when unset: the first Vulkan device


def backend_env(backend: str, env: dict[str, str]) -> dict[str, str]:
    """The environment of a worker on ``backend``: a Vulkan worker sees one device
    (GGML_VK_VISIBLE_DEVICES, default the first; Mesa's llvmpipe on a machine without a GPU)."""
    out = dict(env)
    if backend == "vulkan" and "GGML_VK_VISIBLE_DEVICES" not in os.environ:
        out.setdefault("GGML_VK_VISIBLE_DEVICES", VULKAN_DEFAULT_DEVICE)
    return out


def parse_backends(spec: str, n_shards: int) -> list[str]:
    """``vulkan`` (every Shard) or ``cpu,vulkan`` (one per Shard, route order)."""
    from ..gguf.recipe import BACKENDS

    items = [b.strip() for b in spec.split(",") if b.strip()]
    bad = [b for b in items if b not in BACKENDS]
    if not items or bad:
        raise DgrError(f"--backend {spec!r}: unknown backend {bad[0] if bad else '(none)'}; "
                       f"choose from {', '.join(BACKENDS)}")
    if len(items) == 1:
        return items * n_shards
    if len(items) != n_shards:
        raise DgrError(f"--backend {spec!r} names {len(items)} backends for {n_shards} shards: give one, or one per shard")
    return items


def shared_cpus(n_shards: int, threads: int | None, fake: bool = False) -> list[int]:
    """The CPUs every Shard of a co-located route runs on, or [] (no pinning).

    The Shards of a route on one host take turns: one batch travels the route, and the
    scheduler keeps two groups from computing on shared cores at once (docs/routes.md). When
    each Shard has fewer threads than this process may use, all of them run on the same first
    ``threads`` CPUs: the hand-off from one Shard to the next then lands on a core that is awake
    and has the caches warm, and the other CPUs stay free for the driver or the gateway.
    Measured, SmolLM2 0:15|15:30, 1 thread per Shard, 2 cores, one session: 15.0-16.0 ms per
    token with each Shard free to run anywhere, 13.6-14.4 with both on one core (the whole model
    on one worker: 12.7). A single Shard, or threads covering every CPU, is left alone."""
    if fake or n_shards < 2 or not threads:
        return []
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []
    return allowed[:threads] if threads < len(allowed) else []


def pin_process(pid: int, cpus: Sequence[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads it starts later inherit the mask).
    Best effort: a thread that ends meanwhile, or a refusal, leaves that thread as it was."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass


class LocalRoute:
    """One dgr-worker process per Shard of ``split`` on 127.0.0.1 (free ports).

    ``fake=True`` serves the deterministic fake model (tests); ``slices=True`` first writes
    per-range slice files (``dgr gguf slice``) so each worker maps only its own tensors.
    """

    def __init__(self, model: Path | None, split: Sequence[tuple[int, int]], *, fake: bool = False,
                 slices: bool = False, threads: int | None = None, max_sessions: int = 8,
                 ctx_per_session: int | None = None, extra_args: Sequence[str] = (),
                 backend: str | Sequence[str] = "cpu",
                 slice_dir: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.model = model
        self.split = list(split)
        self.fake = fake
        self.slices = slices
        self.threads = threads
        self.max_sessions = max_sessions
        self.ctx_per_session = ctx_per_session
        self.extra_args = list(extra_args)
        # one backend for every Shard, or one per Shard in route order (a mixed route)
        self.backends = [backend] * len(self.split) if isinstance(backend, str) else list(backend)
        if len(self.backends) != len(self.split):
            raise DgrError(f"{len(self.backends)} backends for {len(self.split)} shards: give one, or one per shard")
        self.backend = self.backends[0]
        self.plan = ""
        self.slice_dir = slice_dir
        self.workers: list[Any] = []
        self.files: list[Path] = []
        self.fingerprint = ""
        self.artifact_id = ""
        self.recipe_json = ""
        # Co-located shards: libgomp's idle threads spin (~300k rounds) after every parallel region
        # and steal the cores the next shard computes on; a short spin keeps the hand-off cheap
        # (measured on 2 cores, SmolLM2 0:15|15:30: single-session decode 0.53 -> ~0.88 of the
        # whole model). An explicit GOMP_SPINCOUNT in the environment wins.
        self.env = dict(env or {})
        if len(self.split) > 1 and "GOMP_SPINCOUNT" not in os.environ:
            self.env.setdefault("GOMP_SPINCOUNT", COLOCATED_SPINCOUNT)
        self.cpus = shared_cpus(len(self.split), threads, fake)


    def _args(self, i: int) -> "WorkerArgs":
        from .supervisor import WorkerArgs

        a, b = self.split[i]
        common = dict(layers=(a, b), max_sessions=self.max_sessions, ctx_per_session=self.ctx_per_session,
                      extra=tuple(self.extra_args))
        if self.fake:
            return WorkerArgs(fake_model=True, n_layer=self.split[-1][1], **common)
        return WorkerArgs(model=self.files[i], fingerprint=self.fingerprint, artifact_id=self.artifact_id,
                          recipe_json=self.recipe_json or None, threads=self.threads or None, **common)

    def _prepare_model(self) -> None:
        from ..gguf.recipe import recipe_for

        assert self.model is not None
        from ..gguf.recipe import backend_plan

        self.plan = backend_plan(self.backends)
        recipe = recipe_for(self.model, backend=self.backend, backends=self.plan, progress=False)
        self.fingerprint, self.artifact_id = recipe.fingerprint(), recipe.artifact_id
        # the worker proves every field from the file; the recipe tells it the backend plan
        self.recipe_json = json.dumps(recipe.to_json(), sort_keys=True, separators=(",", ":"))
        self.files = slice_files(self.model, self.split, self.artifact_id, self.slice_dir) if self.slices \
            else [self.model] * len(self.split)

    def start(self) -> list[str]:
        from .supervisor import WorkerProcess, WorkerStartError

        from ..upstream.build import worker_binary

        binaries = [worker_binary(b) for b in self.backends]
        if not self.fake:
            self._prepare_model()
        try:
            for i, (a, b) in enumerate(self.split):
                try:
                    self.workers.append(WorkerProcess.start(self._args(i), binary=binaries[i], ready_timeout=120,
                                                            env=backend_env(self.backends[i], self.env)))
                except WorkerStartError as exc:
                    raise DgrError(f"worker for layers {a}:{b} did not start: {exc}") from None
                if self.cpus:
                    pin_process(self.workers[-1].pid, self.cpus)
                _log.info(f"worker [{a}:{b}) {self.backends[i]} pid {self.workers[-1].pid} on {self.workers[-1].target}"
                          + (f", CPUs {','.join(map(str, self.cpus))}" if self.cpus else ""))
        except BaseException:
            self.stop()
            raise
        return self.endpoints

    @property
    def endpoints(self) -> list[str]:
        return [w.target for w in self.workers]

    def stop(self) -> None:
        for w in self.workers:
            try:
                w.terminate(10)
            except Exception:
                w.kill()

    def __enter__(self) -> "LocalRoute":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> list[WorkerStats]:
        return worker_stats(None if self.fake else self.model, self.split, [w.target for w in self.workers],
                            [w.pid for w in self.workers])


def cached_slice(model: Path, rng: "LayerRange", path: Path, artifact_id: str) -> Path:
    """The slice of ``rng`` at ``path``: a cached file is reused only when it verifies against
    the manifest it carries, is a slice of ``artifact_id`` and covers ``rng`` (every tensor's
    bytes hashed: `dgr gguf verify-slice`); never on its path, size or mtime. Anything else
    (missing, tampered, another artifact or range) is cut again from ``model``, with a warning
    naming what failed."""
    from ..gguf.slice import SliceError, slice_gguf, verify_slice

    if path.is_file():
        try:
            rep = verify_slice(path, expect_range=rng, progress=False)
            if rep.source_artifact_id == artifact_id:
                return path
            problem = f"it is a slice of {rep.source_artifact_id[:16]}, not of {artifact_id[:16]}"
        except (SliceError, DgrError) as exc:
            problem = str(exc)
        _log.warning("cached slice %s refused: %s; cutting it again", path, problem)
        path.unlink()
    _log.info("slicing layers %s:%s -> %s", rng.start, rng.end, path)
    slice_gguf(model, rng, path, progress=False)
    return path


def worker_stats(model: Path | None, split: Sequence[tuple[int, int]], endpoints: Sequence[str],
                 pids: Sequence[int]) -> list[WorkerStats]:
    """One :class:`WorkerStats` per worker of a route (KV bytes per cell from ``model``; 0
    without one, e.g. fake-model workers)."""
    out = []
    for (a, b), ep, pid in zip(split, endpoints, pids):
        st = WorkerStats(f"{a}:{b}", ep, pid)
        st.kv_bytes_per_cell = 0 if model is None else kv_bytes_per_cell(model, a, b)
        out.append(st)
    return out


def slice_files(model: Path, split: Sequence[tuple[int, int]], artifact_id: str,
                out_dir: Path | None = None) -> list[Path]:
    """One slice file per range of ``split``, made once and reused only when it verifies
    (:func:`cached_slice`): in ``out_dir``, default <tmp>/dgr-slices/<artifact id prefix>/."""
    from ..gguf.slice import LayerRange

    out_dir = out_dir or Path(tempfile.gettempdir()) / "dgr-slices" / artifact_id[:16]
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for a, b in split:
        path = out_dir / f"{model.stem}.{a}-{b}.gguf"
        files.append(cached_slice(model, LayerRange(a, b), path, artifact_id))
    return files


def ensure_worker(backend: str = "cpu") -> Path:
    """The dgr-worker binary, built first when missing (patched llama.cpp + worker)."""
    from ..upstream import build as build_mod

    try:
        return build_mod.worker_binary(backend)
    except DgrError:
        _log.info(f"dgr-worker is not built yet: building it for {backend} (one-time, minutes)")
        build_mod.build(backend)
        return build_mod.worker_binary(backend)
