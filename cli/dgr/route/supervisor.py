"""Start, watch and stop one dgr-worker process (tests, route code, benchmarks), and the one
typed builder of its command line (:class:`WorkerArgs`).

    with WorkerProcess.start(WorkerArgs(fake_model=True)) as w:
        client = w.client()
        ...

The worker listens on 127.0.0.1 with a free port (``--listen 127.0.0.1:0``); its first stdout
line names the port. :meth:`WorkerProcess.start` waits (with a deadline) for that line and for
grpc.health.v1 SERVING.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import grpc

from .. import childproc
from ..procfs import status_bytes
from ..protocol.client import WorkerClient
from ..protocol.errors import WorkerUnavailable

_LISTEN = re.compile(r"listening on (\S+):(\d+)")
_METRICS = re.compile(r"metrics on (\S+):(\d+)/metrics")


def default_binary(backend: str = "cpu") -> Path:
    """``$DGR_WORKER_BIN`` or <build dir>/<backend>/bin/dgr-worker (see build.worker_binary_path)."""
    from ..upstream.build import worker_binary_path

    return worker_binary_path(backend)


def stop_child(proc: subprocess.Popen, grace: float = 15.0) -> int | None:
    """Stops a child process: SIGTERM, up to ``grace`` seconds to exit, then SIGKILL; reaps it
    and returns its exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class WorkerStartError(RuntimeError):
    pass


@dataclass(frozen=True)
class WorkerArgs:
    """The options of ``dgr-worker serve`` (see ``dgr-worker serve --help``), typed.

    :meth:`argv` renders the arguments after ``serve`` in field order: a ``None`` field is left
    out (the worker's default holds), ``True`` is a bare flag, ``layers`` may be ``(a, b)`` or
    the text ``"a:b"``; ``extra`` is appended verbatim (options this class does not name yet).
    ``listen`` is left to :meth:`WorkerProcess.start` (which picks a free loopback port) unless
    set here.
    """

    model: Path | str | None = None
    fake_model: bool = False
    n_layer: int | None = None
    layers: tuple[int, int] | str | None = None
    listen: str | None = None
    allow_remote: bool = False
    fingerprint: str | None = None
    artifact_id: str | None = None
    recipe_json: str | None = None
    threads: int | None = None
    max_sessions: int | None = None
    ctx_per_session: int | None = None
    kv_budget_mb: float | None = None
    kv_cells: int | None = None
    memory_budget_mb: float | None = None
    queue_limit: int | None = None
    max_batch_tokens: int | None = None
    max_prefill_chunk: int | None = None
    pipeline_groups: int | None = None
    keep_warm_ms: int | None = None
    metrics_listen: str | None = None
    drain_timeout_s: float | None = None
    session_ttl_s: float | None = None
    tls_cert: Path | str | None = None
    tls_key: Path | str | None = None
    tls_client_ca: Path | str | None = None
    require_client_auth: bool = False
    chain_peers: str | None = None
    chain_tls_ca: Path | str | None = None
    io_nice: int | None = None
    fake_delay_ms: int | None = None
    probe_budget_s: float | None = None
    extra: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        """The arguments after ``dgr-worker serve``."""
        out: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or value is None or value is False:
                continue
            flag = "--" + f.name.replace("_", "-")
            if value is True:
                out.append(flag)
            elif f.name == "layers" and isinstance(value, tuple):
                out += [flag, f"{value[0]}:{value[1]}"]
            else:
                out += [flag, str(value)]
        return out + list(self.extra)


class WorkerProcess:
    def __init__(self, proc: subprocess.Popen, binary: Path) -> None:
        self.proc = proc
        self.binary = binary
        self.host = "127.0.0.1"
        self.port = 0
        self.metrics_port = 0
        self.credentials: grpc.ChannelCredentials | None = None
        self.stdout_lines: list[str] = []
        self.stderr_lines: list[str] = []
        self._listening = threading.Event()
        threading.Thread(target=self._pump, args=(proc.stdout, self.stdout_lines, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(proc.stderr, self.stderr_lines, False), daemon=True).start()

    def _pump(self, stream, sink: list[str], parse: bool) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            sink.append(line)
            if parse:
                m = _LISTEN.search(line)
                if m:
                    self.host, self.port = m.group(1), int(m.group(2))
                m = _METRICS.search(line)
                if m:
                    self.metrics_port = int(m.group(2))
                if line.startswith("dgr-worker: serving"):
                    self._listening.set()
        stream.close()

    @classmethod
    def start(cls, args: "WorkerArgs | Sequence[str]", *, binary: Path | None = None, listen: str = "127.0.0.1:0",
              ready_timeout: float = 60.0, env: dict[str, str] | None = None,
              credentials: grpc.ChannelCredentials | None = None) -> "WorkerProcess":
        """Starts `dgr-worker serve --listen LISTEN ARGS` and waits for health SERVING
        (through ``credentials`` when the worker serves TLS). ``args``: a :class:`WorkerArgs`
        (its ``listen``, when set, wins over ``listen``) or ready-made arguments."""
        binary = binary or default_binary()
        if not binary.is_file():
            raise WorkerStartError(f"{binary} missing: run `dgr build`")
        if isinstance(args, WorkerArgs):
            listen = args.listen or listen
            args = replace(args, listen=None).argv()
        cmd = [str(binary), "serve", "--listen", listen, *args]
        # a worker never outlives this process (dgr.childproc: SIGTERM when it dies)
        proc = childproc.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
        w = cls(proc, binary)
        w.credentials = credentials
        end = time.monotonic() + ready_timeout
        while not w._listening.wait(0.05):
            if proc.poll() is not None or time.monotonic() > end:
                w.kill()
                raise WorkerStartError(f"worker did not start (exit {proc.poll()}): "
                                       + " | ".join(w.stderr_lines[-10:]))
        client = w.client()
        try:
            while True:
                try:
                    if client.health() == "SERVING":
                        break
                except WorkerUnavailable:
                    # seen once in CI: the port refused the first health check right after the
                    # worker announced it; a worker still running gets asked again, a dead one
                    # is reported with its own last words
                    if proc.poll() is not None:
                        w.kill()
                        raise WorkerStartError(f"worker exited (exit {proc.poll()}) after announcing its port: "
                                               + " | ".join(w.stderr_lines[-10:])) from None
                if time.monotonic() > end:
                    w.kill()
                    raise WorkerStartError("worker never reported SERVING")
                time.sleep(0.05)
        finally:
            client.close()
        return w

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, **kw: object) -> WorkerClient:
        kw.setdefault("credentials", self.credentials)
        return WorkerClient(self.target, **kw)  # type: ignore[arg-type]

    def rss_bytes(self) -> int:
        """VmRSS from /proc/PID/status."""
        rss = status_bytes(self.pid, "VmRSS")
        if not rss:
            raise RuntimeError(f"no VmRSS for pid {self.pid} (exited?)")
        return rss

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait for the exit code (SIGKILL after the timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> "WorkerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            try:
                self.terminate(10.0)
            except subprocess.TimeoutExpired:
                pass
