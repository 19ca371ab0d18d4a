"""Both ends of a relayed hop on a lab host (``python -m dgr.lab.relayhost``).

``--worker HOST:PORT``: the worker side. Accepts relay connections on ``--listen`` (the host's
address) and runs each as one gRPC call on that worker (:class:`dgr.protocol.relay.RelayBridge`).

``--egress relay+tcp://HOST:PORT``: the dialling side, for a chained route. Accepts gRPC calls
on ``--listen`` (the previous Shard's worker dials it as its downstream) and carries each through
that relay (:class:`dgr.protocol.relay_egress.RelayEgress`).

With ``--ca/--cert/--key`` every side is mutual TLS with the host's certificate: the relay byte
stream, the bridge -> worker channel, and the egress's gRPC service. Prints
``dgr-relay-host: ready HOST:PORT`` once listening; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any


async def _serve(a: argparse.Namespace) -> int:
    from ..protocol.relay import RelayBridge
    from ..protocol.tls import TlsFiles

    host, _, port = a.listen.rpartition(":")
    tls = TlsFiles(a.ca, a.cert, a.key) if a.ca else None
    bridge: Any
    if a.egress:
        from ..protocol.relay_egress import RelayEgress

        creds = None
        if tls is not None:
            import grpc

            creds = grpc.ssl_server_credentials([(Path(a.key).read_bytes(), Path(a.cert).read_bytes())],
                                                root_certificates=Path(a.ca).read_bytes(),
                                                require_client_auth=True)
        bridge = RelayEgress(a.egress, host=host, port=int(port), server_credentials=creds,
                             ssl=tls.client_context() if tls else None)
    else:
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
    side = p.add_mutually_exclusive_group(required=True)
    side.add_argument("--worker", help="HOST:PORT of the worker's gRPC service (the bridge)")
    side.add_argument("--egress", help="relay+tcp://HOST:PORT of the next Shard's bridge (the egress)")
    p.add_argument("--listen", required=True, help="HOST:PORT for relay connections (port 0: any)")
    p.add_argument("--ca", type=Path)
    p.add_argument("--cert", type=Path)
    p.add_argument("--key", type=Path)
    a = p.parse_args(argv)
    return asyncio.run(_serve(a))


if __name__ == "__main__":
    sys.exit(main())
