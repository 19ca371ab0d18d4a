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

import enum

import grpc

from ..shard.v1 import shard_runtime_pb2 as pb


class Reason(enum.StrEnum):
    """Why a step, a session or a route failed: one vocabulary for every layer above the wire
    (failover, work records, the gateway, the CLI). It holds every ``ErrorReason`` of the
    protocol (without its ``ERROR_REASON_`` prefix; UNSPECIFIED reads UNKNOWN), every gRPC status
    code, and the failures only a client sees: ``STREAM_CLOSED`` (a stream ended without an
    answer), ``KEEPALIVE`` (the client's own connection went silent), ``BAD_RESPONSE`` (an
    answer that breaks the protocol). Compare members, never message text."""

    # the protocol's ErrorReason values
    STALE_EPOCH = "STALE_EPOCH"
    CACHE_MISS = "CACHE_MISS"
    FINGERPRINT_MISMATCH = "FINGERPRINT_MISMATCH"
    BAD_BUNDLE = "BAD_BUNDLE"
    OVER_BUDGET = "OVER_BUDGET"
    UNKNOWN_SESSION = "UNKNOWN_SESSION"
    POSITION_GAP = "POSITION_GAP"
    TOKEN_OUT_OF_VOCAB = "TOKEN_OUT_OF_VOCAB"
    MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"
    ARTIFACT_MISMATCH = "ARTIFACT_MISMATCH"
    RANGE_MISMATCH = "RANGE_MISMATCH"
    SESSION_RELEASED = "SESSION_RELEASED"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"
    SCHEMA_UNSUPPORTED = "SCHEMA_UNSUPPORTED"
    STEP_OUT_OF_ORDER = "STEP_OUT_OF_ORDER"
    CHUNK_TOO_LARGE = "CHUNK_TOO_LARGE"
    ROLE_MISMATCH = "ROLE_MISMATCH"
    UNSUPPORTED_COMPRESSION = "UNSUPPORTED_COMPRESSION"
    BAD_REQUEST = "BAD_REQUEST"
    UNAVAILABLE = "UNAVAILABLE"
    SESSION_NOT_OWNED = "SESSION_NOT_OWNED"
    PEER_SILENT = "PEER_SILENT"
    # gRPC status codes not named above
    UNKNOWN = "UNKNOWN"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    DATA_LOSS = "DATA_LOSS"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    OK = "OK"
    # seen by a client only
    STREAM_CLOSED = "STREAM_CLOSED"
    KEEPALIVE = "KEEPALIVE"
    BAD_RESPONSE = "BAD_RESPONSE"

    @classmethod
    def of_error_reason(cls, value: int) -> "Reason":
        """The member of a protocol ``ErrorReason`` number (unknown numbers: UNKNOWN)."""
        try:
            name = pb.ErrorReason.Name(value)
        except ValueError:
            return cls.UNKNOWN
        return cls.UNKNOWN if value == pb.ERROR_REASON_UNSPECIFIED else cls(name.removeprefix("ERROR_REASON_"))

    @classmethod
    def of_status(cls, code: grpc.StatusCode, details: str = "") -> "Reason":
        """The member of a gRPC status. An expired keepalive reaches Python only as UNAVAILABLE
        with gRPC core's own text, so that text is read here, and nowhere else."""
        if code == grpc.StatusCode.UNAVAILABLE and ("keepalive" in details or "ping timeout" in details):
            return cls.KEEPALIVE
        return cls(code.name)

    @property
    def silent(self) -> bool:
        """Nothing came back: the peer froze or its link went dark (its late work is unknown)."""
        return self in (Reason.DEADLINE_EXCEEDED, Reason.KEEPALIVE, Reason.PEER_SILENT)


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
        self.reason_name = _reason_name(err.reason)
        self.kind = Reason.of_error_reason(err.reason)
        self.grpc_code = err.grpc_code
        self.terminated = err.session_terminated
        self.header = header
        super().__init__(f"{self.reason_name}: {err.message}")


def _reason_name(value: int) -> str:
    try:
        return pb.ErrorReason.Name(value)
    except ValueError:  # a newer worker's reason
        return f"ERROR_REASON_{value}"


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
