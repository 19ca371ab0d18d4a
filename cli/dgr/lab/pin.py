"""Pin this process to a lab host's CPUs while it measures (the benches' driver or gateway).

A deployment runs the route driver or the gateway on the head's machine, where it shares that
machine's cores with the head worker. The lab benches reproduce that by pinning their own
process (and the threads it starts while pinned) to the head host's CPU set; the affinity is
restored afterwards.
"""

from __future__ import annotations

import os
from typing import Any


class Pinned:
    """``with Pinned(cpus):`` this process on ``cpus`` (a list of CPU numbers), restored after;
    a no-op where the platform has no affinity call or ``cpus`` is empty."""

    def __init__(self, cpus: list[int]) -> None:
        self.cpus, self.before = set(cpus), None

    @classmethod
    def on_host(cls, lab: Any, host: str) -> "Pinned":
        """Pinned to the CPUs of ``lab``'s host ``host`` (e.g. "h1", where the head runs)."""
        from .config import parse_cpus

        return cls(parse_cpus(lab.host(host).cpus))

    def __enter__(self) -> "Pinned":
        if hasattr(os, "sched_setaffinity") and self.cpus:
            self.before = os.sched_getaffinity(0)
            os.sched_setaffinity(0, self.cpus)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.before is not None:
            os.sched_setaffinity(0, self.before)
