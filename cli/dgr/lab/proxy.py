"""A userspace TCP link: delay, jitter, loss and blackhole between simulated hosts.

Where the kernel has no ``tc netem`` (``CONFIG_NET_SCH_NETEM`` unset), the lab carries traffic
into a host through this proxy: it listens on the host's address at a port of its own and
forwards each accepted connection to the real service, both directions. Every chunk read is
delivered ``delay_ms`` (± ``jitter_ms``, uniform) after it arrived, in order (a later chunk never
overtakes an earlier one, as on a TCP stream). A TCP proxy cannot drop bytes without breaking
the stream, so *loss* is emulated as what a lost segment costs a TCP connection: with
probability ``loss`` a chunk is delivered one retransmission timeout (``rto_ms``, default 200)
late, holding back everything behind it. *Blackhole* (SIGUSR1 on, SIGUSR2 off) stops delivery:
connections stay open, bytes are held until it is lifted. With ``--control FILE``, SIGHUP re-reads
the link's shape from that JSON file (``delay_ms``, ``jitter_ms``, ``loss``; absent keys keep
their value): a latency spike or a lossy spell at run time (``dgr drill``).

Bounded: at most ``max_buffer`` bytes are held per direction (reading pauses beyond it), at most
``max_conns`` connections. SIGTERM/SIGINT close everything and write the counters as JSON to
``--stats`` (also written every second while running).

    python -m dgr.lab.proxy --map 198.18.7.3:41001=198.18.7.3:40001 --delay-ms 5 --stats s.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_RTO_MS = 200.0
MAX_DELAY_MS = 60_000.0     # one way; a minute is far above any link worth simulating
MAX_BUFFER = 64 << 20
MAX_CONNS = 256


@dataclass
class LinkSpec:
    delay_ms: float = 0.0      # one way, each direction
    jitter_ms: float = 0.0     # uniform in [-jitter, +jitter], never below 0, order kept
    loss: float = 0.0          # probability a chunk costs one retransmission timeout
    rto_ms: float = DEFAULT_RTO_MS

    def validate(self) -> None:
        # NaN fails every comparison: checked as "not within" so it is refused too
        if not all(0.0 <= v <= MAX_DELAY_MS for v in (self.delay_ms, self.jitter_ms, self.rto_ms)):
            raise ValueError(f"delay, jitter and rto must be 0..{MAX_DELAY_MS:g} ms")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError("loss must be a probability in [0, 1)")


@dataclass
class Counters:
    connections: int = 0
    refused: int = 0
    bytes_up: int = 0          # client -> service
    bytes_down: int = 0        # service -> client
    chunks: int = 0
    lost_chunks: int = 0       # delayed by one RTO (emulated loss)
    blackholed_s: float = 0.0
    started: float = field(default_factory=time.time)


class Link:
    def __init__(self, spec: LinkSpec, *, seed: int = 0, max_buffer: int = MAX_BUFFER,
                 max_conns: int = MAX_CONNS) -> None:
        spec.validate()
        self.spec, self.max_buffer, self.max_conns = spec, max_buffer, max_conns
        self.rng = random.Random(seed)
        self.counters = Counters()
        self.open = asyncio.Event()
        self.open.set()
        self._bh_since: float | None = None
        self._tasks: set[asyncio.Task] = set()
        self._live = 0

    def blackhole(self, on: bool) -> None:
        if on and self.open.is_set():
            self.open.clear()
            self._bh_since = time.monotonic()
        elif not on and not self.open.is_set():
            self.counters.blackholed_s += time.monotonic() - (self._bh_since or time.monotonic())
            self._bh_since = None
            self.open.set()

    def _due(self, last_due: float) -> float:
        s = self.spec
        d = s.delay_ms
        if s.jitter_ms:
            d = max(0.0, d + self.rng.uniform(-s.jitter_ms, s.jitter_ms))
        if s.loss and self.rng.random() < s.loss:
            d += s.rto_ms
            self.counters.lost_chunks += 1
        return max(last_due, time.monotonic() + d / 1e3)

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, up: bool) -> None:
        q: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        held = {"n": 0}
        room = asyncio.Event()
        room.set()

        async def reader() -> None:
            last = 0.0
            try:
                while True:
                    await room.wait()
                    data = await r.read(1 << 16)
                    if not data:
                        break
                    last = self._due(last)
                    held["n"] += len(data)
                    if held["n"] >= self.max_buffer:
                        room.clear()
                    self.counters.chunks += 1
                    await q.put((last, data))
            except (ConnectionError, OSError):
                pass
            finally:
                await q.put(None)

        async def writer() -> None:
            try:
                while True:
                    item = await q.get()
                    if item is None:
                        break
                    due, data = item
                    wait = due - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    await self.open.wait()
                    w.write(data)
                    await w.drain()
                    held["n"] -= len(data)
                    if held["n"] < self.max_buffer:
                        room.set()
                    if up:
                        self.counters.bytes_up += len(data)
                    else:
                        self.counters.bytes_down += len(data)
                if w.can_write_eof():
                    w.write_eof()
            except (ConnectionError, OSError):
                pass

        await asyncio.gather(reader(), writer())

    async def handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter, target: tuple[str, int]) -> None:
        if self._live >= self.max_conns:
            self.counters.refused += 1
            cw.close()
            return
        self._live += 1
        self.counters.connections += 1
        sw = None
        try:
            try:
                sr, sw = await asyncio.wait_for(asyncio.open_connection(*target), 10)
            except (OSError, asyncio.TimeoutError):
                self.counters.refused += 1
                return
            await asyncio.gather(self._pipe(cr, sw, True), self._pipe(sr, cw, False))
        finally:
            self._live -= 1
            for w in (cw, sw):
                if w is not None:
                    w.close()


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def reshape(link: Link, control: Path) -> None:
    """Applies the shape in ``control`` (JSON) to ``link``; a bad file changes nothing."""
    try:
        doc = json.loads(control.read_text())
        new = LinkSpec(float(doc.get("delay_ms", link.spec.delay_ms)), float(doc.get("jitter_ms", link.spec.jitter_ms)),
                       float(doc.get("loss", link.spec.loss)), link.spec.rto_ms)
        new.validate()
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        print(f"dgr-link-proxy: control file {control}: {exc}", file=sys.stderr, flush=True)
        return
    link.spec = new


async def serve(maps: list[tuple[tuple[str, int], tuple[str, int]]], spec: LinkSpec, stats: Path | None,
                seed: int = 0, control: Path | None = None) -> int:
    link = Link(spec, seed=seed)
    servers = []
    for listen, target in maps:
        srv = await asyncio.start_server(lambda r, w, t=target: link.handle(r, w, t), *listen, reuse_address=True)
        servers.append(srv)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: link.blackhole(True))
    loop.add_signal_handler(signal.SIGUSR2, lambda: link.blackhole(False))
    if control is not None:
        loop.add_signal_handler(signal.SIGHUP, lambda: reshape(link, control))

    def dump() -> None:
        if stats is not None:
            doc = {**asdict(link.counters), "blackhole": not link.open.is_set(), "spec": asdict(link.spec),
                   "maps": [f"{a[0]}:{a[1]}={b[0]}:{b[1]}" for a, b in maps]}
            tmp = stats.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc))
            tmp.replace(stats)

    print("dgr-link-proxy: ready " + " ".join(f"{a[0]}:{s.sockets[0].getsockname()[1]}" for (a, _), s
                                              in zip(maps, servers)), flush=True)
    while not stop.is_set():
        dump()
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass
    for s in servers:
        s.close()
    link.blackhole(False)
    dump()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgr.lab.proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--map", action="append", required=True, metavar="LISTEN=TARGET",
                   help="HOST:PORT=HOST:PORT (repeat)")
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--loss", type=float, default=0.0, help="probability in [0, 1)")
    p.add_argument("--rto-ms", type=float, default=DEFAULT_RTO_MS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats", type=Path, default=None)
    p.add_argument("--control", type=Path, default=None,
                   help="JSON file with delay_ms/jitter_ms/loss, re-read on SIGHUP")
    a = p.parse_args(argv)
    try:
        maps = []
        for m in a.map:
            left, sep, right = m.partition("=")
            if not sep:
                raise argparse.ArgumentTypeError(f"--map needs LISTEN=TARGET, got {m!r}")
            maps.append((_hostport(left), _hostport(right)))
        spec = LinkSpec(a.delay_ms, a.jitter_ms, a.loss, a.rto_ms)
        spec.validate()
    except (argparse.ArgumentTypeError, ValueError) as exc:
        print(f"dgr-link-proxy: error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(serve(maps, spec, a.stats, a.seed, a.control))


if __name__ == "__main__":
    sys.exit(main())
