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

from .keepalive import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, keepalive_options  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from .tls import TlsFiles

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20

# Keepalive: the detection bounds of dgr.protocol.keepalive (a killed peer <= 1 s, a silent one
# <= 3 s: a ping after 1 s without a read, failed when not acknowledged within 1 s). The worker
# uses the same values on its server and on its chain links, and accepts pings every second
# without data (no too_many_pings GOAWAY). The price: a host so saturated that it cannot answer
# a ping within a second is treated as failed (its sessions restart elsewhere); measured on this
# project's 2-core machines at load average 7-10 no live worker was declared dead.


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """grpc channel arguments of every channel to a worker.

    - keepalive (above), also without calls in flight, and with no cap on pings without data;
    - messages up to ``max_message_bytes`` both ways (boundary bundles of a whole prefill chunk
      are several MiB: rows x n_embd x 4 bytes);
    - no transparent retries: what to retry (another Shard, a new epoch) is the caller's decision,
      a hidden retry would only delay the failure it must see;
    - connections of its own (a local subchannel pool): gRPC otherwise shares one connection
      among every channel of the process with the same target and options, so a new channel to
      a worker restarted on the same port got the old connection's failure (``Connection
      refused``) for as long as that one waited to reconnect (about 1 s of backoff) instead of
      dialling the new worker.
    """
    return [
        *keepalive_options(),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.enable_retries", 0),
        ("grpc.use_local_subchannel_pool", 1),
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
