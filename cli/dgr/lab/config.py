"""What a lab is made of, before any of it exists: :class:`LabConfig` (hosts, CPUs, memory, link
shaping; validated), :class:`Host` (one simulated host as created), where labs keep their state
(:func:`lab_dir`) and the address space they draw from (198.18.0.0/15, reserved for benchmarking).
:mod:`dgr.lab.hosts` creates and removes them."""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DgrError

LAB_NET = ipaddress.ip_network("198.18.0.0/15")
NAME_RE = re.compile(r"^[a-z0-9]{1,6}$")
STATE_SCHEMA = "dgr.lab.state/1"
# upper bounds of the knobs: far above any real use, low enough that tc, cgroups and the proxy's
# timers take them as they are (no overflow, no link that never delivers)
MAX_THREADS = 256
MAX_MEMORY_MB = 16 << 20          # 16 TiB
MAX_RATE_MBIT = 100_000.0         # 100 Gbit/s
MAX_DELAY_MS = 60_000.0           # a minute of round trip or jitter
MIN_CPU_QUOTA = 0.01              # cores: 1 ms of CPU time per 100 ms period


def lab_dir() -> Path:
    from ..paths import build_dir

    return build_dir() / "lab"


@dataclass
class LabConfig:
    hosts: int = 2
    name: str = "lab"
    cores_per_host: int = 1
    cpus: list[str] | None = None          # per host, e.g. ["0", "1"]; default round robin
    threads: int | None = None             # per host (default: its core count)
    memory_mb: int | None = None           # per host (cgroup limit; the worker budget derives from it)
    rate_mbit: float | None = None         # tc tbf on every veth end
    rtt_ms: float = 0.0                    # added round trip into each host
    jitter_ms: float = 0.0
    loss: float = 0.0                      # probability per chunk (proxy) / per packet (netem)
    shaper: str = "auto"                   # auto | netem | proxy
    subnet: str | None = None              # a /24 inside 198.18.0.0/15 (default: derived from name)
    # unequal hosts: per host (one entry each), overriding `threads` / `memory_mb` for that host;
    # cpu_quota: the CPU time a host may use, in cores (cgroup cpu quota; None: its CPUs' all)
    threads_per_host: list[int] | None = None
    memory_mb_per_host: list[int | None] | None = None
    cpu_quota: list[float | None] | None = None

    def host_threads(self, i: int, cpus: str) -> int:
        """Compute threads of host i (0-based): its own, else `threads`, else its CPU count."""
        if self.threads_per_host is not None:
            return self.threads_per_host[i]
        return self.threads or len(parse_cpus(cpus))

    def host_memory_mb(self, i: int) -> int | None:
        return self.memory_mb_per_host[i] if self.memory_mb_per_host is not None else self.memory_mb

    def host_cpu_quota(self, i: int) -> float | None:
        return self.cpu_quota[i] if self.cpu_quota is not None else None

    def validate(self) -> None:
        if not NAME_RE.match(self.name):
            raise DgrError(f"lab name {self.name!r} must be 1-6 lower-case letters or digits")
        if not 1 <= self.hosts <= 16:
            raise DgrError(f"--hosts must be 1..16, got {self.hosts}")
        if self.cores_per_host < 1:
            raise DgrError("--cores-per-host must be >= 1")
        if self.cpus is not None and len(self.cpus) != self.hosts:
            raise DgrError(f"--cpus names {len(self.cpus)} CPU sets for {self.hosts} hosts (separate hosts with ';')")
        for c in self.cpus or []:
            parse_cpus(c)
        if self.threads is not None and not 1 <= self.threads <= MAX_THREADS:
            raise DgrError(f"--threads must be 1..{MAX_THREADS}, got {self.threads}")
        if self.memory_mb is not None and not 16 <= self.memory_mb <= MAX_MEMORY_MB:
            raise DgrError(f"--memory-mb must be 16..{MAX_MEMORY_MB}, got {self.memory_mb}")
        for flag, values in (("--threads", self.threads_per_host), ("--memory-mb", self.memory_mb_per_host),
                             ("--cpu-quota", self.cpu_quota)):
            if values is not None and len(values) != self.hosts:
                raise DgrError(f"{flag} names {len(values)} values for {self.hosts} hosts (one per host, "
                               "separated by ';')")
        for t in self.threads_per_host or []:
            if t is None:
                raise DgrError("--threads: every host needs a thread count ('-' is not one)")
            if not 1 <= t <= MAX_THREADS:
                raise DgrError(f"--threads must be 1..{MAX_THREADS} per host, got {t}")
        for m in self.memory_mb_per_host or []:
            if m is not None and not 16 <= m <= MAX_MEMORY_MB:
                raise DgrError(f"--memory-mb must be 16..{MAX_MEMORY_MB} per host, got {m}")
        for q in self.cpu_quota or []:
            if q is not None and not (math.isfinite(q) and MIN_CPU_QUOTA <= q <= MAX_THREADS):
                raise DgrError(f"--cpu-quota must be {MIN_CPU_QUOTA:g}..{MAX_THREADS} cores per host, got {q}")
        if self.rate_mbit is not None and not (math.isfinite(self.rate_mbit) and 0 < self.rate_mbit <= MAX_RATE_MBIT):
            raise DgrError(f"--rate-mbit must be > 0 and at most {MAX_RATE_MBIT:g}, got {self.rate_mbit}")
        for flag, v in (("--rtt-ms", self.rtt_ms), ("--jitter-ms", self.jitter_ms)):
            if not (math.isfinite(v) and 0 <= v <= MAX_DELAY_MS):
                raise DgrError(f"{flag} must be 0..{MAX_DELAY_MS:g}, got {v}")
        if not 0 <= self.loss < 1:
            raise DgrError("--loss must be a probability in [0, 1)")
        if self.subnet is not None:
            try:
                net = ipaddress.ip_network(self.subnet)
            except ValueError as exc:
                raise DgrError(f"--subnet: {exc}") from None
            if net.version != 4 or not net.subnet_of(LAB_NET) or net.prefixlen != 24:
                raise DgrError(f"--subnet {self.subnet} must be a /24 inside {LAB_NET} (set aside for benchmarking)")
        if self.shaper not in ("auto", "netem", "proxy"):
            raise DgrError(f"--shaper must be auto, netem or proxy, got {self.shaper!r}")


@dataclass
class Host:
    name: str
    netns: str
    veth: str
    ip: str
    cpus: str
    threads: int
    memory_mb: int | None
    cgroups: list[str] = field(default_factory=list)
    shares_cpus_with: list[str] = field(default_factory=list)
    cpu_quota: float | None = None     # cores of CPU time (cgroup cpu quota); None: its CPUs' all

    @property
    def worker_budget_mb(self) -> int | None:
        """The dgr-worker --memory-budget-mb for this host: its memory less 48 MiB for the
        process itself (gRPC, stacks, allocator)."""
        return None if self.memory_mb is None else max(8, self.memory_mb - 48)


CPU_LIST_RE = re.compile(r"^\d{1,4}(-\d{1,4})?(,\d{1,4}(-\d{1,4})?)*$")


def per_host(text: str | None, flag: str, conv):
    """A knob given once for every host ("2") or once per host ("2;1;1"; "-" leaves a host
    without it) -> (the value for all, or None; the per-host list, or None)."""
    if text is None or not text.strip():
        return None, None
    def one(part: str):
        part = part.strip()
        if part == "-":
            return None
        try:
            return conv(part)
        except ValueError:
            raise DgrError(f"{flag}: {part!r} is not a number") from None
    if ";" not in text:
        v = one(text)
        if v is None:
            raise DgrError(f"{flag}: '-' (none) only stands for one host of several")
        return v, None
    return None, [one(p) for p in text.split(";")]


def parse_cpus(text: str) -> list[int]:
    """A CPU list as cpusets write it ("0", "0-3", "0,2-3") -> its CPUs; DgrError when malformed,
    empty or a range runs backwards."""
    if not CPU_LIST_RE.match(text):
        raise DgrError(f"CPU set {text!r} must be a list like 0 or 0-3 or 0,2-3")
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        lo, hi = int(a), int(b or a)
        if hi < lo:
            raise DgrError(f"CPU set {text!r}: the range {part} runs backwards")
        out.extend(range(lo, hi + 1))
    return out
