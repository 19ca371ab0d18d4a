"""The Shards of a route as the route driver holds them (:class:`ShardHandle`: endpoint, the
protocol client, capability) and how a route session fails (:class:`RouteError`,
:class:`RouteSessionError` naming the Shard; :func:`route_error` turns a session stream's
failure into one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from ..errors import DgrError
from ..protocol.client import AsyncWorkerClient
from ..protocol.errors import BadResponse, Reason, ShardError, StepTimeout, StreamClosed, WorkerError
from ..shard.v1 import shard_runtime_pb2 as pb


class RouteError(DgrError):
    """The route cannot be used (incomplete, incompatible, unreachable)."""


class ShardUnreachable(RouteError):
    """A shard of the route did not answer its capability call when the route was connected."""

    def __init__(self, endpoint: str, message: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint


class RouteSessionError(DgrError):
    """One route session failed: ``reason`` (a :class:`~dgr.protocol.errors.Reason`), the Shard
    it is attributed to (``shard_endpoint``, ``shard_range``) and the worker's words
    (``detail``, for people only). ``failed_endpoint``/``failed_range``: the Shard further down
    the chain that the answering Shard named as the one that failed (ShardError's
    ``failed_endpoint``), None when it named none. ``field``: the request field a BAD_REQUEST
    names (ShardError's ``field``, e.g. ``"sampling.json_schema"``), None when none."""

    def __init__(self, shard: "ShardHandle", reason: Reason | str, message: str, *, grpc_code: int | None = None,
                 failed_endpoint: str | None = None, failed_range: tuple[int, int] | None = None,
                 field: str | None = None) -> None:
        self.field = field or None
        self.shard_endpoint = shard.endpoint
        self.shard_range = (shard.start, shard.end)
        self.reason = as_reason(reason)
        self.detail = message
        self.grpc_code = grpc_code
        self.failed_endpoint = failed_endpoint or None
        self.failed_range = failed_range if self.failed_endpoint else None
        super().__init__(f"shard {shard.endpoint} [{shard.start}:{shard.end}) failed: {self.reason}: {message}")


def as_reason(reason: Reason | str) -> Reason:
    """A :class:`Reason` from a member or its name (an ``ERROR_REASON_`` prefix is dropped)."""
    if isinstance(reason, Reason):
        return reason
    name = reason.removeprefix("ERROR_REASON_")
    return Reason.UNKNOWN if name == "UNSPECIFIED" else Reason(name)


@dataclass
class ShardHandle:
    endpoint: str
    client: AsyncWorkerClient          # the one protocol client (channel, TLS, relayed hops)
    capability: pb.GetCapabilityResponse
    # what the previous Shard dials to reach this one in the chained mode (the endpoint unless
    # the hop is relayed: then a relay egress on the previous Shard's node; protocol/relay_egress.py)
    hop: str = ""

    @property
    def dialled_as(self) -> str:
        return self.hop or self.endpoint

    @property
    def channel(self) -> Any:
        return self.client.channel

    @property
    def start(self) -> int:
        return self.capability.identity.range.start

    @property
    def end(self) -> int:
        return self.capability.identity.range.end


STREAM_ERRORS = (WorkerError, ShardError, StepTimeout, BadResponse)


def route_error(shard: ShardHandle, exc: Exception) -> RouteSessionError:
    """A failure of one shard's session stream (protocol.errors types) as RouteSessionError."""
    if isinstance(exc, ShardError):
        p = exc.proto
        return RouteSessionError(shard, exc.kind, p.message, grpc_code=exc.grpc_code,
                                 failed_endpoint=p.failed_endpoint, failed_range=(p.failed_start, p.failed_end),
                                 field=p.field)
    if isinstance(exc, StepTimeout):
        return RouteSessionError(shard, Reason.DEADLINE_EXCEEDED, f"no answer within {exc.timeout:.0f}s")
    if isinstance(exc, StreamClosed):
        known = exc.status_known and exc.code != grpc.StatusCode.OK
        return RouteSessionError(shard, Reason.of_status(exc.code, exc.details) if known else Reason.STREAM_CLOSED,
                                 exc.details)
    if isinstance(exc, WorkerError):
        return RouteSessionError(shard, Reason.of_status(exc.code, exc.details), exc.details,
                                 grpc_code=exc.code.value[0])
    if isinstance(exc, BadResponse):
        return RouteSessionError(shard, Reason.__members__.get(exc.reason, Reason.BAD_RESPONSE), exc.message)
    raise TypeError(f"not a stream error: {exc!r}")
