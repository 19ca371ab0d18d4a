"""What a worker would need in host memory for a layer range, as the worker itself computes it
(``dgr-worker plan-memory --json``, docs/memory.md): the same figure its admission uses, so that
route formation can choose splits that each host's budget admits before any worker starts."""

from __future__ import annotations

import json
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import DgrError
from .supervisor import default_binary

_log = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass(frozen=True)
class MemoryPlan:
    """One range's need in bytes (host memory) and the worker's verdict against a budget;
    ``copied_bytes``: the part of the weights llama.cpp holds as repacked copies (docs/memory.md)."""
    layer_start: int
    layer_end: int
    n_layer: int
    head: bool
    tail: bool
    n_parts: int
    max_sessions: int
    ctx_per_session: int
    kv_cells: int
    kv_bytes_per_cell: int
    weights_bytes: int
    copied_bytes: int
    kv_bytes: int
    compute_bytes: int
    runtime_bytes: int
    device_bytes: int
    total_bytes: int
    budget_bytes: int
    budget_source: str
    fits: bool
    refusal: str

    @property
    def shard_bytes(self) -> int:
        """What --memory-budget-mb is held against: weights, KV and compute (not the process)."""
        return self.weights_bytes + self.kv_bytes + self.compute_bytes


def plan_memory(model: Path, layers: tuple[int, int] | None = None, *, max_sessions: int | None = None,
                ctx_per_session: int | None = None, kv_unified: bool = False, max_batch_tokens: int | None = None,
                memory_budget_mb: float | None = None, binary: Path | None = None,
                timeout_s: float = 300.0) -> MemoryPlan:
    """``dgr-worker plan-memory`` for ``model`` (a GGUF, part 1 of a split set, or a slice) and
    ``layers`` ``(start, end)`` (None: the whole model). Nothing is loaded: the worker reads the
    header(s) and lets llama.cpp simulate its allocations. A size left None is the worker's own
    default (`dgr-worker options`). DgrError when the worker cannot plan."""
    exe = binary or default_binary()
    if not Path(exe).is_file():
        raise DgrError(f"{exe} not built", hint="run `dgr build --backend cpu`")
    cmd = [str(exe), "plan-memory", "--json", "--model", str(model)]
    for flag, value in (("--max-sessions", max_sessions), ("--ctx-per-session", ctx_per_session),
                        ("--max-batch-tokens", max_batch_tokens)):
        if value is not None:
            cmd += [flag, str(value)]
    if layers is not None:
        cmd += ["--layers", f"{layers[0]}:{layers[1]}"]
    if kv_unified:
        cmd.append("--kv-unified")
    if memory_budget_mb:
        cmd += ["--memory-budget-mb", f"{memory_budget_mb:g}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode not in (0, 3):
        errs = [ln for ln in r.stderr.splitlines() if "error" in ln]
        raise DgrError(f"dgr-worker plan-memory failed for {model} layers {layers}: "
                       + (errs[-1] if errs else f"exit {r.returncode}"))
    try:
        j = json.loads(r.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError) as exc:
        raise DgrError(f"dgr-worker plan-memory printed no JSON for {model}: {exc}") from None
    plan = MemoryPlan(**{k: j[k] for k in MemoryPlan.__dataclass_fields__})
    _log.debug("memory plan %s [%d, %d): %.1f MiB", model, plan.layer_start, plan.layer_end, plan.total_bytes / MIB)
    return plan


@dataclass(frozen=True)
class MemoryMeasurement:
    """Predicted host need (the worker's GetCapability) vs the worker's measured peak RSS."""
    layers: tuple[int, int]
    predicted_bytes: int
    peak_rss_bytes: int       # VmHWM after the decode steps
    rss_bytes: int            # VmRSS then
    rss_anon_bytes: int       # of which anonymous (KV, compute, copies, heap)
    rss_file_bytes: int       # and file pages (mapped weights)
    plan: dict[str, int]      # the worker's predicted parts (dgr_memory_predicted_bytes)

    @property
    def error(self) -> float:
        """(measured - predicted) / predicted."""
        return (self.peak_rss_bytes - self.predicted_bytes) / self.predicted_bytes


def _status_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def measure_memory(model: Path, layers: tuple[int, int] | None = None, *, max_sessions: int = 4,
                   ctx_per_session: int | None = None, prompt_tokens: int = 256, decode_steps: int = 8,
                   threads: int = 0, binary: Path | None = None, ready_timeout: float = 1800.0) -> MemoryMeasurement:
    """Starts the worker on ``model``/``layers``, runs a prompt of ``prompt_tokens`` and
    ``decode_steps`` decode steps in each of ``max_sessions`` sessions at once (so that batches
    reach the compute buffers' size), and reads its peak RSS (VmHWM): the check of the
    prediction at realistic size. A non-head range is fed seeded random boundary rows."""
    import threading

    import numpy as np

    from ..protocol.client import sampled
    from .supervisor import WorkerProcess

    args = ["--model", str(model), "--max-sessions", str(max_sessions)]
    if ctx_per_session is not None:   # None: the worker's default
        args += ["--ctx-per-session", str(ctx_per_session)]
    if layers is not None:
        args += ["--layers", f"{layers[0]}:{layers[1]}"]
    if threads:
        args += ["--threads", str(threads)]
    with WorkerProcess.start(args, binary=binary or default_binary(), ready_timeout=ready_timeout) as w:
        c = w.client(timeout=600)
        cap = c.capability()
        ident, capacity = cap.identity, cap.capacity
        rng = np.random.default_rng(0)
        n_embd, n_vocab = ident.n_embd, ident.n_vocab
        n_prompt = min(prompt_tokens, capacity.max_session_positions - decode_steps - 1)
        errors: list[BaseException] = []

        def rows(n: int) -> np.ndarray:
            return (rng.standard_normal((n, n_embd)) * 0.5).astype(np.float32)

        def run(i: int) -> None:
            try:
                with c.open_session(f"m{i}") as s:
                    chunk = capacity.max_prefill_chunk_tokens
                    for a in range(0, n_prompt, chunk):
                        n = min(chunk, n_prompt - a)
                        if ident.head:
                            r = s.prefill_chunk([(7 * (a + k) + i) % n_vocab for k in range(n)], sample=ident.tail)
                        else:
                            r = s.prefill_chunk(rows=rows(n), sample=ident.tail)
                    tok = 1
                    for _ in range(decode_steps):
                        if ident.tail:
                            tok = sampled(r) or 1
                        # a non-head range: one boundary row is a decode step's work
                        r = s.decode_step(tok) if ident.head else s.prefill_chunk(rows=rows(1), sample=ident.tail)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads_ = [threading.Thread(target=run, args=(i,)) for i in range(max_sessions)]
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        if errors:
            raise DgrError(f"memory measurement of {model}: a session failed: {errors[0]}")
        parts = {p: int(c.metric("dgr_memory_predicted_bytes", part=p) or 0)
                 for p in ("weights", "kv", "compute", "runtime")}
        m = MemoryMeasurement((ident.range.start, ident.range.end), int(capacity.predicted_memory_bytes),
                              _status_bytes(w.pid, "VmHWM"), _status_bytes(w.pid, "VmRSS"),
                              _status_bytes(w.pid, "RssAnon"), _status_bytes(w.pid, "RssFile"), parts)
    _log.info("memory of %s [%d, %d): predicted %.1f MiB, peak RSS %.1f MiB (%+.1f %%)", model, *m.layers,
              m.predicted_bytes / MIB, m.peak_rss_bytes / MIB, 100 * m.error)
    return m
