"""The lab's system operations: ip/tc commands, cgroups, processes. Every call is bounded in time
and touches only objects whose names carry the lab prefix (``dgrlab-…`` namespaces and cgroups,
``dgl…`` links), created by :mod:`dgr.lab.hosts`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from ..errors import DgrError

NETNS_PREFIX = "dgrlab-"
LINK_PREFIX = "dgl"
CGROUP_PREFIX = "dgrlab-"
CMD_TIMEOUT_S = 20.0
CGROUP_ROOT = Path("/sys/fs/cgroup")


class LabRefused(DgrError):
    """This machine does not let the lab create network namespaces (or the tools are missing)."""


def run(argv: list[str], *, check: bool = True, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise LabRefused(f"`{argv[0]}` is not installed", hint="install iproute2 (ip, tc) and util-linux (taskset)") from None
    except subprocess.TimeoutExpired:
        raise DgrError(f"`{' '.join(argv)}` did not finish within {timeout:.0f}s") from None
    if check and p.returncode != 0:
        raise DgrError(f"`{' '.join(argv)}` failed: {(p.stderr or p.stdout).strip()[-300:]}")
    return p


def preflight() -> str | None:
    """None when the lab can run here, else the reason it cannot (tests skip with it)."""
    for tool in ("ip", "tc", "taskset"):
        if not shutil.which(tool):
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, veth, a bridge, tc, cgroups)"
    probe = f"{NETNS_PREFIX}probe-{os.getpid()}"
    p = run(["ip", "netns", "add", probe], check=False)
    if p.returncode != 0:
        return f"this machine refuses network namespaces: {p.stderr.strip()[-200:]}"
    run(["ip", "netns", "del", probe], check=False)
    p = run(["ip", "link", "add", f"{LINK_PREFIX}probe{os.getpid() % 10000}", "type", "bridge"], check=False)
    if p.returncode != 0:
        return f"this machine refuses to create a bridge: {p.stderr.strip()[-200:]}"
    run(["ip", "link", "del", f"{LINK_PREFIX}probe{os.getpid() % 10000}"], check=False)
    return None


def netns_list() -> list[str]:
    p = run(["ip", "netns", "list"], check=False)
    return [ln.split()[0] for ln in p.stdout.splitlines() if ln.strip()]


def link_exists(name: str) -> bool:
    return run(["ip", "link", "show", "dev", name], check=False).returncode == 0


def links_with_prefix(prefix: str = LINK_PREFIX) -> list[str]:
    p = run(["ip", "-o", "link", "show"], check=False)
    out = []
    for ln in p.stdout.splitlines():
        parts = ln.split(":", 2)
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(prefix):
                out.append(name)
    return out


def root_addresses() -> list[str]:
    """Every IPv4 address/prefix configured in this (the root) namespace."""
    p = run(["ip", "-o", "-4", "addr", "show"], check=False)
    return [ln.split()[3] for ln in p.stdout.splitlines() if len(ln.split()) > 3]


def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (probed on a throwaway dummy-free veth pair)."""
    a, b = f"{LINK_PREFIX}nq{os.getpid() % 10000}", f"{LINK_PREFIX}nr{os.getpid() % 10000}"
    if run(["ip", "link", "add", a, "type", "veth", "peer", "name", b], check=False).returncode != 0:
        return False
    try:
        return run(["tc", "qdisc", "add", "dev", a, "root", "netem", "delay", "1ms"], check=False).returncode == 0
    finally:
        run(["ip", "link", "del", a], check=False)


# ---- cgroups ------------------------------------------------------------------------------

def cgroup_mode() -> str:
    """'v1' (cpuset and memory hierarchies mounted), 'v2' (both controllers enabled for
    children of the unified root) or 'none' (CPU sets by taskset only, memory by the worker's
    own budget)."""
    if (CGROUP_ROOT / "cpuset" / "cpuset.cpus").is_file() and (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").is_file():
        return "v1"
    ctl = CGROUP_ROOT / "cgroup.subtree_control"
    if ctl.is_file():
        enabled = ctl.read_text().split()
        if "cpuset" in enabled and "memory" in enabled:
            return "v2"
    return "none"


CPU_PERIOD_US = 100_000   # the quota's period: 100 ms, the kernel's default


def cpu_quota_available(mode: str) -> bool:
    """Whether a host's CPU time can be capped: the cgroup cpu controller (v1: its hierarchy
    with CFS bandwidth files; v2: enabled for children of the unified root)."""
    if mode == "v1":
        return (CGROUP_ROOT / "cpu" / "cpu.cfs_quota_us").is_file()
    if mode == "v2":
        ctl = CGROUP_ROOT / "cgroup.subtree_control"
        return ctl.is_file() and "cpu" in ctl.read_text().split()
    return False


def make_cgroups(name: str, cpus: str, memory_mb: int | None, mode: str,
                 cpu_quota: float | None = None) -> list[str]:
    """Creates the host's cgroup(s); returns their directories (for the tasks files and teardown).
    ``cpu_quota``: cores of CPU time per period (cpu_quota_available(mode) must hold)."""
    assert name.startswith(CGROUP_PREFIX)
    quota_us = None if cpu_quota is None else max(1000, int(round(cpu_quota * CPU_PERIOD_US)))
    if mode == "v1":
        cs = CGROUP_ROOT / "cpuset" / name
        cs.mkdir(exist_ok=True)
        mems = (CGROUP_ROOT / "cpuset" / "cpuset.mems").read_text().strip() or "0"
        (cs / "cpuset.cpus").write_text(cpus)
        (cs / "cpuset.mems").write_text(mems)
        mem = CGROUP_ROOT / "memory" / name
        mem.mkdir(exist_ok=True)
        if memory_mb:
            (mem / "memory.limit_in_bytes").write_text(str(memory_mb << 20))
        out = [str(cs), str(mem)]
        if quota_us is not None:
            cpu = CGROUP_ROOT / "cpu" / name
            cpu.mkdir(exist_ok=True)
            try:
                (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                (cpu / "cpu.cfs_quota_us").write_text(str(quota_us))
            except OSError:
                remove_cgroup(str(cpu))
                raise
            out.append(str(cpu))
        return out
    if mode == "v2":
        d = CGROUP_ROOT / name
        d.mkdir(exist_ok=True)
        (d / "cpuset.cpus").write_text(cpus)
        if memory_mb:
            (d / "memory.max").write_text(str(memory_mb << 20))
        if quota_us is not None:
            (d / "cpu.max").write_text(f"{quota_us} {CPU_PERIOD_US}")
        return [str(d)]
    return []


def cpu_throttled_us(cg: str) -> int | None:
    """CPU time a host's cgroup was held back by its quota so far, in µs (cpu.stat; None: not a
    cpu cgroup)."""
    try:
        stat = dict(line.split() for line in (Path(cg) / "cpu.stat").read_text().splitlines() if line.strip())
    except (OSError, ValueError):
        return None
    if "throttled_usec" in stat:
        return int(stat["throttled_usec"])
    if "throttled_time" in stat:           # v1: nanoseconds
        return int(stat["throttled_time"]) // 1000
    return None


def tasks_file(cg: str) -> str:
    p = Path(cg)
    return str(p / ("tasks" if (p / "tasks").exists() else "cgroup.procs"))


def cgroup_pids(cg: str) -> list[int]:
    """The processes (not threads) in a cgroup."""
    p = Path(cg) / "cgroup.procs"
    try:
        return [int(x) for x in (p if p.exists() else Path(tasks_file(cg))).read_text().split()]
    except OSError:
        return []


def remove_cgroup(cg: str, deadline_s: float = 5.0) -> bool:
    assert Path(cg).name.startswith(CGROUP_PREFIX)
    end = time.monotonic() + deadline_s
    while True:
        try:
            os.rmdir(cg)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > end:
                return False
            time.sleep(0.05)


# ---- processes ----------------------------------------------------------------------------

def netns_pids(ns: str) -> list[int]:
    p = run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks since boot, /proc/PID/stat field 22); None when it
    is gone. A recorded pid is the same process only while this matches (pids are reused)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def recorded(pr: dict) -> int | None:
    """The pid of a process a lab recorded ({"pid", "start"}) if it is still that process."""
    pid, start = pr.get("pid"), pr.get("start")
    if not isinstance(pid, int) or start is None or not alive(pid):
        return None
    return pid if start_ticks(pid) == start else None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def stop_pids(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """SIGTERM, wait (bounded), SIGKILL what is left; returns the pids that had to be killed."""
    pids = [p for p in set(pids) if p != os.getpid() and alive(p)]
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    killed = [p for p in pids if alive(p)]
    for p in killed:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    end = time.monotonic() + 5.0
    while time.monotonic() < end and any(alive(p) for p in killed):
        time.sleep(0.05)
    return killed


def readline(p: subprocess.Popen, timeout: float) -> str | None:
    """The first stdout line of ``p`` within ``timeout`` seconds (None: none came)."""
    import selectors

    assert p.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    end = time.monotonic() + timeout
    buf = b""
    try:
        while time.monotonic() < end:
            if not sel.select(max(0.0, end - time.monotonic())):
                break
            ch = os.read(p.stdout.fileno(), 4096)
            if not ch:
                break
            buf += ch
            if b"\n" in buf:
                return buf.split(b"\n", 1)[0].decode(errors="replace")
    finally:
        sel.close()
    return buf.decode(errors="replace") or None


class SignalTrap:
    """While entered, SIGINT and SIGTERM raise KeyboardInterrupt (so `finally` blocks and context
    managers run); the previous handlers come back on exit."""

    def __init__(self) -> None:
        self.prev: dict[int, Any] = {}

    def __enter__(self) -> None:
        def raise_exit(signum: int, _frame: Any) -> None:
            raise KeyboardInterrupt(f"signal {signum}")
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self.prev[s] = signal.signal(s, raise_exit)
            except ValueError:  # not the main thread: the caller's own handling applies
                pass

    def __exit__(self, *exc: object) -> None:
        for s, h in self.prev.items():
            signal.signal(s, h)
