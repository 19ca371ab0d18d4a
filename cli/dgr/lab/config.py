"""What a lab is made of, before any of it exists: :class:`LabConfig` (hosts, CPUs, memory, link
shaping; validated), :class:`Host` (one simulated host as created), where labs keep their state
(:func:`lab_dir`) and the address space they draw from (198.18.0.0/15, reserved for benchmarking).
:mod:`dgr.lab.hosts` creates and removes them."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DgrError

LAB_NET = ipaddress.ip_network("198.18.0.0/15")
NAME_RE = re.compile(r"^[a-z0-9]{1,6}$")
STATE_SCHEMA = "dgr.lab.state/1"


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

    def validate(self) -> None:
        if not NAME_RE.match(self.name):
            raise DgrError(f"lab name {self.name!r} must be 1-6 lower-case letters or digits")
        if not 1 <= self.hosts <= 16:
            raise DgrError(f"--hosts must be 1..16, got {self.hosts}")
        if self.cores_per_host < 1:
            raise DgrError("--cores-per-host must be >= 1")
        if self.cpus is not None and len(self.cpus) != self.hosts:
            raise DgrError(f"--cpus names {len(self.cpus)} CPU sets for {self.hosts} hosts (separate hosts with ';')")
        if self.threads is not None and self.threads < 1:
            raise DgrError("--threads must be >= 1")
        if self.memory_mb is not None and self.memory_mb < 16:
            raise DgrError("--memory-mb must be >= 16")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise DgrError("--rate-mbit must be > 0")
        if self.rtt_ms < 0 or self.jitter_ms < 0:
            raise DgrError("--rtt-ms and --jitter-ms must be >= 0")
        if not 0 <= self.loss < 1:
            raise DgrError("--loss must be a probability in [0, 1)")
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

    @property
    def worker_budget_mb(self) -> int | None:
        """The dgr-worker --memory-budget-mb for this host: its memory less 48 MiB for the
        process itself (gRPC, stacks, allocator)."""
        return None if self.memory_mb is None else max(8, self.memory_mb - 48)


def _parse_cpus(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out
