"""What can go wrong talking to a dgr-worker, as exception types shared by every client surface
(the sync and asyncio clients, the route driver's streams).

- :class:`WorkerError`: the RPC ended with a gRPC status (``code``, ``details``);
  :class:`WorkerUnavailable` is the UNAVAILABLE case (worker gone, connection lost);
- :class:`StreamClosed`: a Session stream ended (or was already over) before the answer came;
- :class:`StepTimeout`: no answer within the step deadline (the client's own bound);
- :class:`ShardError`: the worker answered a step with a structured error frame;
- :class:`BadResponse`: the worker's answer breaks the protocol (e.g. a boundary bundle whose
  fragments never all arrive).
"""

from __future__ import annotations

import grpc

from ..shard.v1 import shard_runtime_pb2 as pb


class WorkerError(Exception):
    """A gRPC failure talking to a worker (status code + details)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class WorkerUnavailable(WorkerError):
    """UNAVAILABLE: the worker is gone or not serving; retry elsewhere."""


class StreamClosed(WorkerError):
    """The Session stream ended (or was already over) without answering. ``code`` is its final
    status (OK: the worker closed it normally); ``status_known`` is False when the status could
    not be read (``code`` then reads OK)."""

    def __init__(self, code: grpc.StatusCode | None, details: str) -> None:
        super().__init__(code or grpc.StatusCode.OK, details)
        self.status_known = code is not None


class StepTimeout(TimeoutError):
    """No answer within the step deadline (seconds in ``timeout``)."""

    def __init__(self, target: str, timeout: float) -> None:
        super().__init__(f"no response from {target} within the step deadline ({timeout:g}s)")
        self.timeout = timeout


class ShardError(Exception):
    """A structured error frame (``ShardError``) answering one session step."""

    def __init__(self, err: pb.ShardError, header: pb.ResponseHeader | None = None) -> None:
        self.proto = err
        self.reason = err.reason
        self.reason_name = pb.ErrorReason.Name(err.reason)
        self.grpc_code = err.grpc_code
        self.terminated = err.session_terminated
        self.header = header
        super().__init__(f"{self.reason_name}: {err.message}")


class BadResponse(Exception):
    """An answer that breaks the protocol; ``reason`` names the kind (e.g. ``BAD_BUNDLE``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


def wrap_rpc_error(exc: grpc.RpcError) -> WorkerError:
    """A grpc (sync or aio) error as a :class:`WorkerError` (UNAVAILABLE: :class:`WorkerUnavailable`)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = WorkerUnavailable if code == grpc.StatusCode.UNAVAILABLE else WorkerError
    return cls(code, details or "")
