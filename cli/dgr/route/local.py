"""Local Inference Routes: one dgr-worker process per Shard of a split on this machine.

A split is a list of contiguous layer ranges (``0:15,15:30``); :class:`LocalRoute` starts one
worker per range (the model file, or per-range slice files) and stops them. Also the model facts
the route needs (layer count, KV bytes per cached position) and the worker binary, built when
missing.

Used by ``dgr route run``, ``dgr demo``, ``dgr bench route`` and ``dgr accept DGR-010``. No Typer here.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import DgrError
from .sessions import WorkerStats

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
    except Exception:
        return 0
    return 2 * (end - start) * (n_embd // n_head) * n_head_kv * kv_dtype_bytes


class LocalRoute:
    """One dgr-worker process per Shard of ``split`` on 127.0.0.1 (free ports).

    ``fake=True`` serves the deterministic fake model (tests); ``slices=True`` first writes
    per-range slice files (``dgr gguf slice``) so each worker maps only its own tensors.
    """

    def __init__(self, model: Path | None, split: Sequence[tuple[int, int]], *, fake: bool = False,
                 slices: bool = False, threads: int | None = None, max_sessions: int = 8,
                 ctx_per_session: int = 2048, extra_args: Sequence[str] = (), backend: str = "cpu",
                 slice_dir: Path | None = None, log: Callable[[str], None] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.model = model
        self.split = list(split)
        self.fake = fake
        self.slices = slices
        self.threads = threads
        self.max_sessions = max_sessions
        self.ctx_per_session = ctx_per_session
        self.extra_args = list(extra_args)
        self.backend = backend
        self.slice_dir = slice_dir
        self.log = log or (lambda _m: None)
        self.workers: list[Any] = []
        self.files: list[Path] = []
        self.fingerprint = ""
        self.artifact_id = ""
        # Co-located shards: libgomp's idle threads spin (~300k rounds) after every parallel region
        # and steal the cores the next shard computes on; a short spin keeps the hand-off cheap
        # (measured on 2 cores, SmolLM2 0:15|15:30: single-session decode 0.53 -> ~0.88 of the
        # whole model). An explicit GOMP_SPINCOUNT in the environment wins.
        self.env = dict(env or {})
        if len(self.split) > 1 and "GOMP_SPINCOUNT" not in os.environ:
            self.env.setdefault("GOMP_SPINCOUNT", COLOCATED_SPINCOUNT)

    def _args(self, i: int) -> list[str]:
        a, b = self.split[i]
        args = ["--layers", f"{a}:{b}", "--max-sessions", str(self.max_sessions),
                "--ctx-per-session", str(self.ctx_per_session)]
        if self.fake:
            n_layer = self.split[-1][1]
            return ["--fake-model", "--n-layer", str(n_layer), *args, *self.extra_args]
        args = ["--model", str(self.files[i]), *args, "--fingerprint", self.fingerprint,
                "--artifact-id", self.artifact_id]
        if self.threads:
            args += ["--threads", str(self.threads)]
        return args + self.extra_args

    def _prepare_model(self) -> None:
        from ..gguf.recipe import recipe_for

        assert self.model is not None
        recipe = recipe_for(self.model, backend=self.backend, progress=False)
        self.fingerprint, self.artifact_id = recipe.fingerprint(), recipe.artifact_id
        if not self.slices:
            self.files = [self.model] * len(self.split)
            return
        from ..gguf.slice import LayerRange, slice_gguf

        out_dir = self.slice_dir or Path(tempfile.gettempdir()) / "dgr-slices" / self.artifact_id[:16]
        out_dir.mkdir(parents=True, exist_ok=True)
        for a, b in self.split:
            path = out_dir / f"{self.model.stem}.{a}-{b}.gguf"
            if not path.is_file():
                self.log(f"slicing layers {a}:{b} -> {path}")
                slice_gguf(self.model, LayerRange(a, b), path, progress=False)
            self.files.append(path)

    def start(self) -> list[str]:
        from .supervisor import WorkerProcess, WorkerStartError

        from ..upstream.build import worker_binary

        binary = worker_binary(self.backend)
        if not self.fake:
            self._prepare_model()
        try:
            for i, (a, b) in enumerate(self.split):
                try:
                    self.workers.append(WorkerProcess.start(self._args(i), binary=binary, ready_timeout=120,
                                                            env=self.env))
                except WorkerStartError as exc:
                    raise DgrError(f"worker for layers {a}:{b} did not start: {exc}") from None
                self.log(f"worker [{a}:{b}) pid {self.workers[-1].pid} on {self.workers[-1].target}")
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
        out = []
        for (a, b), w in zip(self.split, self.workers):
            st = WorkerStats(f"{a}:{b}", w.target, w.pid)
            st.kv_bytes_per_cell = 0 if self.fake or self.model is None else kv_bytes_per_cell(self.model, a, b)
            out.append(st)
        return out


def ensure_worker(backend: str = "cpu", log: Callable[[str], None] | None = None) -> Path:
    """The dgr-worker binary, built first when missing (patched llama.cpp + worker)."""
    from ..upstream import build as build_mod

    try:
        return build_mod.worker_binary(backend)
    except DgrError:
        (log or (lambda _m: None))(f"dgr-worker is not built yet: building it for {backend} (one-time, minutes)")
        build_mod.build(backend)
        return build_mod.worker_binary(backend)
