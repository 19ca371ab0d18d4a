"""Named-tensor bundle: writing, fragmenting, reassembly and every validation failure."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from dgr.protocol import bundle as B
from dgr.shard.v1 import shard_runtime_pb2 as pb


def _residual(n_tokens: int = 3, n_embd: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n_tokens, n_embd)).astype(np.float32)


def _reason(exc: pytest.ExceptionInfo) -> str:
    return exc.value.reason_name


def test_round_trip_single_fragment_is_bit_exact():
    x = _residual()
    msg = B.boundary_bundle(x)
    t = msg.tensors[0]
    assert (t.name, list(t.shape), t.dtype, t.byte_order) == ("residual", [3, 8], pb.TENSOR_DTYPE_F32,
                                                               pb.BYTE_ORDER_LITTLE_ENDIAN)
    assert t.byte_size == x.nbytes and t.fragment_count == 1
    assert t.checksum.algorithm == pb.CHECKSUM_ALGORITHM_CRC32
    assert t.checksum.value == zlib.crc32(x.astype("<f4").tobytes())
    back = B.read_boundary(pb.TensorBundle.FromString(msg.SerializeToString()), n_tokens=3, n_embd=8)
    assert back.dtype == np.float32 and back.tobytes() == x.tobytes()


def test_fragments_are_bounded_and_reassemble_in_any_order_across_frames():
    x = _residual(5, 16)
    msg = B.boundary_bundle(x, fragment_bytes=48)
    t = msg.tensors[0]
    assert t.fragment_count == -(-x.nbytes // 48)
    assert all(len(f.data) <= 48 for f in t.fragments)
    parts = B.split_bundle(msg, 100)
    assert len(parts) > 2 and all(sum(len(f.data) for tt in p.tensors for f in tt.fragments) <= 100 for p in parts)
    asm = B.BundleAssembler(max_fragment_bytes=48)
    for p in reversed(parts):
        assert not asm.complete()
        asm.add(p)
    assert asm.complete() and asm.missing() == {}
    assert asm.finish()["residual"].tobytes() == x.tobytes()


def test_several_tensors_dtypes_and_big_endian():
    ids = np.arange(-3, 3, dtype=np.int32)
    half = np.linspace(-1, 1, 6, dtype=np.float16).reshape(2, 3)
    bf16_bits = np.array([0x3F80, 0xC000], dtype=np.uint16)  # 1.0, -2.0
    msg = B.make_bundle({"ids": ids, "half": half})
    msg.tensors.append(B.tensor_message("bf", bf16_bits, dtype=pb.TENSOR_DTYPE_BF16))
    msg.tensors.append(B.tensor_message("be", half.astype(np.float32), big_endian=True))
    assert msg.tensors[3].byte_order == pb.BYTE_ORDER_BIG_ENDIAN
    assert msg.tensors[3].fragments[0].data == half.astype(">f4").tobytes()
    out = B.read_bundle(msg)
    assert list(out) == ["ids", "half", "bf", "be"]
    assert np.array_equal(out["ids"], ids) and np.array_equal(out["half"], half)
    assert np.array_equal(out["bf"], bf16_bits)
    assert out["be"].dtype.isnative and np.array_equal(out["be"], half.astype(np.float32))


def test_unspecified_byte_order_and_missing_checksum_are_accepted():
    """Older/minimal writers: zero values mean little-endian and 'no checksum'."""
    x = _residual(1, 4)
    msg = B.boundary_bundle(x)
    t = msg.tensors[0]
    t.byte_order = pb.BYTE_ORDER_UNSPECIFIED
    t.ClearField("checksum")
    assert B.read_boundary(msg, n_tokens=1, n_embd=4).tobytes() == x.tobytes()


def _one(**changes) -> pb.TensorBundle:
    msg = B.boundary_bundle(_residual(2, 4), fragment_bytes=8)
    t = msg.tensors[0]
    for k, v in changes.items():
        if k == "shape":
            del t.shape[:]
            t.shape.extend(v)
        else:
            setattr(t, k, v)
    return msg


@pytest.mark.parametrize("changes, needle", [
    ({"shape": [2, 5]}, "byte_size says"),                     # shape disagrees with bytes
    ({"shape": [2, 0, 4]}, "zero dimension"),
    ({"shape": [1] * 9}, "dimensions"),
    ({"dtype": pb.TENSOR_DTYPE_F16}, "byte_size says"),        # dtype size disagrees
    ({"dtype": 0}, "unknown dtype"),
    ({"dtype": 42}, "unknown dtype"),
    ({"byte_order": 7}, "unknown byte order"),
    ({"name": ""}, "empty name"),
    ({"byte_size": 33}, "byte_size says"),
    ({"fragment_count": 0}, "fragment_count"),
])
def test_bad_metadata_is_bad_bundle(changes, needle):
    with pytest.raises(B.ShardProtocolError) as exc:
        B.read_bundle(_one(**changes))
    assert _reason(exc) == "ERROR_REASON_BAD_BUNDLE" and exc.value.grpc_code == 3
    assert needle in str(exc.value)


def test_checksum_mismatch_is_bad_bundle():
    msg = _one()
    msg.tensors[0].checksum.value ^= 1
    with pytest.raises(B.ShardProtocolError, match="checksum") as exc:
        B.read_bundle(msg)
    assert _reason(exc) == "ERROR_REASON_BAD_BUNDLE"
    err = exc.value.to_message()
    assert err.reason == pb.ERROR_REASON_BAD_BUNDLE and err.grpc_code == 3 and not err.session_terminated


def test_corrupt_fragment_data_is_caught_by_checksum():
    msg = _one()
    frag = msg.tensors[0].fragments[1]
    frag.data = bytes([frag.data[0] ^ 0x80]) + frag.data[1:]
    with pytest.raises(B.ShardProtocolError, match="checksum"):
        B.read_bundle(msg)


def test_missing_fragment_is_named():
    msg = _one()
    del msg.tensors[0].fragments[2]
    asm = B.BundleAssembler()
    asm.add(msg)
    assert not asm.complete() and asm.missing() == {"residual": [2]}
    with pytest.raises(B.ShardProtocolError, match=r"missing fragment\(s\) 2 of 4") as exc:
        asm.finish()
    assert _reason(exc) == "ERROR_REASON_BAD_BUNDLE"


@pytest.mark.parametrize("mutate, needle", [
    (lambda t: t.fragments.add(index=1, data=b"\0" * 8), "received twice"),
    (lambda t: setattr(t.fragments[0], "index", 9), "fragment index 9"),
    (lambda t: setattr(t.fragments[0], "data", b""), "is empty"),
    (lambda t: setattr(t.fragments[3], "data", t.fragments[3].data + b"\0"), "exceed byte_size"),
])
def test_bad_fragments(mutate, needle):
    msg = _one()
    mutate(msg.tensors[0])
    with pytest.raises(B.ShardProtocolError, match=needle) as exc:
        B.read_bundle(msg)
    assert _reason(exc) == "ERROR_REASON_BAD_BUNDLE"


def test_short_reassembly_is_rejected():
    msg = _one()
    t = msg.tensors[0]
    t.fragments[3].data = t.fragments[3].data[:4]
    with pytest.raises(B.ShardProtocolError, match="reassembled 28 bytes"):
        B.read_bundle(msg)


def test_metadata_must_agree_across_frames_and_names_are_unique():
    parts = B.split_bundle(_one(), 16)
    parts[1].tensors[0].shape[0] = 1
    parts[1].tensors[0].shape.append(2)
    with pytest.raises(B.ShardProtocolError, match="differs between frames"):
        B.read_bundle(parts)
    dup = _one()
    dup.tensors.append(dup.tensors[0])
    with pytest.raises(B.ShardProtocolError, match="named twice"):
        B.read_bundle(dup)


def test_oversized_tensor_and_fragment_are_message_too_large():
    msg = _one()
    with pytest.raises(B.ShardProtocolError) as exc:
        B.read_bundle(msg, max_tensor_bytes=16)
    assert _reason(exc) == "ERROR_REASON_MESSAGE_TOO_LARGE" and exc.value.grpc_code == 8 and exc.value.limit == 16
    with pytest.raises(B.ShardProtocolError) as exc:
        B.read_bundle(msg, max_fragment_bytes=4)
    assert _reason(exc) == "ERROR_REASON_MESSAGE_TOO_LARGE"


def test_reserved_compression_is_refused():
    for c in (pb.COMPRESSION_F16, pb.COMPRESSION_Q8_0, 99):
        with pytest.raises(B.ShardProtocolError) as exc:
            B.read_bundle(_one(), compression=c)
        assert _reason(exc) == "ERROR_REASON_UNSUPPORTED_COMPRESSION"
    B.read_bundle(_one(), compression=pb.COMPRESSION_NONE)


def test_boundary_shape_is_enforced():
    msg = B.boundary_bundle(_residual(2, 4))
    with pytest.raises(B.ShardProtocolError, match=r"expected f32 \[3, 4\]"):
        B.read_boundary(msg, n_tokens=3, n_embd=4)
    other = B.make_bundle({"hidden": _residual(2, 4)})
    with pytest.raises(B.ShardProtocolError, match="exactly 'residual'"):
        B.read_boundary(other, n_tokens=2, n_embd=4)
    with pytest.raises(B.ShardProtocolError, match="no tensor"):
        B.read_bundle(pb.TensorBundle())


def test_frame_payload_checksum_covers_tokens_and_fragment_data():
    span = pb.TokenSpan(token_ids=[1, -2, 70000])
    assert B.frame_payload_checksum(span).value == zlib.crc32(np.array([1, -2, 70000], "<i4").tobytes())
    assert B.frame_payload_checksum(None).value == 0
    parts = B.split_bundle(_one(), 16)
    for p in parts:
        want = zlib.crc32(b"".join(f.data for t in p.tensors for f in t.fragments))
        assert B.frame_payload_checksum(p).value == want
        B.verify_frame_payload(p, B.frame_payload_checksum(p))
    with pytest.raises(B.ShardProtocolError, match="frame payload checksum"):
        B.verify_frame_payload(parts[0], pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_CRC32, value=1))
    B.verify_frame_payload(parts[0], pb.Checksum())  # unset: not verified


def test_every_error_reason_maps_to_a_grpc_code():
    for name, value in pb.ErrorReason.items():
        assert value in B.GRPC_CODE_BY_REASON, name
    assert B.grpc_code_for(pb.ERROR_REASON_STALE_EPOCH) == 10        # ABORTED: retry higher
    assert B.grpc_code_for(pb.ERROR_REASON_UNAVAILABLE) == 14        # UNAVAILABLE: retry call
    assert B.grpc_code_for(pb.ERROR_REASON_OVER_BUDGET) == 8         # RESOURCE_EXHAUSTED
    assert B.grpc_code_for(pb.ERROR_REASON_FINGERPRINT_MISMATCH) == 9  # FAILED_PRECONDITION
    assert B.grpc_code_for(pb.ERROR_REASON_CANCELLED) == 1
    assert B.grpc_code_for(999) == 2
