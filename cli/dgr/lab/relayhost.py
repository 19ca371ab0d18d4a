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
import sys
from pathlib import Path


async def _serve(a: argparse.Namespace) -> int:
    from ..protocol.relay_host import relay_end, run_until_signalled
    from ..protocol.tls import TlsFiles

    tls = TlsFiles(a.ca, a.cert, a.key) if a.ca else None
    end = relay_end(worker=a.worker, egress=a.egress, listen=a.listen, tls=tls)
    await end.start()
    print(f"dgr-relay-host: ready {end.address}", flush=True)
    return await run_until_signalled(end)


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
