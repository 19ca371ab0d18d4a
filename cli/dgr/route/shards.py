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
from ..protocol.errors import BadResponse, ShardError, StepTimeout, StreamClosed, WorkerError
from ..shard.v1 import shard_runtime_pb2 as pb


class RouteError(DgrError):
    """The route cannot be used (incomplete, incompatible, unreachable)."""


class RouteSessionError(DgrError):
    """One route session failed; names the Shard and the structured reason."""

    def __init__(self, shard: "ShardHandle", reason: str, message: str, *, grpc_code: int | None = None) -> None:
        self.shard_endpoint = shard.endpoint
        self.shard_range = (shard.start, shard.end)
        self.reason = reason
        self.detail = message
        self.grpc_code = grpc_code
        super().__init__(f"shard {shard.endpoint} [{shard.start}:{shard.end}) failed: {reason}: {message}")


@dataclass
class ShardHandle:
    endpoint: str
    client: AsyncWorkerClient          # the one protocol client (channel, TLS, relayed hops)
    capability: pb.GetCapabilityResponse

    @property
    def channel(self) -> Any:
        return self.client.channel

    @property
    def stub(self) -> Any:
        return self.client.stub

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
        return RouteSessionError(shard, exc.reason_name, exc.proto.message, grpc_code=exc.grpc_code)
    if isinstance(exc, StepTimeout):
        return RouteSessionError(shard, "DEADLINE_EXCEEDED", f"no answer within {exc.timeout:.0f}s")
    if isinstance(exc, StreamClosed):
        known = exc.status_known and exc.code != grpc.StatusCode.OK
        return RouteSessionError(shard, exc.code.name if known else "STREAM_CLOSED", exc.details)
    if isinstance(exc, WorkerError):
        return RouteSessionError(shard, exc.code.name, exc.details, grpc_code=exc.code.value[0])
    if isinstance(exc, BadResponse):
        return RouteSessionError(shard, exc.reason, exc.message)
    raise TypeError(f"not a stream error: {exc!r}")
