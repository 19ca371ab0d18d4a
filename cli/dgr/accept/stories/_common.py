"""Helpers shared by acceptance stories (not a story itself).

:func:`tests_criterion` runs named pytest tests as one step of a story and records it as one
criterion: it passes only when every named test ran and passed — a skipped test (no build, no
model) is not evidence, so it fails the criterion and says which test skipped and why.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any, Sequence

from ... import paths
from ..evidence import StoryContext

_SUMMARY = re.compile(r"=+ (.*(?:passed|failed|error|skipped).*?) (?:in [\d.]+s.*)?=+$")


def tests_criterion(ctx: StoryContext, criterion: str, tests: list[str], *, real: bool = False,
                    timeout: float = 1800) -> bool:
    """Runs ``tests`` (pytest node ids relative to the repo) and checks ``criterion`` on the outcome."""
    root = paths.repo_root()
    env = {"MESHNET_ENABLE_REAL_INFERENCE_TESTS": "1" if real else "0", "CI": "true"}  # CI=true: no silent skips
    p = ctx.command([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *tests],
                    cwd=root, env=env, timeout=timeout)
    out = p.stdout + p.stderr
    summary = next((m.group(1) for ln in reversed(out.splitlines()) if (m := _SUMMARY.search(ln.strip()))), None)
    if summary is None:
        summary = (out.strip().splitlines() or ["no output"])[-1]
    skipped = [ln.strip() for ln in out.splitlines() if ln.startswith("SKIPPED")]
    failed = [ln.strip() for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    ok = p.returncode == 0 and "passed" in summary and not skipped
    names = ", ".join(t.split("::")[-1] if "::" in t else t for t in tests)
    detail = f"pytest: {summary} ({names})"
    if skipped:
        detail += "; skipped (not evidence): " + "; ".join(skipped[:3])
    if failed:
        detail += "; " + "; ".join(failed[:3])
    return ctx.check(criterion, ok, detail)


def command_criterion(ctx: StoryContext, criterion: str, cmd: list[str], *, expect_rc: int = 0,
                      needle: str | None = None, timeout: float = 600) -> bool:
    """Runs one command; the criterion holds when it exits ``expect_rc`` (and prints ``needle``)."""
    p = ctx.command(cmd, cwd=paths.repo_root(), timeout=timeout)
    out = (p.stdout + p.stderr).strip()
    ok = p.returncode == expect_rc and (needle is None or needle in out)
    last = out.splitlines()[-1] if out else ""
    shown = ["dgr", *map(str, cmd[3:])] if [str(c) for c in cmd[1:3]] == ["-m", "dgr.main"] else [str(c) for c in cmd]
    return ctx.check(criterion, ok, f"`{' '.join(shown)}` exit {p.returncode}: {last[:300]}")


def dgr(*args: str) -> list[str]:
    return [sys.executable, "-m", "dgr.main", *args]


def left_on_workers(endpoints: Sequence[str], credentials: Any = None, wait_s: float = 10.0) -> list[tuple[int, int]]:
    """(sessions, KV cells) still held per worker, after a bounded wait for releases to land."""
    from ...protocol.client import WorkerClient

    out = []
    for ep in endpoints:
        with WorkerClient(ep, timeout=10, credentials=credentials) as c:
            end = time.monotonic() + wait_s
            ld = c.load()
            while (ld.active_sessions or ld.kv_cells_used) and time.monotonic() < end:
                time.sleep(0.05)
                ld = c.load()
            out.append((ld.active_sessions, ld.kv_cells_used))
    return out


def env_count(name: str, lo: int, hi: int) -> int | None:
    """A whole number from the environment variable ``name`` within ``lo..hi``; None when it is
    unset or empty. Anything else is refused, naming the variable (never silently the default)."""
    import os

    from ...errors import DgrError

    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise DgrError(f"{name}={raw!r} is not a whole number (want {lo}..{hi}, or unset for the default)") from None
    if not lo <= n <= hi:
        raise DgrError(f"{name}={n} is out of range (want {lo}..{hi}, or unset for the default)")
    return n
