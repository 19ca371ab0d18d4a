"""The worker side of a relayed hop on a lab host (``python -m dgr.lab.relayhost``).

Accepts relay connections on ``--listen`` (the host's address) and runs each as one gRPC call on
the worker at ``--worker`` (:class:`dgr.protocol.relay.RelayBridge`). With ``--ca/--cert/--key``
both sides are mutual TLS: the relay byte stream (the driver presents its client certificate,
the bridge the host's) and the bridge -> worker gRPC channel (the bridge presents the host's
certificate). Prints ``dgr-relay-host: ready HOST:PORT`` once listening; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path


async def _serve(a: argparse.Namespace) -> int:
    from ..protocol.relay import RelayBridge
    from ..protocol.tls import TlsFiles

    host, _, port = a.listen.rpartition(":")
    tls = TlsFiles(a.ca, a.cert, a.key) if a.ca else None
    bridge = RelayBridge(a.worker, host=host, port=int(port),
                         tls=tls,
                         ssl=tls.server_context() if tls else None)
    await bridge.start()
    print(f"dgr-relay-host: ready {bridge.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)
    await stop.wait()
    await bridge.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgr.lab.relayhost", description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", required=True, help="HOST:PORT of the worker's gRPC service")
    p.add_argument("--listen", required=True, help="HOST:PORT for relay connections (port 0: any)")
    p.add_argument("--ca", type=Path)
    p.add_argument("--cert", type=Path)
    p.add_argument("--key", type=Path)
    a = p.parse_args(argv)
    return asyncio.run(_serve(a))


if __name__ == "__main__":
    sys.exit(main())
