"""The worker's option table, read from the worker itself (``dgr-worker options --json``).

The worker holds the one table of its options (worker/src/worker/option_table.h: flag,
default, bounds, help). Python does not restate it: where a default is needed before any
worker runs (e.g. the fake model's layer count of a local route), it is read from the binary
here, once per binary (cached by path, size and modification time). Once a worker runs, its
effective limits come from GetCapability (dgr.protocol.limits).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DgrError

__all__ = ["WorkerOption", "worker_default", "worker_options"]

_FIELDS = ("name", "flag", "kind", "metavar", "default", "min", "max", "default_text", "help")
_cache: dict[tuple[str, int, int], dict[str, "WorkerOption"]] = {}


@dataclass(frozen=True)
class WorkerOption:
    """One row of the worker's option table."""

    name: str              # "max-sessions"
    flag: str              # "--max-sessions"
    kind: str              # flag, u32, u64, i32, real, text, range
    metavar: str           # "N" ("" for a flag)
    default: Any           # number, text, False (a flag) or None (a range: none)
    min: float | None      # bounds the worker checks (None: none)
    max: float | None
    default_text: str      # the default as the worker's usage says it ("64 MiB")
    help: str


def worker_options(binary: Path | str | None = None) -> dict[str, WorkerOption]:
    """The option table of ``binary`` (default: the CPU build's dgr-worker), by option name."""
    if binary is None:
        from .supervisor import default_binary

        binary = default_binary()
    exe = Path(binary)
    if not exe.is_file():
        raise DgrError(f"{exe} not built: the worker's options are read from it", hint="run `dgr build --backend cpu`")
    st = exe.stat()
    key = (str(exe.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _cache:
        _cache[key] = _read(exe)
    return _cache[key]


def worker_default(name: str, binary: Path | str | None = None) -> Any:
    """The default of the worker option ``name`` ("n-layer"), from the worker's table."""
    table = worker_options(binary)
    if name not in table:
        raise DgrError(f"the worker has no option --{name}", hint="`dgr-worker options` lists them")
    return table[name].default


def _read(exe: Path) -> dict[str, WorkerOption]:
    try:
        r = subprocess.run([str(exe), "options", "--json"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DgrError(f"cannot run {exe} options --json: {exc}") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        raise DgrError(f"{exe} options --json failed: {last}",
                       hint="a worker built before `dgr-worker options` existed: rebuild it (`dgr build`)")
    try:
        rows = json.loads(r.stdout)["options"]
        table = {row["name"]: WorkerOption(**{f: row[f] for f in _FIELDS}) for row in rows}
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DgrError(f"{exe} options --json printed no option table: {exc!r}") from None
    if not table:
        raise DgrError(f"{exe} options --json printed an empty option table")
    return table
