"""A route whose workers run on lab hosts: one dgr-worker per Shard, each inside its host (its
namespace, CPU set, threads and memory budget), listening on the host's address with mutual TLS.
The head reaches the next Shard over the veth network with TLS too (``--chain-tls-ca``; the
worker presents its host certificate as client identity), so every hop is mTLS:

    driver (root namespace, client cert) --mTLS--> head (h1) --mTLS--> h2 --mTLS--> … tail

With ``relay=True`` each Shard also gets a relay bridge in its host (:mod:`dgr.lab.relayhost`):
the driver reaches it with ``relay+tcp://`` endpoints (the same frames as opaque records over a
TLS byte stream) and the bridge calls the worker over mTLS gRPC. Each Shard after the head also
gets a relay egress in the previous Shard's host, which that worker dials as its downstream and
which carries the hop through the bridge (``relay_hops``): the relayed route stays chained.

When the lab adds delay through the link proxy, every endpoint handed out is the proxy's, so the
driver -> head and the head -> next hops both cross it.
"""

from __future__ import annotations

import logging
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import DgrError
from ..protocol.tls import TlsFiles
from . import system as sx
from .hosts import Host, Lab

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..route.supervisor import WorkerArgs


@dataclass
class Placed:
    host: Host
    range: tuple[int, int]
    worker: Any                           # dgr.route.supervisor.WorkerProcess
    direct: str                           # host ip:port of the worker
    endpoint: str                         # what the driver and the previous hop dial
    relay: str | None = None              # relay+tcp://… when relayed (as the driver reaches it)
    hop: str | None = None                # relayed: the egress on the previous Shard's host
    argv: list[str] = field(default_factory=list)


def host_tls(lab: Lab, host: Host) -> TlsFiles:
    pki = lab.state["pki"]
    h = pki["hosts"][host.name]
    return TlsFiles(Path(pki["ca"]), Path(h["cert"]), Path(h["key"]))


def driver_tls(lab: Lab) -> TlsFiles:
    pki = lab.state["pki"]
    return TlsFiles(Path(pki["ca"]), Path(pki["client_cert"]), Path(pki["client_key"]))


class LabRoute:
    """One worker per shard of ``split`` on lab hosts (``placement[i]`` names the host of shard
    i; default h1, h2, … round robin). ``slices``: each worker maps its own slice file.
    ``memory_budget``: each worker gets its host's budget (``--memory-budget-mb``)."""

    def __init__(self, lab: Lab, model: Path | None, split: Sequence[tuple[int, int]], *,
                 placement: Sequence[str] | None = None, slices: bool = True, max_sessions: int = 8,
                 ctx_per_session: int | None = None, relay: bool = False, memory_budget: bool = True,
                 extra_args: Sequence[str] = (), backend: str = "cpu", slice_dir: Path | None = None,
                 fake: bool = False) -> None:
        hosts = lab.hosts
        self.fake = fake
        self.lab, self.model, self.split = lab, model, list(split)
        self.placement = [lab.host(p) for p in placement] if placement else \
            [hosts[i % len(hosts)] for i in range(len(self.split))]
        if len(self.placement) != len(self.split):
            raise DgrError(f"placement names {len(self.placement)} hosts for {len(self.split)} shards")
        self.slices, self.max_sessions, self.ctx = slices, max_sessions, ctx_per_session
        self.relay, self.memory_budget = relay, memory_budget
        self.extra_args, self.backend = list(extra_args), backend
        self.slice_dir = slice_dir
        self.placed: list[Placed] = []
        self.files: list[Path] = []
        self.fingerprint = self.artifact_id = ""
        self.tls = driver_tls(lab)
        self._relays: list[Any] = []

    # ---- start / stop -----------------------------------------------------------------------

    def _prepare(self) -> None:
        from ..gguf.recipe import recipe_for

        if self.fake:
            return
        recipe = recipe_for(self.model, backend=self.backend, progress=False)
        self.fingerprint, self.artifact_id = recipe.fingerprint(), recipe.artifact_id
        from ..route.local import slice_files

        self.files = slice_files(self.model, self.split, self.artifact_id, self.slice_dir) if self.slices \
            else [self.model] * len(self.split)

    def worker_args(self, i: int) -> "WorkerArgs":
        """The worker's options for shard ``i`` (its host's TLS identity and thread count)."""
        from ..route.supervisor import WorkerArgs

        h, (a, b) = self.placement[i], self.split[i]
        t = host_tls(self.lab, h)
        model: dict[str, Any] = dict(fake_model=True, n_layer=self.split[-1][1]) if self.fake else \
            dict(model=self.files[i], fingerprint=self.fingerprint, artifact_id=self.artifact_id, threads=h.threads)
        return WorkerArgs(**model, layers=(a, b), max_sessions=self.max_sessions, ctx_per_session=self.ctx,
                          tls_cert=t.cert, tls_key=t.key, tls_client_ca=t.ca, chain_tls_ca=t.ca,
                          chain_peers=",".join(x.ip for x in self.lab.hosts),
                          memory_budget_mb=h.worker_budget_mb if self.memory_budget and h.worker_budget_mb else None,
                          extra=tuple(self.extra_args))

    def start(self) -> list[str]:
        from ..route.local import ensure_worker
        from ..route.supervisor import WorkerProcess, WorkerStartError

        binary = ensure_worker(self.backend)
        self._prepare()
        creds = self.tls.grpc_credentials()
        try:
            for i, ((a, b), h) in enumerate(zip(self.split, self.placement)):
                args = self.worker_args(i)
                try:
                    w = WorkerProcess.start(args, binary=self.lab.wrapper(h, binary), listen=f"{h.ip}:0",
                                            ready_timeout=120, credentials=creds)
                except WorkerStartError as exc:
                    raise DgrError(f"worker for layers {a}:{b} on {h.name} did not start: {exc}") from None
                direct = w.target
                ep = self.lab.expose(h, w.port)
                p = Placed(h, (a, b), w, direct, ep, argv=[str(binary), "serve", "--listen", f"{h.ip}:0", *args.argv()])
                prev = self.placed[-1] if self.placed else None
                if self.relay:
                    p.relay = self._start_relay(h, ["--worker", direct])
                    if prev is not None:      # the previous Shard's host dials this one through an egress
                        p.hop = self._start_relay(prev.host, ["--egress", p.relay])
                self.placed.append(p)
                _log.info(f"worker [{a}:{b}) on {h.name} (CPUs {h.cpus}, {h.threads} thread(s)"
                         + (f", budget {h.worker_budget_mb} MiB" if self.memory_budget and h.worker_budget_mb else "")
                         + f") pid {w.pid} at {direct}" + (f" via {ep}" if ep != direct else "")
                         + (f", relay {p.relay}" if p.relay else "")
                         + (f", dialled by [{prev.range[0]}:{prev.range[1]}) through the egress {p.hop} on "
                            f"{prev.host.name}" if p.hop and prev else ""))
        except BaseException:
            self.stop()
            raise
        return self.endpoints

    def _start_relay(self, h: Host, side: list[str]) -> str:
        """A relay bridge (``--worker``) or egress (``--egress``) on host ``h``: the bridge's
        ``relay+tcp://`` address as the driver (and any host) reaches it; the egress's address on
        its own host (only that host's worker dials it)."""
        import subprocess

        from .. import childproc

        t = host_tls(self.lab, h)
        argv = [*self.lab.prefix(h), sys.executable, "-m", "dgr.lab.relayhost", *side,
                "--listen", f"{h.ip}:0", "--ca", str(t.ca), "--cert", str(t.cert), "--key", str(t.key)]
        p = childproc.popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._relays.append(p)
        self.lab.record(h, p.pid, argv[5:])
        line = sx.readline(p, 30.0) or ""
        m = re.search(r"ready (\S+):(\d+)", line)
        if not m:
            p.kill()
            raise DgrError(f"relay {side[0].lstrip('-')} on {h.name} did not start: {line} "
                           f"{(p.stderr.read() if p.stderr else b'').decode(errors='replace')[-300:]}")
        port = int(m.group(2))
        if side[0] == "--egress":
            return f"{h.ip}:{port}"
        return "relay+tcp://" + self.lab.expose(h, port)

    @property
    def endpoints(self) -> list[str]:
        return [p.endpoint for p in self.placed]

    @property
    def relay_endpoints(self) -> list[str]:
        return [p.relay or "" for p in self.placed]

    @property
    def relay_pids(self) -> list[int]:
        """The relay bridges' and egresses' processes (what a bench charges to the relay)."""
        return [p.pid for p in self._relays]

    @property
    def relay_hops(self) -> list[str]:
        """Per Shard, what the previous Shard dials for it when relayed: its relay egress on the
        previous Shard's host ("" for the head): ``RouteDriver(relay_endpoints, hops=relay_hops)``
        keeps the chained mode over the relay."""
        return [p.hop or "" for p in self.placed]

    @property
    def workers(self) -> list[Any]:
        return [p.worker for p in self.placed]

    def stop(self) -> None:
        for p in self._relays:
            sx.stop_pids([p.pid])
            p.wait(5)
        for pl in self.placed:
            try:
                pl.worker.terminate(10)
            except Exception:
                pl.worker.kill()

    def __enter__(self) -> "LabRoute":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> list[Any]:
        from ..route.local import worker_stats

        return worker_stats(None if self.fake else self.model, [p.range for p in self.placed],
                            [p.endpoint for p in self.placed], [p.worker.pid for p in self.placed])

    def describe(self) -> list[dict[str, Any]]:
        """Per shard: host, CPUs, threads, budget, pid, addresses and the exact worker command."""
        return [{"range": f"{p.range[0]}:{p.range[1]}", "host": p.host.name, "netns": p.host.netns, "ip": p.host.ip,
                 "cpus": p.host.cpus, "threads": p.host.threads, "memory_mb": p.host.memory_mb,
                 "cpu_quota": p.host.cpu_quota,
                 "worker_budget_mb": p.host.worker_budget_mb if self.memory_budget else None,
                 "pid": p.worker.pid, "direct": p.direct, "endpoint": p.endpoint, "relay": p.relay,
                 "relay_egress": p.hop,
                 "file": str(self.files[i]) if self.files else None,
                 "command": shlex.join(self.lab.prefix(p.host) + p.argv)} for i, p in enumerate(self.placed)]
