"""Facts about processes and this host that Linux's /proc gives: a process's memory from
``/proc/PID/status`` (resident set, its peak) and the CPU model. Linux only; an unknown value is
0 or "" (a process that has exited, another OS)."""

from __future__ import annotations

from pathlib import Path


def status_bytes(pid: int, field: str) -> int:
    """A memory field of ``/proc/PID/status`` in bytes: ``"VmRSS"`` (resident set now) or
    ``"VmHWM"`` (its peak); 0 when the process or the field is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where unknown)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
