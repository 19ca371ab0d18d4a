"""Helpers shared by the fake-model worker and route tests."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dgr.route.supervisor import WorkerArgs, WorkerProcess

# the fake routes the fixtures start: whole [0:8), 0:4|4:8, and 0:3|3:5|5:8 with a small
# prefill chunk on the middle shard (so prompts go in several chunks)
FAKE_RANGES = {"0:4": (), "4:8": (), "0:3": (), "3:5": ("--max-prefill-chunk", "5"), "5:8": ()}


# tokens generated per session by the fake-worker tests
N_GEN = 24


def fake_worker_binary(native_bin: Path) -> Path:
    """The worker the fake-model tests run: DGR_WORKER_BIN (e.g. a sanitizer build), else the native one."""
    env = os.environ.get("DGR_WORKER_BIN")
    return Path(env) if env else native_bin / "dgr-worker"


def start_worker(worker_bin: Path, *args: str) -> WorkerProcess:
    return WorkerProcess.start(["--fake-model", *args], binary=worker_bin)


def run_alone(client, prompt, n=N_GEN, sampling=None):
    """Prefill then greedy-generate `n` tokens on a session of its own; returns every token."""
    with client.open_session(sampling=sampling) as s:
        first = s.prefill(prompt)
        out = [first, *s.generate(first, n)]
        s.release()
    return out


def start_fake(native_bin: Path, *args: str) -> WorkerProcess:
    return WorkerProcess.start(WorkerArgs(fake_model=True, extra=args), binary=native_bin / "dgr-worker")


@contextmanager
def fake_split_gateway(native_bin: Path, **gateway_kw) -> Iterator:
    """`dgr serve`'s Gateway over a 2-shard fake route (layers 0:4 | 4:8); the workers are
    killed on exit."""
    from dgr.serve.server import Gateway

    ws = [start_fake(native_bin, "--layers", r) for r in ("0:4", "4:8")]
    try:
        with Gateway([w.target for w in ws], **gateway_kw) as g:
            yield g
    finally:
        for w in ws:
            w.kill()


def start_fake_routes(native_bin: Path) -> dict[str, WorkerProcess]:
    procs: dict[str, WorkerProcess] = {}
    try:
        procs["whole"] = start_fake(native_bin)
        for r, extra in FAKE_RANGES.items():
            procs[r] = start_fake(native_bin, "--layers", r, *extra)
    except BaseException:
        for p in procs.values():
            p.kill()
        raise
    return procs


def poll(fn, deadline_s: float = 10.0, what: str = "condition"):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        v = fn()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
