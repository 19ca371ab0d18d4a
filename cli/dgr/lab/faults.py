"""Fault injectors for `dgr drill` (dgr/lab/drill.py): link proxies that can blackhole, delay
or lose, on loopback (:class:`LinkProxies`, a thread of the drill's process) or on lab hosts (the
lab's own proxies, :class:`LabLinks`), and signals to the drill's own worker processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

from ..errors import DgrError
from .proxy import Link, LinkSpec


# ---- link proxies on a thread of their own -----------------------------------------------------

class LinkProxies:
    """One :class:`~dgr.lab.proxy.Link` per proxied worker, served on a private event loop thread
    (so the driver's loop never delays the proxy and vice versa)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="drill-link-proxies", daemon=True)
        self.thread.start()
        self.links: dict[str, Link] = {}       # proxy endpoint -> link
        self._servers: list[asyncio.base_events.Server] = []

    def add(self, target: str, host: str = "127.0.0.1") -> str:
        th, _, tp = target.rpartition(":")

        async def start() -> str:
            link = Link(LinkSpec())
            srv = await asyncio.start_server(lambda r, w: link.handle(r, w, (th, int(tp))), host, 0)
            self._servers.append(srv)
            ep = f"{host}:{srv.sockets[0].getsockname()[1]}"
            self.links[ep] = link
            return ep
        return asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def set(self, ep: str, *, blackhole: bool | None = None, delay_ms: float | None = None,
            loss: float | None = None) -> None:
        link = self.links[ep]

        def apply() -> None:
            if delay_ms is not None:
                link.spec.delay_ms = delay_ms
            if loss is not None:
                link.spec.loss = loss
            if blackhole is not None:
                link.blackhole(blackhole)
        self.loop.call_soon_threadsafe(apply)

    def counters(self, ep: str) -> dict[str, Any]:
        from dataclasses import asdict
        return asdict(self.links[ep].counters)

    def close(self) -> None:
        async def stop() -> None:
            for link in self.links.values():
                link.blackhole(False)
            for s in self._servers:
                s.close()
            for t in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                t.cancel()
        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)
        except Exception:   # noqa: BLE001  (best effort: the loop thread is a daemon)
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class LabLinks:
    """The lab's own link proxies (one per exposed service, in the destination host's namespace):
    blackhole by SIGUSR1/SIGUSR2, shape by the proxy's control file and SIGHUP, only the proxy in
    front of the given endpoint."""

    def __init__(self, lab: Any) -> None:
        sh = lab.shaping
        if sh.get("delay_mechanism") != "proxy":
            raise DgrError(f"link faults on lab hosts need the lab's link proxy; lab {lab.name} shapes by "
                           f"{sh.get('delay_mechanism')}: bring it up with --shaper proxy --rtt-ms 0.2")
        self.lab = lab
        self.base = {"delay_ms": sh["rtt_ms"] / 2, "jitter_ms": sh["jitter_ms"] / 2, "loss": sh["loss"]}
        self.links = {pr["listen"]: pr for pr in lab.state["proxies"] if pr.get("listen")}

    def set(self, ep: str, *, blackhole: bool | None = None, delay_ms: float | None = None,
            loss: float | None = None) -> None:
        from . import system as sx

        pr = self.links.get(ep)
        if pr is None or not sx.alive(pr["pid"]) or "dgr.lab.proxy" not in sx.cmdline(pr["pid"]):
            raise DgrError(f"no running link proxy of lab {self.lab.name} in front of {ep}")
        if blackhole is not None:
            os.kill(pr["pid"], signal.SIGUSR1 if blackhole else signal.SIGUSR2)
        if delay_ms is not None or loss is not None:
            shape = dict(self.base)
            if delay_ms:
                shape["delay_ms"] = self.base["delay_ms"] + delay_ms
            if loss:
                shape["loss"] = loss
            Path(pr["control"]).write_text(json.dumps(shape))
            os.kill(pr["pid"], signal.SIGHUP)

    def counters(self, ep: str) -> dict[str, Any]:
        try:
            return json.loads(Path(self.links[ep]["stats"]).read_text())
        except (OSError, ValueError, KeyError):
            return {}

    def close(self) -> None:
        for ep in self.links:
            try:
                self.set(ep, blackhole=False, delay_ms=0.0, loss=0.0)
            except DgrError:
                pass


def signal_worker(proc: Any, sig: int) -> bool:
    """Signals our own worker process (by its pid), if it still runs."""
    p = getattr(proc, "proc", None)
    if p is None or p.poll() is not None:
        return False
    try:
        os.kill(p.pid, sig)
        return True
    except ProcessLookupError:
        return False
