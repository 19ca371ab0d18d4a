"""Stateless checks of one ``SessionRequest`` frame: the same rules, stages and order as the C++
validator (``worker/src/common/frame_checks.cpp``: check_header, check_rows, check_input), and
:func:`check_frame`, which adds the bundle rules of :mod:`dgr.protocol.bundle` for one complete
step. Every bound the .proto states for a request frame is enforced here and there; the golden
vectors (:mod:`dgr.protocol.vectors`) hold one refusing frame per rule and run against both.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..shard.v1 import shard_runtime_pb2 as pb
from .bundle import ShardProtocolError, read_bundle, verify_frame_payload

#: Schema versions this code accepts: [min, max].
SCHEMA_VERSIONS = (pb.SCHEMA_VERSION_V1, pb.SCHEMA_VERSION_V1)
#: FrameHeader.session_id: 1..128 bytes; request_id (and FastDecodeFrame.request_id): at most 128.
MAX_SESSION_ID_BYTES = 128
MAX_REQUEST_ID_BYTES = 128
#: SamplingParams.top_logprobs at most; SamplingParams.stop_token_ids at most.
MAX_TOP_LOGPROBS = 64
MAX_STOP_TOKENS = 64
#: SamplingParams.logit_bias: entries at most, and the bound of each bias.
MAX_LOGIT_BIAS = 1024
MAX_BIAS = 100.0
#: SamplingParams penalties: the window's length at most, and each penalty's bound.
MAX_PENALTY_LAST_N = 4096
MAX_REPEAT_PENALTY = 10.0
MAX_FREQUENCY_PENALTY = 2.0      # frequency_penalty and presence_penalty in [-2, 2]
#: SamplingParams.grammar / json_schema: bytes at most (UTF-8).
MAX_GRAMMAR_BYTES = 65536
_ROW_PHASES = (pb.PHASE_PREFILL, pb.PHASE_DECODE)
_KNOWN_PHASES = (pb.PHASE_PREFILL, pb.PHASE_DECODE, pb.PHASE_TRUNCATE, pb.PHASE_RELEASE)
_KNOWN_EXPECTATIONS = (pb.CACHE_EXPECTATION_KIND_UNSPECIFIED, pb.CACHE_EXPECTATION_KIND_EMPTY,
                       pb.CACHE_EXPECTATION_KIND_POSITION)


def _req(reason: int, message: str) -> ShardProtocolError:
    return ShardProtocolError(reason, message)


def _phase_name(phase: int) -> str:
    return pb.Phase.Name(phase) if phase in pb.Phase.values() else "PHASE_?"


def check_sampling(s: pb.SamplingParams, n_vocab: int = 0) -> None:
    """The sampling contract's value ranges (BAD_REQUEST); stop token ids in [0, n_vocab) when
    ``n_vocab`` is known (> 0), else only >= 0."""
    bad = pb.ERROR_REASON_BAD_REQUEST
    if s.mode not in (pb.SAMPLING_MODE_UNSPECIFIED, pb.SAMPLING_MODE_GREEDY, pb.SAMPLING_MODE_STOCHASTIC):
        raise _req(bad, f"unknown sampling mode {s.mode}")
    if s.mode == pb.SAMPLING_MODE_STOCHASTIC and not s.temperature > 0:
        raise _req(bad, f"stochastic sampling needs temperature > 0, got {s.temperature}")
    if not 0 <= s.top_p <= 1:
        raise _req(bad, f"top_p {s.top_p} outside [0, 1]")
    if not 0 <= s.min_p < 1:
        raise _req(bad, f"min_p {s.min_p} outside [0, 1)")
    if s.top_logprobs > MAX_TOP_LOGPROBS:
        raise _req(bad, f"top_logprobs {s.top_logprobs} above {MAX_TOP_LOGPROBS}")
    if len(s.stop_token_ids) > MAX_STOP_TOKENS:
        raise _req(bad, f"{len(s.stop_token_ids)} stop_token_ids, at most {MAX_STOP_TOKENS}")
    for t in s.stop_token_ids:
        if t < 0 or (n_vocab and t >= n_vocab):
            raise _req(bad, f"stop token id {t} outside [0, {n_vocab or 'n_vocab'})")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise _req(bad, f"{len(s.logit_bias)} logit_bias entries, at most {MAX_LOGIT_BIAS}")
    seen: set[int] = set()
    for b in s.logit_bias:
        if b.token_id < 0 or (n_vocab and b.token_id >= n_vocab):
            raise _req(bad, f"logit_bias token id {b.token_id} outside [0, {n_vocab or 'n_vocab'})")
        if not -MAX_BIAS <= b.bias <= MAX_BIAS:       # (NaN fails it)
            raise _req(bad, f"logit_bias of token {b.token_id} outside [-100, 100]")
        if b.token_id in seen:
            raise _req(bad, f"logit_bias names token {b.token_id} twice")
        seen.add(b.token_id)
    if not (s.repeat_penalty == 0 or 0 < s.repeat_penalty <= MAX_REPEAT_PENALTY):
        raise _req(bad, "repeat_penalty outside (0, 10]")
    if not abs(s.frequency_penalty) <= MAX_FREQUENCY_PENALTY:
        raise _req(bad, "frequency_penalty outside [-2, 2]")
    if not abs(s.presence_penalty) <= MAX_FREQUENCY_PENALTY:
        raise _req(bad, "presence_penalty outside [-2, 2]")
    if s.penalty_last_n > MAX_PENALTY_LAST_N:
        raise _req(bad, f"penalty_last_n {s.penalty_last_n} above {MAX_PENALTY_LAST_N}")
    if len(s.penalty_prompt_tokens) > s.penalty_last_n:
        raise _req(bad, f"{len(s.penalty_prompt_tokens)} penalty_prompt_tokens, more than penalty_last_n "
                        f"{s.penalty_last_n}")
    for t in s.penalty_prompt_tokens:
        if t < 0 or (n_vocab and t >= n_vocab):
            raise _req(bad, f"penalty prompt token id {t} outside [0, {n_vocab or 'n_vocab'})")
    if s.grammar and s.json_schema:
        raise _req(bad, "grammar and json_schema are exclusive: send one")
    g, j = len(s.grammar.encode("utf-8")), len(s.json_schema.encode("utf-8"))
    if max(g, j) > MAX_GRAMMAR_BYTES:
        raise _req(bad, f"{'json_schema' if not s.grammar else 'grammar'} of {max(g, j)} bytes, "
                        f"at most {MAX_GRAMMAR_BYTES}")
    if s.ignore_eog and (s.grammar or s.json_schema):
        raise _req(bad, "a grammar ends the answer where it is complete: not together with ignore_eog")


def check_header(req: pb.SessionRequest, capability: pb.GetCapabilityResponse | None = None) -> None:
    """Stage 1: frame kind, schema version, fingerprint, range, effective start, compression,
    phase, cache expectation kind, session id (1..128 bytes), request id (<= 128), epoch >= 1."""
    kind = req.WhichOneof("frame")
    bad = pb.ERROR_REASON_BAD_REQUEST
    ident = capability.identity if capability is not None else None
    if kind == "fast_decode":
        sid, rid, epoch = req.fast_decode.session_id, req.fast_decode.request_id, req.fast_decode.route_epoch
    elif kind == "step":
        h = req.step.header
        lo, hi = SCHEMA_VERSIONS
        if capability is not None:
            lo, hi = capability.min_schema_version, capability.schema_version
        if h.schema_version == pb.SCHEMA_VERSION_UNSPECIFIED or not lo <= h.schema_version <= hi:
            raise _req(pb.ERROR_REASON_SCHEMA_UNSUPPORTED, f"schema_version {h.schema_version} outside [{lo}, {hi}]")
        if ident is not None:
            if h.compatibility_fingerprint != ident.compatibility_fingerprint:
                raise _req(pb.ERROR_REASON_FINGERPRINT_MISMATCH,
                           f"fingerprint {h.compatibility_fingerprint!r} != served {ident.compatibility_fingerprint!r}")
            if (h.shard_range.start, h.shard_range.end) != (ident.range.start, ident.range.end):
                raise _req(pb.ERROR_REASON_RANGE_MISMATCH,
                           f"frame names [{h.shard_range.start}, {h.shard_range.end}), this Shard serves "
                           f"[{ident.range.start}, {ident.range.end})")
            if h.effective_start >= ident.range.end:
                raise _req(pb.ERROR_REASON_RANGE_MISMATCH, f"effective_start {h.effective_start} >= {ident.range.end}")
        if h.compression not in (pb.COMPRESSION_UNSPECIFIED, pb.COMPRESSION_NONE):
            raise _req(pb.ERROR_REASON_UNSUPPORTED_COMPRESSION, f"compression {h.compression} not supported")
        if h.phase not in _KNOWN_PHASES:
            raise _req(bad, f"unknown phase {h.phase}")
        if h.cache_expectation.kind not in _KNOWN_EXPECTATIONS:
            raise _req(bad, f"unknown cache expectation kind {h.cache_expectation.kind}")
        sid, rid, epoch = h.session_id, h.request_id, h.route_epoch
    else:
        raise _req(bad, "no frame kind this worker knows (sent by a newer schema?)")
    if not 1 <= len(sid.encode()) <= MAX_SESSION_ID_BYTES:
        raise _req(bad, f"session_id must be 1..{MAX_SESSION_ID_BYTES} bytes")
    if len(rid.encode()) > MAX_REQUEST_ID_BYTES:
        raise _req(bad, f"request_id above {MAX_REQUEST_ID_BYTES} bytes")
    if epoch == 0:
        raise _req(bad, "route_epoch starts at 1")


def check_rows(req: pb.SessionRequest, capability: pb.GetCapabilityResponse | None = None) -> None:
    """Stage 2: PREFILL/DECODE carry a non-empty position range, DECODE one row, at most the
    chunk limit; TRUNCATE/RELEASE carry no input (and a payload checksum of nothing)."""
    if req.WhichOneof("frame") != "step":
        return  # a FastDecodeFrame is one DECODE row by construction
    s, h = req.step, req.step.header
    if h.phase not in _ROW_PHASES:
        if s.WhichOneof("input") is not None:
            raise _req(pb.ERROR_REASON_BAD_REQUEST, f"{_phase_name(h.phase)} carries no input")
        verify_frame_payload(None, h.payload_checksum)
        return
    if h.positions.end <= h.positions.start:
        raise _req(pb.ERROR_REASON_BAD_REQUEST, f"empty positions [{h.positions.start}, {h.positions.end})")
    rows = h.positions.end - h.positions.start
    if h.phase == pb.PHASE_DECODE and rows != 1:
        raise ShardProtocolError(pb.ERROR_REASON_CHUNK_TOO_LARGE, f"DECODE carries {rows} rows, not 1", limit=1)
    if capability is not None and capability.capacity.max_prefill_chunk_tokens and \
            rows > capability.capacity.max_prefill_chunk_tokens:
        lim = capability.capacity.max_prefill_chunk_tokens
        raise ShardProtocolError(pb.ERROR_REASON_CHUNK_TOO_LARGE, f"{rows} rows above the chunk limit {lim}",
                                 limit=lim)


def check_input(req: pb.SessionRequest, capability: pb.GetCapabilityResponse | None = None, *,
                sampling_applies: bool = True) -> None:
    """Stage 3: sampling (when it applies), role, token count, vocabulary, payload checksum."""
    bad = pb.ERROR_REASON_BAD_REQUEST
    ident = capability.identity if capability is not None else None
    kind = req.WhichOneof("frame")
    if kind == "fast_decode":
        f = req.fast_decode
        which = f.WhichOneof("input")
        if ident is not None and which is not None:
            _check_role(which == "token_id", ident)
        if which is None:
            raise _req(bad, "fast_decode without input")
        if ident is not None and which == "token_id":
            _check_vocab([f.token_id], ident)
        return
    if kind != "step":
        return
    s, h = req.step, req.step.header
    if h.phase not in _ROW_PHASES:
        return
    if sampling_applies and s.HasField("sampling"):
        check_sampling(s.sampling, ident.n_vocab if ident is not None else 0)
    which = s.WhichOneof("input")
    if ident is not None and which is not None:
        _check_role(which == "tokens", ident)
    if which is None:
        raise _req(bad, f"{_phase_name(h.phase)} without input")
    rows = h.positions.end - h.positions.start
    if which == "tokens" and len(s.tokens.token_ids) != rows:
        raise _req(bad, f"{len(s.tokens.token_ids)} token ids for {rows} positions")
    if ident is not None and which == "tokens":
        _check_vocab(s.tokens.token_ids, ident)
    verify_frame_payload(getattr(s, which), h.payload_checksum)


def check_request(req: pb.SessionRequest, capability: pb.GetCapabilityResponse | None = None) -> None:
    """Stateless checks of one SessionRequest frame, in the order a worker applies them.

    Raises ShardProtocolError with the documented reason; returns None when the frame may go on
    to the session-state checks (epoch, step, cache expectation). With ``capability`` it also
    checks fingerprint, range, role, vocabulary and chunk limits against that Shard.
    """
    check_header(req, capability)
    check_rows(req, capability)
    check_input(req, capability)


def check_frame(req: pb.SessionRequest, capability: pb.GetCapabilityResponse | None = None) -> None:
    """:func:`check_request`, then (a frame carrying a bundle) the bundle's own rules as one
    complete step, limited by the capability's max_message_bytes / max_fragment_bytes: what a
    golden vector's handling certifies (C++ ``bundle::check_frame``)."""
    check_request(req, capability)
    kind = req.WhichOneof("frame")
    frame = getattr(req, kind) if kind else None
    if frame is None or frame.WhichOneof("input") != "bundle":
        return
    limits = {}
    if capability is not None:
        limits = {"max_tensor_bytes": capability.capacity.max_message_bytes or None,
                  "max_fragment_bytes": capability.capacity.max_fragment_bytes or None}
    compression = req.step.header.compression if kind == "step" else pb.COMPRESSION_UNSPECIFIED
    read_bundle(frame.bundle, compression=compression, **limits)


def _check_role(has_tokens: bool, ident: pb.ShardIdentity) -> None:
    if has_tokens != ident.head:
        what = "token ids" if has_tokens else "a boundary bundle"
        raise _req(pb.ERROR_REASON_ROLE_MISMATCH,
                   f"{what} sent to a {'head' if ident.head else 'non-head'} Shard")


def _check_vocab(token_ids: Iterable[int], ident: pb.ShardIdentity) -> None:
    for t in token_ids:
        if not 0 <= t < ident.n_vocab:
            raise _req(pb.ERROR_REASON_TOKEN_OUT_OF_VOCAB, f"token id {t} outside [0, {ident.n_vocab})")
