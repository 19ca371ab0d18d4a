"""Relay framing: the same serialized protobuf frames, carried as opaque length-delimited bytes.

A byte relay (Meshnet's relay, or anything that moves bytes) never parses dgr frames; it
moves records of the form ``varint(len) || bytes`` — the standard protobuf delimited encoding —
so the two ends can run the exact gRPC messages across it. :class:`FrameDecoder` accepts bytes
in arbitrary pieces and yields whole frames; a frame larger than the negotiated limit is an
error (never buffered without bound).
"""

from __future__ import annotations

from dgr.errors import DgrError

DEFAULT_MAX_FRAME = 64 << 20


class FrameTooLarge(DgrError):
    pass


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_frame(payload: bytes, *, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    if len(payload) > max_frame:
        raise FrameTooLarge(f"frame of {len(payload)} bytes exceeds the relay limit of {max_frame}")
    return _varint(len(payload)) + payload


class FrameDecoder:
    """Incremental decoder of varint-length-delimited frames."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        frames = []
        while True:
            n, shift, i = 0, 0, 0
            while i < len(self._buf):
                b = self._buf[i]
                n |= (b & 0x7F) << shift
                i += 1
                if not b & 0x80:
                    break
                shift += 7
                if shift > 63:
                    raise DgrError("relay stream corrupt: length varint longer than 10 bytes")
            else:
                return frames  # incomplete length prefix
            if n > self.max_frame:
                raise FrameTooLarge(f"incoming frame of {n} bytes exceeds the relay limit of {self.max_frame}")
            if len(self._buf) - i < n:
                return frames
            frames.append(bytes(self._buf[i:i + n]))
            del self._buf[:i + n]

    @property
    def pending(self) -> int:
        return len(self._buf)
