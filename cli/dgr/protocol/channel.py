"""The one way to open a gRPC channel to a dgr-worker: :func:`open_channel` with
:func:`channel_options`, used by the sync and asyncio clients, the route driver and the relay
bridge.

Security follows the ``tls`` argument (:class:`~dgr.protocol.tls.TlsFiles`):

- ``None``: insecure (plain HTTP/2; loopback and trusted networks);
- a CA only: TLS, the worker's certificate verified against the CA;
- a CA, certificate and key: mutual TLS (the worker verifies us too: ``dgr-worker serve
  --tls-client-ca``).

``credentials`` (a ready ``grpc.ChannelCredentials``) is accepted instead of ``tls`` for callers
that build their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from .tls import TlsFiles

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20

# Keepalive. A worker that stops answering without closing its connection (host down, link
# cut, process stopped) must show up as UNAVAILABLE in bounded time, on an idle channel too: the
# client pings every KEEPALIVE_TIME_MS and gives up when a ping is not answered within
# KEEPALIVE_TIMEOUT_MS, so a silent peer is found within ~15 s. Why these values: they are the
# ones the worker uses itself (its server and the chain links from a head to the next Shard), so
# a route has one liveness bound end to end; dgr-worker accepts pings as often as every second
# without data (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS 1000, no ping strikes), so
# it never answers them with a too_many_pings GOAWAY; a shorter timeout would risk declaring a
# worker dead while its host is saturated by a decode (a late pong, not a dead peer). Faster
# failure detection on a live session is the step deadline's job, not the keepalive's.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """grpc channel arguments of every channel to a worker.

    - keepalive (above), also without calls in flight, and with no cap on pings without data;
    - messages up to ``max_message_bytes`` both ways (boundary bundles of a whole prefill chunk
      are several MiB: rows x n_embd x 4 bytes);
    - no transparent retries: what to retry (another Shard, a new epoch) is the caller's decision,
      a hidden retry would only delay the failure it must see.
    """
    return [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.enable_retries", 0),
    ]


def open_channel(target: str, *, tls: "TlsFiles | None" = None, credentials: grpc.ChannelCredentials | None = None,
                 aio: bool = False, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
    """A ``grpc.Channel`` (``aio``: a ``grpc.aio.Channel``, to be used on the running event
    loop) to ``target`` (host:port): insecure, TLS or mutual TLS as ``tls`` says."""
    if tls is not None and credentials is not None:
        raise ValueError("pass tls or credentials, not both")
    if tls is not None:
        credentials = tls.grpc_credentials()
    opts = channel_options(max_message_bytes)
    mod = grpc.aio if aio else grpc
    if credentials is not None:
        return mod.secure_channel(target, credentials, options=opts)
    return mod.insecure_channel(target, options=opts)
