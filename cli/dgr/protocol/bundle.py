"""The named-tensor bundle crossing an Activation Seam (``dgr.shard.v1.TensorBundle``).

Writing: numpy arrays -> ``TensorBundle`` with the payload split in bounded fragments and a
CRC-32 per tensor (:func:`make_bundle`, :func:`boundary_bundle`, :func:`split_bundle` to spread
a large bundle over several frames). Reading: :class:`BundleAssembler` accepts the bundles of
one step (one or several frames), validates every rule of ``NamedTensor`` in the .proto and
returns native-order numpy arrays; every failure is a :class:`ShardProtocolError` carrying the
``ErrorReason`` and the gRPC status code it maps to. ``worker/src/common/bundle.h`` implements
the same rules in C++.

Checksums are CRC-32/IEEE (``zlib.crc32``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import DgrError
from ..shard.v1 import shard_runtime_pb2 as pb

#: Fragment size writers use unless the peer advertises a smaller ``max_fragment_bytes``.
DEFAULT_FRAGMENT_BYTES = 1 << 20
#: Most dimensions a tensor may have.
MAX_DIMS = 8
#: The boundary bundle's one tensor in schema v1: residual entering the next layer.
RESIDUAL = "residual"

# numpy dtype (little-endian) per wire dtype; BF16 travels as its raw 16-bit patterns (uint16).
_NP_DTYPE = {
    pb.TENSOR_DTYPE_F32: np.dtype("<f4"),
    pb.TENSOR_DTYPE_F16: np.dtype("<f2"),
    pb.TENSOR_DTYPE_BF16: np.dtype("<u2"),
    pb.TENSOR_DTYPE_I32: np.dtype("<i4"),
}
_WIRE_DTYPE = {np.dtype(np.float32): pb.TENSOR_DTYPE_F32, np.dtype(np.float16): pb.TENSOR_DTYPE_F16,
               np.dtype(np.int32): pb.TENSOR_DTYPE_I32}

# ErrorReason -> gRPC status code number (see the ErrorReason comments in the .proto).
_OK, _CANCELLED, _UNKNOWN, _INVALID_ARGUMENT, _PERMISSION_DENIED = 0, 1, 2, 3, 7
_RESOURCE_EXHAUSTED, _FAILED_PRECONDITION, _ABORTED, _INTERNAL, _UNAVAILABLE = 8, 9, 10, 13, 14
GRPC_CODE_BY_REASON: dict[int, int] = {
    pb.ERROR_REASON_UNSPECIFIED: _UNKNOWN,
    pb.ERROR_REASON_STALE_EPOCH: _ABORTED,
    pb.ERROR_REASON_CACHE_MISS: _ABORTED,
    pb.ERROR_REASON_FINGERPRINT_MISMATCH: _FAILED_PRECONDITION,
    pb.ERROR_REASON_BAD_BUNDLE: _INVALID_ARGUMENT,
    pb.ERROR_REASON_OVER_BUDGET: _RESOURCE_EXHAUSTED,
    pb.ERROR_REASON_UNKNOWN_SESSION: _ABORTED,
    pb.ERROR_REASON_POSITION_GAP: _ABORTED,
    pb.ERROR_REASON_TOKEN_OUT_OF_VOCAB: _INVALID_ARGUMENT,
    pb.ERROR_REASON_MESSAGE_TOO_LARGE: _RESOURCE_EXHAUSTED,
    pb.ERROR_REASON_ARTIFACT_MISMATCH: _FAILED_PRECONDITION,
    pb.ERROR_REASON_RANGE_MISMATCH: _FAILED_PRECONDITION,
    pb.ERROR_REASON_SESSION_RELEASED: _FAILED_PRECONDITION,
    pb.ERROR_REASON_CANCELLED: _CANCELLED,
    pb.ERROR_REASON_INTERNAL: _INTERNAL,
    pb.ERROR_REASON_SCHEMA_UNSUPPORTED: _FAILED_PRECONDITION,
    pb.ERROR_REASON_STEP_OUT_OF_ORDER: _ABORTED,
    pb.ERROR_REASON_CHUNK_TOO_LARGE: _INVALID_ARGUMENT,
    pb.ERROR_REASON_ROLE_MISMATCH: _FAILED_PRECONDITION,
    pb.ERROR_REASON_UNSUPPORTED_COMPRESSION: _INVALID_ARGUMENT,
    pb.ERROR_REASON_BAD_REQUEST: _INVALID_ARGUMENT,
    pb.ERROR_REASON_UNAVAILABLE: _UNAVAILABLE,
    pb.ERROR_REASON_SESSION_NOT_OWNED: _PERMISSION_DENIED,
    pb.ERROR_REASON_PEER_SILENT: _UNAVAILABLE,
}


def grpc_code_for(reason: int) -> int:
    """The numeric gRPC status code an ``ErrorReason`` maps to (UNKNOWN for unknown reasons)."""
    return GRPC_CODE_BY_REASON.get(reason, _UNKNOWN)


class ShardProtocolError(DgrError):
    """A frame or bundle broke the protocol; carries the machine-readable reason."""

    def __init__(self, reason: int, message: str, *, tensor: str | None = None, limit: int = 0) -> None:
        self.reason = reason
        self.reason_name = pb.ErrorReason.Name(reason)
        self.grpc_code = grpc_code_for(reason)
        self.tensor = tensor
        self.limit = limit
        where = f" (tensor {tensor!r})" if tensor else ""
        super().__init__(f"{self.reason_name}: {message}{where}")

    def to_message(self, *, session_terminated: bool = False) -> pb.ShardError:
        """The ``ShardError`` frame body for this error."""
        return pb.ShardError(reason=self.reason, grpc_code=self.grpc_code, message=str(self),
                             session_terminated=session_terminated, limit=self.limit)


def crc32(data: bytes | bytearray | memoryview) -> int:
    """CRC-32/IEEE, unsigned (the protocol's CHECKSUM_ALGORITHM_CRC32)."""
    return zlib.crc32(data) & 0xFFFFFFFF


def checksum(data: bytes | bytearray | memoryview) -> pb.Checksum:
    return pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_CRC32, value=crc32(data))


def token_payload(token_ids: Sequence[int]) -> bytes:
    """The bytes a TokenSpan's frame checksum covers: each id as 4-byte little-endian."""
    return np.asarray(token_ids, dtype="<i4").tobytes()


def frame_payload_checksum(payload: pb.TokenSpan | pb.TensorBundle | None) -> pb.Checksum:
    """``FrameHeader.payload_checksum`` for a frame carrying ``payload``."""
    if payload is None:
        return checksum(b"")
    if isinstance(payload, pb.TokenSpan):
        return checksum(token_payload(payload.token_ids))
    crc = 0
    for t in payload.tensors:
        for f in t.fragments:
            crc = zlib.crc32(f.data, crc)
    return pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_CRC32, value=crc & 0xFFFFFFFF)


def verify_frame_payload(payload: pb.TokenSpan | pb.TensorBundle | None, expected: pb.Checksum) -> None:
    """Raise BAD_BUNDLE when a set frame checksum does not match the payload."""
    if expected.algorithm == pb.CHECKSUM_ALGORITHM_UNSPECIFIED:
        return
    if expected.algorithm != pb.CHECKSUM_ALGORITHM_CRC32:
        raise ShardProtocolError(pb.ERROR_REASON_BAD_REQUEST, f"unknown checksum algorithm {expected.algorithm}")
    got = frame_payload_checksum(payload).value
    if got != expected.value:
        raise ShardProtocolError(pb.ERROR_REASON_BAD_BUNDLE,
                                 f"frame payload checksum {got:08x} != {expected.value:08x}")


# ---- writing -------------------------------------------------------------------------------

def tensor_message(name: str, array: np.ndarray, *, dtype: int | None = None,
                   fragment_bytes: int = DEFAULT_FRAGMENT_BYTES,
                   big_endian: bool = False) -> pb.NamedTensor:
    """One array -> NamedTensor with every fragment. ``dtype`` is needed only for BF16
    (pass the raw uint16 bit patterns); otherwise it follows the array (f32, f16, i32)."""
    if fragment_bytes < 1:
        raise ValueError("fragment_bytes must be >= 1")
    arr = np.asarray(array)
    if dtype is None:
        try:
            dtype = _WIRE_DTYPE[arr.dtype.newbyteorder("=")]
        except KeyError:
            raise DgrError(f"tensor {name!r}: dtype {arr.dtype} has no wire dtype",
                           hint="use float32, float16 or int32 (bf16: uint16 bits with dtype=TENSOR_DTYPE_BF16)")
    wire = _NP_DTYPE[dtype].newbyteorder(">" if big_endian else "<")
    if arr.dtype.itemsize != wire.itemsize:
        raise DgrError(f"tensor {name!r}: array of {arr.dtype} cannot be carried as {pb.TensorDtype.Name(dtype)}")
    data = np.ascontiguousarray(arr.astype(wire, copy=False)).tobytes()
    n_frag = max(1, math.ceil(len(data) / fragment_bytes))
    msg = pb.NamedTensor(
        name=name, shape=list(arr.shape), dtype=dtype,
        byte_order=pb.BYTE_ORDER_BIG_ENDIAN if big_endian else pb.BYTE_ORDER_LITTLE_ENDIAN,
        byte_size=len(data), fragment_count=n_frag, checksum=checksum(data))
    for i in range(n_frag):
        msg.fragments.add(index=i, data=data[i * fragment_bytes:(i + 1) * fragment_bytes])
    return msg


def make_bundle(tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]], *,
                fragment_bytes: int = DEFAULT_FRAGMENT_BYTES) -> pb.TensorBundle:
    """Arrays (in the given order) -> one TensorBundle carrying every fragment."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    bundle = pb.TensorBundle()
    for name, arr in items:
        bundle.tensors.append(tensor_message(name, arr, fragment_bytes=fragment_bytes))
    return bundle


def boundary_bundle(residual: np.ndarray, *, fragment_bytes: int = DEFAULT_FRAGMENT_BYTES) -> pb.TensorBundle:
    """The v1 boundary bundle: ``residual`` [n_tokens, n_embd] f32."""
    arr = np.asarray(residual)
    if arr.ndim != 2 or arr.dtype != np.float32:
        raise DgrError(f"boundary residual must be a 2-D float32 array, got {arr.dtype} {arr.shape}")
    return make_bundle({RESIDUAL: arr}, fragment_bytes=fragment_bytes)


def split_bundle(bundle: pb.TensorBundle, max_frame_payload_bytes: int) -> list[pb.TensorBundle]:
    """Spread a bundle's fragments over several bundles (one per frame), each carrying at most
    ``max_frame_payload_bytes`` of fragment data (at least one fragment each); tensor metadata is
    repeated in every part that carries one of its fragments."""
    parts: list[pb.TensorBundle] = []
    cur: pb.TensorBundle | None = None
    used = 0
    for t in bundle.tensors:
        for f in t.fragments:
            if cur is None or (used and used + len(f.data) > max_frame_payload_bytes):
                cur = pb.TensorBundle()
                parts.append(cur)
                used = 0
            if not cur.tensors or cur.tensors[-1].name != t.name:
                meta = pb.NamedTensor()
                meta.CopyFrom(t)
                del meta.fragments[:]
                cur.tensors.append(meta)
            cur.tensors[-1].fragments.append(f)
            used += len(f.data)
    return parts or [pb.TensorBundle()]


# ---- reading -------------------------------------------------------------------------------

@dataclass
class _Pending:
    meta: pb.NamedTensor  # without fragments
    parts: dict[int, bytes] = field(default_factory=dict)
    received: int = 0


def _bad(message: str, tensor: str | None = None) -> ShardProtocolError:
    return ShardProtocolError(pb.ERROR_REASON_BAD_BUNDLE, message, tensor=tensor)


def _gaps(p: _Pending, most: int) -> list[int]:
    """The first ``most`` fragment indices not received; bounded work whatever fragment_count says
    (every index past the last received one is missing)."""
    out: list[int] = []
    for i in range(p.meta.fragment_count):
        if len(out) >= most:
            break
        if i not in p.parts:
            out.append(i)
    return out


class BundleAssembler:
    """Collects the bundle(s) of one step, validating as they arrive.

    ``max_tensor_bytes`` bounds each tensor's byte_size and ``max_fragment_bytes`` each
    fragment (MESSAGE_TOO_LARGE); ``compression`` is the frame header's.
    """

    def __init__(self, *, max_tensor_bytes: int | None = None, max_fragment_bytes: int | None = None,
                 compression: int = pb.COMPRESSION_UNSPECIFIED) -> None:
        if compression not in (pb.COMPRESSION_UNSPECIFIED, pb.COMPRESSION_NONE):
            name = pb.Compression.Name(compression) if compression in pb.Compression.values() else str(compression)
            raise ShardProtocolError(pb.ERROR_REASON_UNSUPPORTED_COMPRESSION,
                                     f"compression {name} is not supported by schema v1 receivers")
        self.max_tensor_bytes = max_tensor_bytes
        self.max_fragment_bytes = max_fragment_bytes
        self._tensors: dict[str, _Pending] = {}

    def _check_meta(self, t: pb.NamedTensor) -> None:
        name = t.name
        if not name:
            raise _bad("tensor with an empty name")
        if t.dtype not in _NP_DTYPE:
            raise _bad(f"unknown dtype {t.dtype}", name)
        if t.byte_order not in (pb.BYTE_ORDER_UNSPECIFIED, pb.BYTE_ORDER_LITTLE_ENDIAN, pb.BYTE_ORDER_BIG_ENDIAN):
            raise _bad(f"unknown byte order {t.byte_order}", name)
        if len(t.shape) > MAX_DIMS:
            raise _bad(f"{len(t.shape)} dimensions, at most {MAX_DIMS}", name)
        if any(d == 0 for d in t.shape):
            raise _bad(f"shape {list(t.shape)} has a zero dimension", name)
        if self.max_tensor_bytes is not None and t.byte_size > self.max_tensor_bytes:
            raise ShardProtocolError(pb.ERROR_REASON_MESSAGE_TOO_LARGE,
                                     f"byte_size {t.byte_size} above the limit {self.max_tensor_bytes}",
                                     tensor=name, limit=self.max_tensor_bytes)
        want = math.prod(t.shape) * _NP_DTYPE[t.dtype].itemsize
        if want != t.byte_size:
            raise _bad(f"shape {list(t.shape)} x {pb.TensorDtype.Name(t.dtype)} is {want} bytes, "
                       f"byte_size says {t.byte_size}", name)
        if not 1 <= t.fragment_count <= t.byte_size:
            raise _bad(f"fragment_count {t.fragment_count} outside [1, {t.byte_size}]", name)
        if t.checksum.algorithm not in (pb.CHECKSUM_ALGORITHM_UNSPECIFIED, pb.CHECKSUM_ALGORITHM_CRC32):
            raise _bad(f"unknown checksum algorithm {t.checksum.algorithm}", name)

    def add(self, bundle: pb.TensorBundle) -> None:
        """Take one frame's bundle. Raises ShardProtocolError on the first violation."""
        seen_here: set[str] = set()
        for t in bundle.tensors:
            if t.name in seen_here:
                raise _bad("tensor named twice in one bundle", t.name)
            seen_here.add(t.name)
            meta = pb.NamedTensor()
            meta.CopyFrom(t)
            del meta.fragments[:]
            pending = self._tensors.get(t.name)
            if pending is None:
                self._check_meta(t)
                pending = self._tensors[t.name] = _Pending(meta)
            elif pending.meta.SerializeToString(deterministic=True) != meta.SerializeToString(deterministic=True):
                raise _bad("tensor metadata differs between frames of one step", t.name)
            for f in t.fragments:
                if f.index >= t.fragment_count:
                    raise _bad(f"fragment index {f.index} >= fragment_count {t.fragment_count}", t.name)
                if f.index in pending.parts:
                    raise _bad(f"fragment {f.index} received twice", t.name)
                if not f.data:
                    raise _bad(f"fragment {f.index} is empty", t.name)
                if self.max_fragment_bytes is not None and len(f.data) > self.max_fragment_bytes:
                    raise ShardProtocolError(pb.ERROR_REASON_MESSAGE_TOO_LARGE,
                                             f"fragment {f.index} is {len(f.data)} bytes, above {self.max_fragment_bytes}",
                                             tensor=t.name, limit=self.max_fragment_bytes)
                if pending.received + len(f.data) > t.byte_size:
                    raise _bad(f"fragments exceed byte_size {t.byte_size}", t.name)
                pending.parts[f.index] = bytes(f.data)
                pending.received += len(f.data)

    def complete(self) -> bool:
        """Every fragment of every tensor seen so far has arrived (and at least one tensor)."""
        return bool(self._tensors) and all(len(p.parts) == p.meta.fragment_count for p in self._tensors.values())

    def missing(self) -> dict[str, list[int]]:
        """Missing fragment indices per incomplete tensor (at most the first 1024 each, as the
        worker lists them: fragment_count is the sender's word, up to 2**32 - 1)."""
        return {name: _gaps(p, 1024) for name, p in self._tensors.items() if len(p.parts) != p.meta.fragment_count}

    def finish(self) -> dict[str, np.ndarray]:
        """Reassemble and verify; arrays in native byte order, in arrival order of names."""
        if not self._tensors:
            raise _bad("bundle carries no tensor")
        out: dict[str, np.ndarray] = {}
        for name, p in self._tensors.items():
            t = p.meta
            if len(p.parts) != t.fragment_count:
                gaps = _gaps(p, 9)
                shown = ", ".join(map(str, gaps[:8])) + (" ..." if len(gaps) > 8 else "")
                raise _bad(f"missing fragment(s) {shown} of {t.fragment_count}", name)
            data = b"".join(p.parts[i] for i in range(t.fragment_count))
            if len(data) != t.byte_size:
                raise _bad(f"reassembled {len(data)} bytes, byte_size says {t.byte_size}", name)
            if t.checksum.algorithm == pb.CHECKSUM_ALGORITHM_CRC32 and crc32(data) != t.checksum.value:
                raise _bad(f"checksum {crc32(data):08x} != {t.checksum.value:08x}", name)
            wire = _NP_DTYPE[t.dtype].newbyteorder(">" if t.byte_order == pb.BYTE_ORDER_BIG_ENDIAN else "<")
            arr = np.frombuffer(data, dtype=wire).reshape(tuple(t.shape))
            out[name] = arr.astype(wire.newbyteorder("="), copy=True)
        return out


def read_bundle(bundles: pb.TensorBundle | Iterable[pb.TensorBundle], *,
                max_tensor_bytes: int | None = None, max_fragment_bytes: int | None = None,
                compression: int = pb.COMPRESSION_UNSPECIFIED) -> dict[str, np.ndarray]:
    """Validate and reassemble the bundle(s) of one step into ``{name: array}``."""
    asm = BundleAssembler(max_tensor_bytes=max_tensor_bytes, max_fragment_bytes=max_fragment_bytes,
                          compression=compression)
    for b in ([bundles] if isinstance(bundles, pb.TensorBundle) else bundles):
        asm.add(b)
    return asm.finish()


def read_boundary(bundles: pb.TensorBundle | Iterable[pb.TensorBundle], *, n_tokens: int, n_embd: int,
                  **limits: int) -> np.ndarray:
    """The v1 boundary bundle -> residual [n_tokens, n_embd] float32, checking it is exactly that."""
    arrays = read_bundle(bundles, **limits)
    if set(arrays) != {RESIDUAL}:
        raise _bad(f"boundary bundle must carry exactly {RESIDUAL!r}, got {sorted(arrays)}")
    arr = arrays[RESIDUAL]
    if arr.dtype != np.float32 or arr.shape != (n_tokens, n_embd):
        raise _bad(f"expected f32 [{n_tokens}, {n_embd}], got {arr.dtype} {list(arr.shape)}", RESIDUAL)
    return arr
