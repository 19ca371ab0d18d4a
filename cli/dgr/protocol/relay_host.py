"""Run one end of a relayed hop as a process: the bridge next to a worker, or the egress next to
the worker that dials a relayed Shard (`dgr relay bridge|egress`, and the lab's hosts).

With TLS files every side is mutual TLS with the one certificate: the relay byte stream (the
bridge serves it, the egress dials it), the bridge's gRPC channel to its worker, and the
egress's gRPC service (the dialling worker verifies it like any peer).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

from .relay import RELAY_SCHEME, RelayBridge
from .tls import TlsFiles


def relay_end(*, worker: str | None = None, egress: str | None = None, listen: str,
              tls: TlsFiles | None = None) -> Any:
    """The bridge (``worker``: the worker's HOST:PORT) or the egress (``egress``: the next
    Shard's bridge, ``relay+tcp://HOST:PORT``), to listen on ``listen`` (HOST:PORT; port 0: any)."""
    if (worker is None) == (egress is None):
        raise ValueError("give worker (a bridge) or egress (an egress)")
    host, _, port = listen.rpartition(":")
    if egress is not None:
        import grpc

        from .relay_egress import RelayEgress

        if not egress.startswith(RELAY_SCHEME):
            raise ValueError(f"--relay must be {RELAY_SCHEME}HOST:PORT, got {egress!r}")
        creds = None
        if tls is not None:
            if tls.cert is None or tls.key is None:
                raise ValueError("an egress with TLS serves with a certificate: give the certificate and its key")
            creds = grpc.ssl_server_credentials([(Path(tls.key).read_bytes(), Path(tls.cert).read_bytes())],
                                                root_certificates=Path(tls.ca).read_bytes(),
                                                require_client_auth=True)
        return RelayEgress(egress, host=host, port=int(port), server_credentials=creds,
                           ssl=tls.client_context() if tls else None)
    return RelayBridge(str(worker), host=host, port=int(port), tls=tls, ssl=tls.server_context() if tls else None)


async def run_until_signalled(end: Any) -> int:
    """Runs the started ``end`` until SIGTERM or SIGINT, then closes it (the caller starts it
    and reports its address first)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)
    await stop.wait()
    await end.close()
    return 0
