"""Helpers shared by the fake-model worker and route tests."""

from __future__ import annotations

import time
from pathlib import Path

from dgr.route.supervisor import WorkerArgs, WorkerProcess

# the fake routes the fixtures start: whole [0:8), 0:4|4:8, and 0:3|3:5|5:8 with a small
# prefill chunk on the middle shard (so prompts go in several chunks)
FAKE_RANGES = {"0:4": (), "4:8": (), "0:3": (), "3:5": ("--max-prefill-chunk", "5"), "5:8": ()}


def start_fake(native_bin: Path, *args: str) -> WorkerProcess:
    return WorkerProcess.start(WorkerArgs(fake_model=True, extra=args), binary=native_bin / "dgr-worker")


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
