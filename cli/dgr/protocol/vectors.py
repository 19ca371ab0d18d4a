"""Golden binary vectors of the shard protocol (``tests/vectors/proto/``).

``dgr proto vectors --write`` serializes a fixed set of messages (:data:`CASES`) into
``<name>.bin`` files and writes ``index.txt``, a line format that Python (tests/test_proto.py)
and C++ (worker/tests/proto_vectors_test.cpp) both read:

    vector NAME          starts a block
    type FULL.NAME       message type to decode the bytes as (current schema)
    file NAME.bin        the frame bytes
    kind K               current | older_schema | newer_schema (who wrote the bytes)
    handling H           decode | accept | reject:ERROR_REASON_X (check_frame of a SessionRequest:
                         the frame's rules, then its bundle's)
    capability NAME      (optional) the handling is checked against the Shard of vector NAME
    reencode identical   re-serializing the decoded message gives the same bytes (unknowns kept)
    field PATH VALUE     every set field of the decoded message, field-number order
    end                  ends a block
    reason NAME CODE     the ErrorReason -> gRPC code table (outside blocks)

PATH: field names joined by ``.``; repeated elements ``name[i]``; map entries ``name{key}``
(entries sorted by key). VALUE: integers in decimal; ``true``/``false``; enums by value name
(the number when unknown); strings ``s:`` + text with bytes outside ``[A-Za-z0-9._~/:-]``
as ``%XX``; bytes ``x:`` + lowercase hex; float ``f:`` + the 8 hex digits of its IEEE bits,
double ``d:`` + 16. Older- and newer-schema bytes come from schemas derived from the current
descriptor (fields removed / fields, a frame kind and an enum value added), never by hand.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from . import bundle as B
from . import vector_rules as R
from ..errors import DgrError
from ..paths import repo_root
from ..shard.v1 import shard_runtime_pb2 as pb

PKG = "dgr.shard.v1"
INDEX = "index.txt"
FINGERPRINT = R.FINGERPRINT
ARTIFACT = R.ARTIFACT
def vectors_dir(root: Path | None = None) -> Path:
    return (root or repo_root()) / "tests" / "vectors" / "proto"


# ---- flattening (the same algorithm lives in worker/tests/proto_vectors_test.cpp) ----------

_SAFE = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._~/:-")


def _pct(raw: bytes) -> str:
    return "".join(chr(c) if c in _SAFE else f"%{c:02X}" for c in raw)


def _scalar(fd: FieldDescriptor, v) -> str:
    t = fd.type
    if t == FieldDescriptor.TYPE_BOOL:
        return "true" if v else "false"
    if t == FieldDescriptor.TYPE_ENUM:
        ev = fd.enum_type.values_by_number.get(v)
        return ev.name if ev is not None else str(v)
    if t == FieldDescriptor.TYPE_STRING:
        return "s:" + _pct(v.encode("utf-8"))
    if t == FieldDescriptor.TYPE_BYTES:
        return "x:" + bytes(v).hex()
    if t == FieldDescriptor.TYPE_FLOAT:
        return "f:" + struct.pack(">f", v).hex()
    if t == FieldDescriptor.TYPE_DOUBLE:
        return "d:" + struct.pack(">d", v).hex()
    return str(int(v))


def _is_map(fd: FieldDescriptor) -> bool:
    return (fd.type == FieldDescriptor.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry)


def flatten(msg: Message, prefix: str = "") -> list[tuple[str, str]]:
    """Every set field as (path, value), field-number order."""
    out: list[tuple[str, str]] = []
    for fd, value in msg.ListFields():
        path = prefix + fd.name
        if _is_map(fd):
            kfd, vfd = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
            for key in sorted(value, key=lambda k: _scalar(kfd, k)):
                kpath = f"{path}{{{_scalar(kfd, key)}}}"
                if vfd.type == FieldDescriptor.TYPE_MESSAGE:
                    out.extend(flatten(value[key], kpath + "."))
                else:
                    out.append((kpath, _scalar(vfd, value[key])))
        elif fd.is_repeated:
            for i, item in enumerate(value):
                if fd.type == FieldDescriptor.TYPE_MESSAGE:
                    out.extend(flatten(item, f"{path}[{i}]."))
                    if not item.ListFields():
                        out.append((f"{path}[{i}]", "{}"))
                else:
                    out.append((f"{path}[{i}]", _scalar(fd, item)))
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            sub = flatten(value, path + ".")
            out.extend(sub if sub else [(path, "{}")])
        else:
            out.append((path, _scalar(fd, value)))
    return out


# ---- derived schemas ------------------------------------------------------------------------

def _file_proto() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(fdp)
    return fdp


def _msg(fdp: descriptor_pb2.FileDescriptorProto, name: str) -> descriptor_pb2.DescriptorProto:
    return next(m for m in fdp.message_type if m.name == name)


def _classes(fdp: descriptor_pb2.FileDescriptorProto, suffix: str) -> Callable[[str], type]:
    fdp.name = fdp.name.replace(".proto", f"_{suffix}.proto")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return lambda name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PKG}.{name}"))


def older_schema() -> Callable[[str], type]:
    """An early v1 writer: FrameHeader without effective_start, cache_expectation,
    compression, payload_checksum; StepFrame without sampling and sample."""
    fdp = _file_proto()
    for name, drop in (("FrameHeader", {7, 11, 12, 13}), ("StepFrame", {4, 5})):
        m = _msg(fdp, name)
        keep = [f for f in m.field if f.number not in drop]
        del m.field[:]
        m.field.extend(keep)
    return _classes(fdp, "older")


def newer_schema() -> Callable[[str], type]:
    """A later compatible writer: FrameHeader.trace_parent (14), NamedTensor.layout (9),
    SessionRequest.priority (15), a new frame kind SessionRequest.speculative (3, message
    SpeculativeFrame) and a new Phase value PHASE_SNAPSHOT = 5."""
    fdp = _file_proto()
    F = descriptor_pb2.FieldDescriptorProto
    _msg(fdp, "FrameHeader").field.add(name="trace_parent", number=14, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    _msg(fdp, "NamedTensor").field.add(name="layout", number=9, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    spec = fdp.message_type.add(name="SpeculativeFrame")
    spec.field.add(name="session_id", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    spec.field.add(name="draft_token_ids", number=2, type=F.TYPE_INT32, label=F.LABEL_REPEATED)
    req = _msg(fdp, "SessionRequest")
    req.field.add(name="speculative", number=3, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL,
                  type_name=f".{PKG}.SpeculativeFrame", oneof_index=0)
    req.field.add(name="priority", number=15, type=F.TYPE_UINT32, label=F.LABEL_OPTIONAL)
    phase = next(e for e in fdp.enum_type if e.name == "Phase")
    phase.value.add(name="PHASE_SNAPSHOT", number=5)
    return _classes(fdp, "newer")


# ---- the cases ------------------------------------------------------------------------------

def _residual(n_tokens: int, n_embd: int, offset: float = 0.0) -> np.ndarray:
    # Exactly representable values: multiples of 1/8 around zero.
    return ((np.arange(n_tokens * n_embd, dtype=np.float32) - 13.0) / 8.0 + offset).reshape(n_tokens, n_embd)


_header = R.header


def _capability() -> Message:
    return R.capability()


def _open_prefill_tokens() -> Message:
    span = pb.TokenSpan(token_ids=[1, 9906, 11, 1917, 0, 49151])
    return pb.SessionRequest(step=pb.StepFrame(
        header=_header(shard_range=pb.ShardRange(start=0, end=15), phase=pb.PHASE_PREFILL,
                       positions=pb.PositionRange(start=0, end=6), step=0,
                       cache_expectation=pb.CacheExpectation(kind=pb.CACHE_EXPECTATION_KIND_EMPTY),
                       compression=pb.COMPRESSION_NONE, payload_checksum=B.frame_payload_checksum(span)),
        tokens=span,
        sampling=pb.SamplingParams(mode=pb.SAMPLING_MODE_STOCHASTIC, temperature=0.7, top_k=40, top_p=0.9,
                                   min_p=0.05, seed=1234567890123, top_logprobs=3, stop_token_ids=[2, 49152 - 2]),
        sample=True))


def _prefill_bundle() -> Message:
    bundle = B.boundary_bundle(_residual(4, 8), fragment_bytes=40)
    return pb.SessionRequest(step=pb.StepFrame(
        header=_header(shard_range=pb.ShardRange(start=15, end=30), effective_start=15, phase=pb.PHASE_PREFILL,
                       positions=pb.PositionRange(start=6, end=10), step=1,
                       cache_expectation=pb.CacheExpectation(kind=pb.CACHE_EXPECTATION_KIND_POSITION, position=6),
                       compression=pb.COMPRESSION_NONE, payload_checksum=B.frame_payload_checksum(bundle)),
        bundle=bundle, sample=True))


def _fast_token() -> Message:
    return pb.SessionRequest(fast_decode=pb.FastDecodeFrame(session_id="sess-a1", route_epoch=3, step=7,
                                                           position=12, token_id=1917, request_id="req-0009"))


def _fast_bundle() -> Message:
    return pb.SessionRequest(fast_decode=pb.FastDecodeFrame(session_id="sess-a1", route_epoch=3, step=7,
                                                           position=12, bundle=B.boundary_bundle(_residual(1, 8, 0.5))))


def _truncate() -> Message:
    return pb.SessionRequest(step=pb.StepFrame(header=_header(
        shard_range=pb.ShardRange(start=0, end=15), phase=pb.PHASE_TRUNCATE,
        positions=pb.PositionRange(start=4), step=8, payload_checksum=B.frame_payload_checksum(None))))


def _release() -> Message:
    return pb.SessionRequest(step=pb.StepFrame(header=_header(
        shard_range=pb.ShardRange(start=0, end=15), phase=pb.PHASE_RELEASE, step=9)))


def _resp_header(**kw) -> pb.ResponseHeader:
    base = dict(schema_version=pb.SCHEMA_VERSION_V1, request_id="req-0001", session_id="sess-a1", route_epoch=3)
    base.update(kw)
    return pb.ResponseHeader(**base)


def _response_boundary() -> Message:
    bundle = B.boundary_bundle(_residual(2, 8, -1.0), fragment_bytes=32)
    return pb.SessionResponse(
        header=_resp_header(step=1, phase=pb.PHASE_PREFILL, positions=pb.PositionRange(start=6, end=8),
                            cache_result=pb.CACHE_RESULT_HIT, compression=pb.COMPRESSION_NONE,
                            payload_checksum=B.frame_payload_checksum(bundle), cached_positions=8,
                            computed_range=pb.ShardRange(start=0, end=15)),
        boundary=bundle)


def _response_tail() -> Message:
    tok = pb.SampledToken(token_id=2, position=10, logprob=-0.125, finish_reason=pb.FINISH_REASON_EOG,
                          top_logprobs=[pb.TokenLogprob(token_id=2, logprob=-0.125),
                                        pb.TokenLogprob(token_id=13, logprob=-2.5)])
    return pb.SessionResponse(
        header=_resp_header(step=1, phase=pb.PHASE_PREFILL, positions=pb.PositionRange(start=6, end=10),
                            cache_result=pb.CACHE_RESULT_HIT, replayed=True, cached_positions=10,
                            payload_checksum=B.checksum(B.token_payload([2])),
                            computed_range=pb.ShardRange(start=15, end=30)),
        tail=pb.TailOutput(tokens=[tok]))


def _response_error() -> Message:
    err = B.ShardProtocolError(pb.ERROR_REASON_STALE_EPOCH, "epoch 2 is older than 3; restart from token zero")
    msg = err.to_message()
    msg.current_epoch = 3
    return pb.SessionResponse(header=_resp_header(route_epoch=2, step=4, phase=pb.PHASE_DECODE,
                                                  cache_result=pb.CACHE_RESULT_STALE), error=msg)


def _metrics() -> Message:
    return pb.GetMetricsResponse(
        load=pb.LoadSnapshot(active_sessions=2, kv_cells_used=300, kv_cells_total=16384, queued_steps=1),
        samples=[pb.MetricSample(name="dgr_decode_tokens_total", labels={"phase": "decode"}, value=1234.0),
                 pb.MetricSample(name="dgr_kv_cells_used", value=300.0)])


def _older_step() -> Message:
    cls = older_schema()
    span = cls("TokenSpan")(token_ids=[5, 6, 7])
    return cls("SessionRequest")(step=cls("StepFrame")(
        header=_header(cls("FrameHeader"), shard_range=cls("ShardRange")(start=0, end=15),
                       phase=pb.PHASE_PREFILL, positions=cls("PositionRange")(start=0, end=3), step=0),
        tokens=span))


def _pre_v1() -> Message:
    msg = _open_prefill_tokens()
    msg.step.header.ClearField("schema_version")
    return msg


def _open_pipelined_bundle() -> Message:
    # the opening frame a pipelining Shard forwards downstream (StepFrame.pipelined)
    bundle = B.boundary_bundle(_residual(2, 8, 0.5))
    return pb.SessionRequest(step=pb.StepFrame(
        header=_header(shard_range=pb.ShardRange(start=15, end=30), effective_start=15, phase=pb.PHASE_PREFILL,
                       positions=pb.PositionRange(start=0, end=2), step=0,
                       cache_expectation=pb.CacheExpectation(kind=pb.CACHE_EXPECTATION_KIND_EMPTY),
                       compression=pb.COMPRESSION_NONE, payload_checksum=B.frame_payload_checksum(bundle)),
        bundle=bundle, sample=True, pipelined=True))


def _fast_bundle_batch_hint() -> Message:
    # a DECODE row a pipelining Shard forwards: one of 4 rows of its batch 12 (UpstreamBatch)
    msg = _fast_bundle()
    msg.fast_decode.batch.CopyFrom(pb.UpstreamBatch(id=12, rows=4))
    return msg


def _newer_fields() -> Message:
    cls = newer_schema()
    bundle = cls("TensorBundle")()
    bundle.MergeFromString(B.boundary_bundle(_residual(1, 8)).SerializeToString())
    bundle.tensors[0].layout = "row-major"
    header = cls("FrameHeader")()
    header.MergeFromString(_header(shard_range=pb.ShardRange(start=15, end=30), phase=pb.PHASE_DECODE,
                                   positions=pb.PositionRange(start=12, end=13), step=7,
                                   payload_checksum=B.frame_payload_checksum(
                                       B.boundary_bundle(_residual(1, 8)))).SerializeToString())
    header.trace_parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    return cls("SessionRequest")(step=cls("StepFrame")(header=header, bundle=bundle), priority=5)


def _newer_frame_kind() -> Message:
    cls = newer_schema()
    return cls("SessionRequest")(speculative=cls("SpeculativeFrame")(session_id="sess-a1", draft_token_ids=[3, 4]))


def _newer_enum() -> Message:
    cls = newer_schema()
    header = cls("FrameHeader")()
    header.MergeFromString(_header(shard_range=pb.ShardRange(start=0, end=15), step=9).SerializeToString())
    header.phase = 5  # PHASE_SNAPSHOT
    return cls("SessionRequest")(step=cls("StepFrame")(header=header))


@dataclass(frozen=True)
class Case:
    name: str
    type: str  # message name in dgr.shard.v1
    kind: str  # current | older_schema | newer_schema
    build: Callable[[], Message]
    handling: str = "decode"
    capability: str = ""  # handling checked against the Shard of this capability vector


CASES: tuple[Case, ...] = (
    Case("capability_response", "GetCapabilityResponse", "current", _capability),
    Case("session_open_prefill_tokens", "SessionRequest", "current", _open_prefill_tokens, "accept"),
    Case("session_prefill_bundle_fragmented", "SessionRequest", "current", _prefill_bundle, "accept"),
    Case("session_open_pipelined_bundle", "SessionRequest", "current", _open_pipelined_bundle, "accept"),
    Case("session_fast_decode_token", "SessionRequest", "current", _fast_token, "accept"),
    Case("session_fast_decode_bundle", "SessionRequest", "current", _fast_bundle, "accept"),
    Case("session_fast_decode_batch_hint", "SessionRequest", "current", _fast_bundle_batch_hint, "accept"),
    Case("session_truncate", "SessionRequest", "current", _truncate, "accept"),
    Case("session_release", "SessionRequest", "current", _release, "accept"),
    Case("response_boundary", "SessionResponse", "current", _response_boundary),
    Case("response_tail_sample", "SessionResponse", "current", _response_tail),
    Case("response_error_stale_epoch", "SessionResponse", "current", _response_error),
    Case("metrics_response", "GetMetricsResponse", "current", _metrics),
    Case("tokenize_request", "TokenizeRequest", "current",
         lambda: pb.TokenizeRequest(text="Héllo, wörld! <|im_start|>", add_special=True, parse_special=True)),
    Case("detokenize_response", "DetokenizeResponse", "current",
         lambda: pb.DetokenizeResponse(text=b"caf\xc3", pieces=[b"ca", b"f\xc3"])),
    Case("apply_chat_template_request", "ApplyChatTemplateRequest", "current",
         lambda: pb.ApplyChatTemplateRequest(messages=[pb.ChatMessage(role="system", content="Be brief."),
                                                       pb.ChatMessage(role="user", content="Héllo?")],
                                             add_assistant=True)),
    Case("apply_chat_template_response", "ApplyChatTemplateResponse", "current",
         lambda: pb.ApplyChatTemplateResponse(text="<|im_start|>user\nHéllo?<|im_end|>\n<|im_start|>assistant\n",
                                              template_source="chatml")),
    Case("release_session_request", "ReleaseSessionRequest", "current",
         lambda: pb.ReleaseSessionRequest(session_id="sess-a1", request_id="req-0010")),
    Case("cancel_session_request", "CancelSessionRequest", "current",
         lambda: pb.CancelSessionRequest(session_id="sess-a1", route_epoch=3)),
    Case("older_schema_step_frame", "SessionRequest", "older_schema", _older_step, "accept"),
    Case("pre_v1_schema_version_unset", "SessionRequest", "current", _pre_v1,
         "reject:ERROR_REASON_SCHEMA_UNSUPPORTED"),
    Case("newer_schema_unknown_fields", "SessionRequest", "newer_schema", _newer_fields, "accept"),
    Case("newer_schema_unknown_frame_kind", "SessionRequest", "newer_schema", _newer_frame_kind,
         "reject:ERROR_REASON_BAD_REQUEST"),
    Case("newer_schema_unknown_phase", "SessionRequest", "newer_schema", _newer_enum,
         "reject:ERROR_REASON_BAD_REQUEST"),
    Case(R.HEAD_CAP, "GetCapabilityResponse", "current", lambda: R.capability(head=True)),
    Case(R.SMALL_CAP, "GetCapabilityResponse", "current", R.small_tail_capability),
    *(Case(name, "SessionRequest", "current", build, handling, cap) for name, build, handling, cap in R.RULES),
)


def message_class(type_name: str) -> type:
    return getattr(pb, type_name)


def render() -> dict[str, bytes]:
    """Every vector file in memory: ``{file name: bytes}``."""
    files: dict[str, bytes] = {}
    lines = ["# dgr shard protocol golden vectors; written by `dgr proto vectors --write`; do not edit.",
             "# Format: see cli/dgr/protocol/vectors.py."]
    for case in CASES:
        data = case.build().SerializeToString(deterministic=True)
        decoded = message_class(case.type).FromString(data)
        identical = decoded.SerializeToString(deterministic=True) == data
        if not identical:
            raise DgrError(f"vector {case.name}: re-encoding is not byte-identical; fix the generator")
        files[f"{case.name}.bin"] = data
        lines += [f"vector {case.name}", f"type {PKG}.{case.type}", f"file {case.name}.bin", f"kind {case.kind}",
                  f"sha256 {hashlib.sha256(data).hexdigest()}", f"handling {case.handling}", "reencode identical"]
        if case.capability:
            lines.append(f"capability {case.capability}")
        lines += [f"field {p} {v}" for p, v in flatten(decoded)]
        lines.append("end")
    for name, value in pb.ErrorReason.items():
        lines.append(f"reason {name} {B.grpc_code_for(value)}")
    files[INDEX] = ("\n".join(lines) + "\n").encode()
    return files


def write(root: Path | None = None) -> list[Path]:
    out = vectors_dir(root)
    out.mkdir(parents=True, exist_ok=True)
    files = render()
    for stale in out.glob("*.bin"):
        if stale.name not in files:
            stale.unlink()
    written = []
    for name, data in sorted(files.items()):
        (out / name).write_bytes(data)
        written.append(out / name)
    return written


def check(root: Path | None = None) -> list[str]:
    """Problems between the committed vectors and the generator; empty = up to date."""
    out = vectors_dir(root)
    files = render()
    problems = []
    for name, data in sorted(files.items()):
        path = out / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.read_bytes() != data:
            problems.append(f"{path}: differs")
    for extra in sorted(out.glob("*.bin")) if out.is_dir() else []:
        if extra.name not in files:
            problems.append(f"{extra}: stale")
    return problems
