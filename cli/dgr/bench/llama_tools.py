"""The one wrapper for the stock llama.cpp yardstick tools at the pin.

Every run of ``llama-bench`` and ``llama-batched-bench`` goes through here: the command line is
built in one place, the process runs under a deadline, its wall time and its own peak RSS are
taken with ``wait4``, and its output becomes typed rows (:class:`BenchRow`,
:class:`BatchedRow`). A failure (non-zero exit, deadline, no rows) is a :class:`DgrError`
naming the tool, its exit and the end of its stderr.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..errors import DgrError

DEFAULT_TIMEOUT_S = 1800.0


@dataclass
class Measured:
    """One finished command: its output, wall time and the child's own peak RSS."""
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    wall_seconds: float
    peak_rss_bytes: int
    timed_out: bool = False

    @property
    def shown(self) -> str:
        return " ".join(shlex.quote(a) for a in self.argv)


@dataclass
class CommandLog:
    """Every command a run executed (written into a results JSON)."""
    entries: list[dict[str, Any]] = field(default_factory=list)

    def add(self, m: Measured) -> None:
        self.entries.append({"command": m.shown, "exit": m.returncode,
                             "wall_seconds": round(m.wall_seconds, 3), "peak_rss_bytes": m.peak_rss_bytes})


def run_measured(argv: Sequence[str | Path], *, env: dict | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 log: CommandLog | None = None, cwd: Path | None = None, prefix: Sequence[str] = ()) -> Measured:
    """Run a command to completion (killed at ``timeout`` seconds: ``timed_out``), returning its
    output, wall time and peak RSS (``wait4``: this child's own, not the caller's).

    ``prefix``: an argv prefix that runs the command elsewhere and execs it (a lab host's
    namespace, CPUs and cgroups: :meth:`dgr.lab.hosts.Lab.prefix`); the recorded command is
    ``argv`` itself."""
    args = [str(a) for a in argv]
    shown = args
    args = [*prefix, *args]
    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f, env=dict(os.environ, **(env or {})), cwd=cwd)
        except (FileNotFoundError, PermissionError) as exc:
            raise DgrError(f"cannot run {args[0]}: {exc}") from None
        deadline = t0 + timeout
        timed_out = False
        while True:
            pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                _, status, rusage = os.wait4(proc.pid, 0)
                timed_out = True
                break
            time.sleep(0.02)
        wall = time.monotonic() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out_f.seek(0)
        err_f.seek(0)
        m = Measured(shown, proc.returncode, out_f.read().decode(errors="replace"),
                     err_f.read().decode(errors="replace"), wall, int(rusage.ru_maxrss) * 1024, timed_out)
    if log is not None:
        log.add(m)
    return m


def _checked(tool: str, m: Measured, timeout: float) -> Measured:
    if m.timed_out:
        raise DgrError(f"{tool} took over {timeout:.0f}s and was stopped")
    if m.returncode != 0:
        raise DgrError(f"{tool} failed (exit {m.returncode}): {m.stderr.strip()[-300:]}")
    return m


# ---- llama-bench -----------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchRow:
    """One ``llama-bench -o json`` test: prefill (n_prompt > 0, n_gen = 0) or decode (n_gen > 0)."""
    n_prompt: int
    n_gen: int
    n_depth: int
    avg_ts: float
    stddev_ts: float | None

    @property
    def is_prefill(self) -> bool:
        return self.n_prompt > 0 and self.n_gen == 0

    @property
    def is_decode(self) -> bool:
        return self.n_gen > 0 and self.n_prompt == 0


def parse_llama_bench(stdout: str) -> list[BenchRow]:
    """The rows of ``llama-bench -o json`` (anything printed before the JSON array is skipped)."""
    start = stdout.find("[")
    if start < 0:
        raise DgrError("llama-bench printed no JSON rows")
    try:
        doc = json.loads(stdout[start:])
    except json.JSONDecodeError as exc:
        raise DgrError(f"llama-bench printed malformed JSON: {exc}") from None
    return [BenchRow(int(r.get("n_prompt", 0)), int(r.get("n_gen", 0)), int(r.get("n_depth", 0)),
                     float(r["avg_ts"]), None if r.get("stddev_ts") is None else float(r["stddev_ts"]))
            for r in doc]


def _values(v: int | Sequence[int]) -> str:
    return str(v) if isinstance(v, int) else ",".join(str(x) for x in v)


def llama_bench_command(exe: Path, model: Path, *, threads: int, n_prompt: int | Sequence[int], n_gen: int,
                        reps: int, depth: int | None = None, gpu_layers: str | None = None,
                        extra: Sequence[str] = ()) -> list[str]:
    """``n_prompt``: one prompt length or several (one pp test each); ``extra``: more options
    (e.g. ``--rpc HOST:PORT``), placed before the output options."""
    cmd = [str(exe), "-m", str(model), "-t", str(threads)]
    if gpu_layers is not None:
        cmd += ["-ngl", gpu_layers]
    cmd += ["-p", _values(n_prompt), "-n", str(n_gen)]
    if depth is not None:
        cmd += ["-d", str(depth)]
    return cmd + [*extra, "-r", str(reps), "-o", "json"]


def llama_bench(exe: Path, model: Path, *, threads: int, n_prompt: int | Sequence[int], n_gen: int, reps: int,
                depth: int | None = None, gpu_layers: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                log: CommandLog | None = None, extra: Sequence[str] = (),
                prefix: Sequence[str] = ()) -> tuple[list[BenchRow], Measured]:
    """Run ``llama-bench`` (inside ``prefix``, as :func:`run_measured`); its rows and the
    measured process."""
    m = run_measured(llama_bench_command(exe, model, threads=threads, n_prompt=n_prompt, n_gen=n_gen, reps=reps,
                                         depth=depth, gpu_layers=gpu_layers, extra=extra),
                     timeout=timeout, log=log, prefix=prefix)
    return parse_llama_bench(_checked("llama-bench", m, timeout).stdout), m


# ---- llama-batched-bench ---------------------------------------------------------------------

@dataclass(frozen=True)
class BatchedRow:
    """One ``llama-batched-bench --output-format jsonl`` line: ``pl`` sequences at once."""
    pl: int
    pp: int
    tg: int
    n_kv: int
    t_pp: float
    speed_pp: float
    t_tg: float
    speed_tg: float
    t: float
    speed: float


def parse_batched_bench(text: str) -> dict[int, BatchedRow]:
    """The JSON lines of ``llama-batched-bench`` by batch size ``pl`` (log lines are skipped)."""
    rows: dict[int, BatchedRow] = {}
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("{") and '"speed_tg"' in line):
            continue
        r = json.loads(line)
        rows[int(r["pl"])] = BatchedRow(int(r["pl"]), int(r["pp"]), int(r["tg"]), int(r["n_kv"]),
                                        float(r["t_pp"]), float(r["speed_pp"]), float(r["t_tg"]),
                                        float(r["speed_tg"]), float(r["t"]), float(r["speed"]))
    return rows


BATCHED_BENCH_ATTEMPTS = 3


def batched_bench_command(exe: Path, model: Path, *, threads: int, n_prompt: int, n_gen: int,
                          npl: Sequence[int], ctx: int, batch: int = 512, ubatch: int = 512,
                          gpu_layers: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    cmd = [str(exe), "-m", str(model), "-c", str(ctx), "-b", str(batch), "-ub", str(ubatch), "-npp", str(n_prompt),
           "-ntg", str(n_gen), "-npl", ",".join(str(b) for b in npl), "-t", str(threads)]
    if gpu_layers is not None:
        cmd += ["-ngl", gpu_layers]
    return cmd + ["--output-format", "jsonl", *extra]


def batched_bench(exe: Path, model: Path, *, threads: int, n_prompt: int, n_gen: int, npl: Sequence[int],
                  ctx: int, batch: int = 512, ubatch: int = 512, gpu_layers: str | None = None,
                  timeout: float = DEFAULT_TIMEOUT_S, log: CommandLog | None = None, extra: Sequence[str] = (),
                  prefix: Sequence[str] = (), attempts: int = BATCHED_BENCH_ATTEMPTS) -> tuple[dict[int, BatchedRow], Measured]:
    """Run ``llama-batched-bench`` (inside ``prefix``, as :func:`run_measured`); its rows by
    batch size (every one of ``npl`` present) and the measured process.

    The tool prints its rows through llama.cpp's asynchronous logger, which the pinned tree
    leaks on purpose and never flushes at exit (``common_log_main``): now and then (about 1 run
    in 10 on a tiny model) a run exits 0 having printed nothing. Such a run is run again, up to
    ``attempts`` (default BATCHED_BENCH_ATTEMPTS) in all; every attempt is in ``log``. (Seen on a
    4-layer synthetic model on 2 loaded cores: 7 of 30 runs printed nothing.)"""
    cmd = batched_bench_command(exe, model, threads=threads, n_prompt=n_prompt, n_gen=n_gen, npl=npl, ctx=ctx,
                                batch=batch, ubatch=ubatch, gpu_layers=gpu_layers, extra=extra)
    for attempt in range(1, attempts + 1):
        m = run_measured(cmd, timeout=timeout, log=log, prefix=prefix)
        _checked("llama-batched-bench", m, timeout)
        rows = parse_batched_bench(m.stdout + "\n" + m.stderr)
        missing = [b for b in npl if b not in rows]
        if not missing:
            return rows, m
    raise DgrError(f"llama-batched-bench printed no rows for concurrency {missing} "
                   f"({attempts} runs; is -c {ctx} large enough for every batch?)")
