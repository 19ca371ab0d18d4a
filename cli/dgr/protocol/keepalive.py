"""Failure detection on every gRPC hop: the keepalive settings and the bounds they give.

A peer can fail in two ways:

- **killed** (crash, ``kill -9``): its kernel closes the sockets, the next read or write on the
  connection fails at once (connection reset / refused). Detection is bounded by the time for
  that reset to arrive: one round trip, measured in tens of milliseconds (bound: <= 1 s).
- **silent** (a frozen process such as ``SIGSTOP``, a link that drops every packet, the lab's
  blackhole): the socket stays open and nothing comes back. Only HTTP/2 keepalive pings find
  it: every ``KEEPALIVE_TIME_MS`` without a read the connection sends a ping and fails every
  call on it when the ping is not acknowledged within ``KEEPALIVE_TIMEOUT_MS``. Detection is
  bounded by ``KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS`` (2 s, under the 3 s bound) after the
  last byte the peer sent.

The same values are used by the route driver's channels (driver -> head, stepwise: driver ->
every shard) and by the worker's chained hop (``worker/src/worker/downstream.cpp``: worker ->
next worker); the worker's server accepts pings this often (``serve.cpp``:
``GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS`` 1000, unlimited ping strikes). Every
Python server a route dials (the Transformers shard worker, the relay's egress) takes the same
policy from ``server_options()``: a server left at gRPC's defaults accepts one ping per 5 minutes
without data and, after two strikes, closes the connection with GOAWAY ``too_many_pings``, which
fails the call in flight.
``max_pings_without_data`` 0 keeps pinging while a stopped peer sends nothing back.

A link whose round trip rises above ``KEEPALIVE_TIMEOUT_MS`` is treated as failed: latency
spikes below it (and emulated packet loss, a retransmission timeout of delay per lost
segment) only slow the session down.
"""

from __future__ import annotations

KEEPALIVE_TIME_MS = 1000
KEEPALIVE_TIMEOUT_MS = 1000
KILLED_PEER_BOUND_S = 1.0
SILENT_PEER_BOUND_S = 3.0


def keepalive_options() -> list[tuple[str, int]]:
    """gRPC channel arguments for every client channel to a worker."""
    return [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # every ping (also gRPC's own flow-control pings) times out like a keepalive ping: a
        # keepalive waits behind a ping in flight, whose default timeout is 60 s
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ]


def server_options(min_ping_interval_ms: int = KEEPALIVE_TIME_MS) -> list[tuple[str, int]]:
    """gRPC server arguments that accept the pings of ``keepalive_options()`` channels.

    ``min_ping_interval_ms`` is the shortest gap between pings without data the server accepts;
    it must not exceed the interval its clients ping at. Ping strikes are unlimited, so a client
    pinging a little early is never sent away.
    """
    if min_ping_interval_ms < 0:
        raise ValueError(f"min_ping_interval_ms must be >= 0, got {min_ping_interval_ms}")
    return [
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", min_ping_interval_ms),
        ("grpc.http2.max_ping_strikes", 0),
    ]
