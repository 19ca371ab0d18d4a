"""One refusing golden vector per bound the .proto states for a request frame.

Read with ``proto/dgr/shard/v1/shard_runtime.proto`` line by line: every stated bound of a
``SessionRequest`` (FrameHeader, FastDecodeFrame, StepFrame, SamplingParams, TokenSpan,
NamedTensor/TensorFragment/Checksum) has a rule here, a frame that breaks exactly that rule, and
the reason both validators must give (``dgr.protocol.frame_checks.check_frame`` and C++
``bundle::check_frame``, run over the vectors by tests/test_proto.py and the CTest
proto_vectors_test). Rules that need the Shard (fingerprint, range, role, vocabulary, chunk
and size limits) name the capability vector they are checked against. Boundary-value frames
that must still be accepted sit next to the rule they bound.

:mod:`dgr.protocol.vectors` writes these with its own cases; this module only builds messages.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import bundle as B
from ..shard.v1 import shard_runtime_pb2 as pb

FINGERPRINT = "9f2c1e7a5b3d4c6e8f0a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6"
ARTIFACT = "4a1b9c0d2e3f405162738495a6b7c8d9e0f1a2b3c4d5e6f708192a3b4c5d6e7f"
#: The tail Shard of the capability vectors ("capability_response").
TAIL_CAP = "capability_response"
#: The head Shard [0, 15) of the same model ("capability_head").
HEAD_CAP = "capability_head"
#: The tail Shard with small limits: 4096-byte tensors, 32-byte fragments ("capability_small_tail").
SMALL_CAP = "capability_small_tail"


def header(cls=pb.FrameHeader, **kw):
    base = dict(schema_version=pb.SCHEMA_VERSION_V1, request_id="req-0001", session_id="sess-a1",
                route_epoch=3, compatibility_fingerprint=FINGERPRINT)
    base.update(kw)
    return cls(**base)


def capability(*, head: bool = False) -> pb.GetCapabilityResponse:
    start, end = (0, 15) if head else (15, 30)
    return pb.GetCapabilityResponse(
        schema_version=pb.SCHEMA_VERSION_V1, min_schema_version=pb.SCHEMA_VERSION_V1,
        identity=pb.ShardIdentity(artifact_id=ARTIFACT, recipe_json='{"arch":"llama","act":"f32"}',
                                  compatibility_fingerprint=FINGERPRINT, range=pb.ShardRange(start=start, end=end),
                                  n_layer=30, head=head, tail=not head, n_embd=576, n_vocab=49152,
                                  architecture="llama"),
        capacity=pb.Capacity(max_sessions=8, kv_cells=16384, max_session_positions=2048, max_batch_tokens=512,
                             max_prefill_chunk_tokens=256, max_message_bytes=64 << 20,
                             max_fragment_bytes=1 << 20, compressions=[pb.COMPRESSION_NONE]),
        runtime=pb.RuntimeInfo(dgr_version="0.1.0", llama_commit="0c1e57098bba43ac29e6e3b677cdceebdd22334f",
                               patch_digest="sha256:00ff", backend="cpu"))


# ---- valid base frames; each rule breaks one thing ------------------------------------------

def tokens(ids=(1, 9906, 11), **kw) -> pb.SessionRequest:
    """A valid opening PREFILL of token ids for the head Shard [0, 15)."""
    span = pb.TokenSpan(token_ids=list(ids))
    h = dict(shard_range=pb.ShardRange(start=0, end=15), phase=pb.PHASE_PREFILL,
             positions=pb.PositionRange(start=0, end=len(ids)), step=0,
             cache_expectation=pb.CacheExpectation(kind=pb.CACHE_EXPECTATION_KIND_EMPTY),
             compression=pb.COMPRESSION_NONE, payload_checksum=B.frame_payload_checksum(span))
    h.update(kw)
    return pb.SessionRequest(step=pb.StepFrame(header=header(**h), tokens=span, sample=True))


def rows(n: int = 2, width: int = 8, *, fragment_bytes: int = 32) -> pb.SessionRequest:
    """A valid PREFILL of a boundary bundle for the tail Shard [15, 30) (frame checksum unset, so
    that a bundle rule is what refuses the broken variants)."""
    res = ((np.arange(n * width, dtype=np.float32) - 13.0) / 8.0).reshape(n, width)
    bundle = B.boundary_bundle(res, fragment_bytes=fragment_bytes)
    return pb.SessionRequest(step=pb.StepFrame(
        header=header(shard_range=pb.ShardRange(start=15, end=30), phase=pb.PHASE_PREFILL,
                      positions=pb.PositionRange(start=6, end=6 + n), step=1,
                      cache_expectation=pb.CacheExpectation(kind=pb.CACHE_EXPECTATION_KIND_POSITION, position=6),
                      compression=pb.COMPRESSION_NONE),
        bundle=bundle, sample=True))


def fast(**kw) -> pb.SessionRequest:
    base = dict(session_id="sess-a1", route_epoch=3, step=7, position=12, token_id=1917, request_id="req-0009")
    base.update(kw)
    return pb.SessionRequest(fast_decode=pb.FastDecodeFrame(**base))


def _with(build: Callable[[], pb.SessionRequest], edit: Callable[[pb.SessionRequest], object]):
    def make() -> pb.SessionRequest:
        msg = build()
        edit(msg)
        return msg
    return make


def _hdr(**kw) -> Callable[[pb.SessionRequest], None]:
    def edit(m: pb.SessionRequest) -> None:
        for k, v in kw.items():
            if isinstance(v, pb.PositionRange | pb.ShardRange | pb.CacheExpectation | pb.Checksum):
                getattr(m.step.header, k).CopyFrom(v)
            else:
                setattr(m.step.header, k, v)
    return edit


def _sampling(**kw) -> Callable[[pb.SessionRequest], None]:
    def edit(m: pb.SessionRequest) -> None:
        m.step.sampling.CopyFrom(pb.SamplingParams(**kw))
    return edit


def _tensor(fn: Callable[[pb.NamedTensor], object]) -> Callable[[pb.SessionRequest], None]:
    def edit(m: pb.SessionRequest) -> None:
        fn(m.step.bundle.tensors[0])
    return edit


def _set(**kw) -> Callable[[pb.NamedTensor], None]:
    def fn(t: pb.NamedTensor) -> None:
        for k, v in kw.items():
            if k == "shape":
                del t.shape[:]
                t.shape.extend(v)
            else:
                setattr(t, k, v)
    return fn


def _dup_tensor(m: pb.SessionRequest) -> None:
    m.step.bundle.tensors.add().CopyFrom(m.step.bundle.tensors[0])


def _dup_fragment(t: pb.NamedTensor) -> None:
    t.fragments[1].index = 0


def _drop_fragment(t: pb.NamedTensor) -> None:
    del t.fragments[1]


def _empty_fragment(t: pb.NamedTensor) -> None:
    t.fragments[0].data = b""


def _bad_payload_crc(m: pb.SessionRequest) -> None:
    m.step.header.payload_checksum.value ^= 1


def _unknown_crc_algo(m: pb.SessionRequest) -> None:
    m.step.header.payload_checksum.algorithm = 5


def _bundle_to_head(m: pb.SessionRequest) -> None:
    m.step.header.shard_range.CopyFrom(pb.ShardRange(start=0, end=15))
    m.step.header.effective_start = 0


# (name, build, handling, capability vector or "")
RULES: tuple[tuple[str, Callable[[], pb.SessionRequest], str, str], ...] = (
    # FrameHeader.schema_version: in [min_schema_version, schema_version]; unset rejected
    ("rule_schema_version_newer", _with(tokens, _hdr(schema_version=2)), "reject:ERROR_REASON_SCHEMA_UNSUPPORTED", ""),
    # FrameHeader.session_id: 1..128 bytes
    ("rule_session_id_empty", _with(tokens, _hdr(session_id="")), "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_session_id_129_bytes", _with(tokens, _hdr(session_id="s" * 129)), "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_session_id_128_bytes_ok", _with(tokens, _hdr(session_id="s" * 128)), "accept", ""),
    # FrameHeader.request_id: at most 128 bytes
    ("rule_request_id_129_bytes", _with(tokens, _hdr(request_id="r" * 129)), "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_request_id_128_bytes_ok", _with(tokens, _hdr(request_id="r" * 128)), "accept", ""),
    # FrameHeader.route_epoch: starts at 1
    ("rule_route_epoch_zero", _with(tokens, _hdr(route_epoch=0)), "reject:ERROR_REASON_BAD_REQUEST", ""),
    # FrameHeader.compatibility_fingerprint: equals the Shard's
    ("rule_fingerprint_mismatch", _with(rows, _hdr(compatibility_fingerprint="0" * 64)),
     "reject:ERROR_REASON_FINGERPRINT_MISMATCH", TAIL_CAP),
    # FrameHeader.shard_range: equals the Shard's
    ("rule_shard_range_mismatch", _with(rows, _hdr(shard_range=pb.ShardRange(start=15, end=29))),
     "reject:ERROR_REASON_RANGE_MISMATCH", TAIL_CAP),
    # FrameHeader.effective_start: in [shard_range.start, shard_range.end)
    ("rule_effective_start_at_range_end", _with(rows, _hdr(effective_start=30)),
     "reject:ERROR_REASON_RANGE_MISMATCH", TAIL_CAP),
    # FrameHeader.phase: a known phase, not unset
    ("rule_phase_unspecified", _with(tokens, _hdr(phase=pb.PHASE_UNSPECIFIED)), "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_phase_unknown_value", _with(tokens, _hdr(phase=9)), "reject:ERROR_REASON_BAD_REQUEST", ""),
    # FrameHeader.compression: NONE (or unset) in v1; F16/Q8_0/unknown -> UNSUPPORTED_COMPRESSION
    ("rule_compression_f16", _with(tokens, _hdr(compression=pb.COMPRESSION_F16)),
     "reject:ERROR_REASON_UNSUPPORTED_COMPRESSION", ""),
    ("rule_compression_unknown_value", _with(tokens, _hdr(compression=7)),
     "reject:ERROR_REASON_UNSUPPORTED_COMPRESSION", ""),
    # FrameHeader.cache_expectation.kind: a known CacheExpectationKind
    ("rule_cache_expectation_kind_unknown",
     _with(tokens, _hdr(cache_expectation=pb.CacheExpectation(kind=7))), "reject:ERROR_REASON_BAD_REQUEST", ""),
    # FrameHeader.positions: PREFILL/DECODE non-empty; DECODE exactly one row; rows <= chunk limit
    ("rule_positions_empty", _with(tokens, _hdr(positions=pb.PositionRange(start=3, end=3))),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_decode_two_rows", _with(lambda: tokens((5, 6)), _hdr(phase=pb.PHASE_DECODE)),
     "reject:ERROR_REASON_CHUNK_TOO_LARGE", ""),
    ("rule_prefill_above_chunk_limit", _with(rows, _hdr(positions=pb.PositionRange(start=6, end=6 + 257))),
     "reject:ERROR_REASON_CHUNK_TOO_LARGE", TAIL_CAP),
    # TokenSpan: one id per position; ids in [0, n_vocab)
    ("rule_token_count_differs", _with(tokens, _hdr(positions=pb.PositionRange(start=0, end=4))),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_token_out_of_vocab", lambda: tokens((1, 49152, 3)), "reject:ERROR_REASON_TOKEN_OUT_OF_VOCAB", HEAD_CAP),
    ("rule_token_negative", lambda: tokens((1, -1, 3)), "reject:ERROR_REASON_TOKEN_OUT_OF_VOCAB", HEAD_CAP),
    # StepFrame.input: the Shard's kind (ROLE_MISMATCH); PREFILL/DECODE carry one; TRUNCATE/RELEASE none
    ("rule_tokens_to_non_head", _with(tokens, _hdr(shard_range=pb.ShardRange(start=15, end=30))),
     "reject:ERROR_REASON_ROLE_MISMATCH", TAIL_CAP),
    ("rule_bundle_to_head", _with(rows, _bundle_to_head), "reject:ERROR_REASON_ROLE_MISMATCH", HEAD_CAP),
    ("rule_prefill_without_input", _with(tokens, lambda m: m.step.ClearField("tokens")),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_truncate_with_input", _with(tokens, _hdr(phase=pb.PHASE_TRUNCATE)), "reject:ERROR_REASON_BAD_REQUEST", ""),
    # FrameHeader.payload_checksum: CRC32 or unset; a set checksum matches (BAD_BUNDLE)
    ("rule_payload_checksum_mismatch", _with(tokens, _bad_payload_crc), "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_payload_checksum_unknown_algorithm", _with(tokens, _unknown_crc_algo), "reject:ERROR_REASON_BAD_REQUEST", ""),
    # SamplingParams (BAD_REQUEST)
    ("rule_sampling_mode_unknown", _with(tokens, _sampling(mode=5)), "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_temperature_zero", _with(tokens, _sampling(mode=pb.SAMPLING_MODE_STOCHASTIC, temperature=0.0)),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_temperature_nan",
     _with(tokens, _sampling(mode=pb.SAMPLING_MODE_STOCHASTIC, temperature=float("nan"))),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_top_p_above_one", _with(tokens, _sampling(top_p=1.5)), "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_top_p_negative", _with(tokens, _sampling(top_p=-0.25)), "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_min_p_one", _with(tokens, _sampling(min_p=1.0)), "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_top_logprobs_65", _with(tokens, _sampling(top_logprobs=65)), "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_top_logprobs_64_ok", _with(tokens, _sampling(top_logprobs=64)), "accept", ""),
    ("rule_sampling_stop_token_negative", _with(tokens, _sampling(stop_token_ids=[2, -1])),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_stop_token_out_of_vocab", _with(tokens, _sampling(stop_token_ids=[2, 49152])),
     "reject:ERROR_REASON_BAD_REQUEST", HEAD_CAP),
    ("rule_sampling_65_stop_tokens", _with(tokens, _sampling(stop_token_ids=list(range(65)))),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_logit_bias_ok", _with(tokens, _sampling(logit_bias=[pb.TokenBias(token_id=7, bias=-100.0),
                                                                       pb.TokenBias(token_id=9, bias=100.0)])),
     "accept", HEAD_CAP),
    ("rule_sampling_logit_bias_out_of_vocab", _with(tokens, _sampling(logit_bias=[pb.TokenBias(token_id=49152,
                                                                                               bias=1.0)])),
     "reject:ERROR_REASON_BAD_REQUEST", HEAD_CAP),
    ("rule_sampling_logit_bias_negative_id", _with(tokens, _sampling(logit_bias=[pb.TokenBias(token_id=-1, bias=1.0)])),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_logit_bias_above_100", _with(tokens, _sampling(logit_bias=[pb.TokenBias(token_id=7, bias=100.5)])),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_logit_bias_nan", _with(tokens, _sampling(logit_bias=[pb.TokenBias(token_id=7, bias=float("nan"))])),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_logit_bias_twice", _with(tokens, _sampling(logit_bias=[pb.TokenBias(token_id=7, bias=1.0),
                                                                          pb.TokenBias(token_id=7, bias=2.0)])),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_penalties_ok", _with(tokens, _sampling(repeat_penalty=1.1, frequency_penalty=-2.0,
                                                          presence_penalty=2.0, penalty_last_n=4096,
                                                          penalty_prompt_tokens=[1, 2, 3])),
     "accept", HEAD_CAP),
    ("rule_sampling_repeat_penalty_negative", _with(tokens, _sampling(repeat_penalty=-1.0)),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_repeat_penalty_above_10", _with(tokens, _sampling(repeat_penalty=10.5)),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_frequency_penalty_above_2", _with(tokens, _sampling(frequency_penalty=2.5)),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_presence_penalty_nan", _with(tokens, _sampling(presence_penalty=float("nan"))),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_penalty_last_n_4097", _with(tokens, _sampling(penalty_last_n=4097)),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_penalty_prompt_longer_than_window", _with(tokens, _sampling(penalty_last_n=2,
                                                                               penalty_prompt_tokens=[1, 2, 3])),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_penalty_prompt_out_of_vocab", _with(tokens, _sampling(penalty_last_n=8,
                                                                         penalty_prompt_tokens=[1, 49152])),
     "reject:ERROR_REASON_BAD_REQUEST", HEAD_CAP),
    ("rule_sampling_grammar_ok", _with(tokens, _sampling(grammar='root ::= "a"')), "accept", ""),
    ("rule_sampling_grammar_and_schema", _with(tokens, _sampling(grammar='root ::= "a"', json_schema="{}")),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_json_schema_65537_bytes", _with(tokens, _sampling(json_schema=" " * 65537)),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_sampling_grammar_with_ignore_eog", _with(tokens, _sampling(json_schema="{}", ignore_eog=True)),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    # FastDecodeFrame: session_id / route_epoch / request_id as FrameHeader; one input
    ("rule_fast_decode_session_id_empty", lambda: fast(session_id=""), "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_fast_decode_session_id_129_bytes", lambda: fast(session_id="s" * 129), "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_fast_decode_request_id_129_bytes", lambda: fast(request_id="r" * 129), "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_fast_decode_epoch_zero", lambda: fast(route_epoch=0), "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_fast_decode_without_input", _with(fast, lambda m: m.fast_decode.ClearField("token_id")),
     "reject:ERROR_REASON_BAD_REQUEST", ""),
    ("rule_fast_decode_token_out_of_vocab", lambda: fast(token_id=49152), "reject:ERROR_REASON_TOKEN_OUT_OF_VOCAB",
     HEAD_CAP),
    # NamedTensor / TensorFragment / Checksum (BAD_BUNDLE; sizes above the limits MESSAGE_TOO_LARGE)
    ("rule_bundle_no_tensor", _with(rows, lambda m: m.step.bundle.ClearField("tensors")),
     "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_tensor_name_empty", _with(rows, _tensor(_set(name=""))), "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_tensor_named_twice", _with(rows, _dup_tensor), "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_tensor_dtype_unspecified", _with(rows, _tensor(_set(dtype=pb.TENSOR_DTYPE_UNSPECIFIED))),
     "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_tensor_dtype_unknown", _with(rows, _tensor(_set(dtype=9))), "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_tensor_byte_order_unknown", _with(rows, _tensor(_set(byte_order=3))), "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_tensor_nine_dimensions", _with(rows, _tensor(_set(shape=[1] * 7 + [2, 8]))),
     "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_tensor_zero_dimension", _with(rows, _tensor(_set(shape=[0, 8]))), "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_tensor_shape_overflows", _with(rows, _tensor(_set(shape=[1 << 32, 1 << 32, 4]))),
     "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_tensor_byte_size_differs", _with(rows, _tensor(_set(byte_size=60))), "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_tensor_fragment_count_zero", _with(rows, _tensor(_set(fragment_count=0))),
     "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_tensor_fragment_count_above_bytes", _with(rows, _tensor(_set(fragment_count=65))),
     "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_fragment_index_out_of_range", _with(rows, _tensor(lambda t: setattr(t.fragments[1], "index", 2))),
     "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_fragment_twice", _with(rows, _tensor(_dup_fragment)), "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_fragment_empty", _with(rows, _tensor(_empty_fragment)), "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_fragment_missing", _with(rows, _tensor(_drop_fragment)), "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_tensor_checksum_mismatch", _with(rows, _tensor(lambda t: setattr(t.checksum, "value", t.checksum.value ^ 1))),
     "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_tensor_checksum_unknown_algorithm", _with(rows, _tensor(lambda t: setattr(t.checksum, "algorithm", 4))),
     "reject:ERROR_REASON_BAD_BUNDLE", ""),
    ("rule_tensor_above_max_message_bytes", _with(rows, _tensor(_set(shape=[1025, 1], byte_size=4100))),
     "reject:ERROR_REASON_MESSAGE_TOO_LARGE", SMALL_CAP),
    ("rule_fragment_above_max_fragment_bytes", lambda: rows(fragment_bytes=64),
     "reject:ERROR_REASON_MESSAGE_TOO_LARGE", SMALL_CAP),
)


def small_tail_capability() -> pb.GetCapabilityResponse:
    """The tail Shard with small limits (4096-byte tensors, 32-byte fragments)."""
    cap = capability()
    cap.capacity.max_message_bytes = 4096
    cap.capacity.max_fragment_bytes = 32
    return cap
