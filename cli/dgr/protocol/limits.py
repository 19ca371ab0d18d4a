"""The limits a worker reports in GetCapability (``capacity``), read without fallbacks.

A dgr-worker always reports its effective limits (the defaults of its option table,
``dgr-worker options``, or what its flags set), so a limit of 0 means the peer is not a
dgr-worker of this protocol, or a broken one: callers get a :class:`CapabilityError` that names
the field and the endpoint instead of a silently assumed default.
"""

from __future__ import annotations

from ..errors import DgrError
from ..shard.v1 import shard_runtime_pb2 as pb

__all__ = ["REQUIRED_LIMITS", "CapabilityError", "capacity_limit", "check_capacity"]

# Every Capacity field a dgr-worker fills with a positive value.
REQUIRED_LIMITS = ("max_sessions", "kv_cells", "max_session_positions", "max_batch_tokens",
                   "max_prefill_chunk_tokens", "max_message_bytes", "max_fragment_bytes")


class CapabilityError(DgrError):
    """A worker's GetCapability lacks a limit (0): the peer is not a working dgr-worker."""


def capacity_limit(cap: pb.GetCapabilityResponse, field: str, *, endpoint: str = "") -> int:
    """``cap.capacity.<field>``; a :class:`CapabilityError` when it is 0 (missing)."""
    if field not in REQUIRED_LIMITS:
        raise ValueError(f"capacity.{field} is not a limit every worker reports ({', '.join(REQUIRED_LIMITS)})")
    value = int(getattr(cap.capacity, field))
    if value <= 0:
        where = f"worker {endpoint}" if endpoint else "the worker"
        raise CapabilityError(f"{where} reports no capacity.{field} (0) in GetCapability; a dgr-worker always "
                              "reports its limits", hint="is it a dgr-worker of this version? `dgr-worker --version`")
    return value


def check_capacity(cap: pb.GetCapabilityResponse, *, endpoint: str = "") -> None:
    """Raises :class:`CapabilityError` for the first of :data:`REQUIRED_LIMITS` that is 0."""
    for field in REQUIRED_LIMITS:
        capacity_limit(cap, field, endpoint=endpoint)
