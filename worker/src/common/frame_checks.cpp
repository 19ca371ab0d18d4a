// Stateless checks of a SessionRequest frame (bundle.h: check_header, check_rows, check_input,
// check_request), the sampling contract's ranges, and the ErrorReason -> gRPC code map.
#include "common/bundle.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace dgr::bundle {

namespace {

// gRPC status code numbers (grpc/doc/statuscodes.md).
constexpr int kCancelled = 1, kUnknown = 2, kInvalidArgument = 3, kPermissionDenied = 7, kResourceExhausted = 8,
              kFailedPrecondition = 9, kAborted = 10, kInternal = 13, kUnavailable = 14;

ProtocolError err(pb::ErrorReason reason, std::string message, std::string tensor = {}, uint64_t limit = 0) {
    return protocol_error(reason, std::move(message), std::move(tensor), limit);
}

} // namespace

int grpc_code_for(pb::ErrorReason reason) {
    switch (reason) {
        case pb::ERROR_REASON_STALE_EPOCH:
        case pb::ERROR_REASON_CACHE_MISS:
        case pb::ERROR_REASON_UNKNOWN_SESSION:
        case pb::ERROR_REASON_POSITION_GAP:
        case pb::ERROR_REASON_STEP_OUT_OF_ORDER:
            return kAborted;
        case pb::ERROR_REASON_FINGERPRINT_MISMATCH:
        case pb::ERROR_REASON_ARTIFACT_MISMATCH:
        case pb::ERROR_REASON_RANGE_MISMATCH:
        case pb::ERROR_REASON_SESSION_RELEASED:
        case pb::ERROR_REASON_SCHEMA_UNSUPPORTED:
        case pb::ERROR_REASON_ROLE_MISMATCH:
            return kFailedPrecondition;
        case pb::ERROR_REASON_BAD_BUNDLE:
        case pb::ERROR_REASON_TOKEN_OUT_OF_VOCAB:
        case pb::ERROR_REASON_CHUNK_TOO_LARGE:
        case pb::ERROR_REASON_UNSUPPORTED_COMPRESSION:
        case pb::ERROR_REASON_BAD_REQUEST:
            return kInvalidArgument;
        case pb::ERROR_REASON_OVER_BUDGET:
        case pb::ERROR_REASON_MESSAGE_TOO_LARGE:
            return kResourceExhausted;
        case pb::ERROR_REASON_CANCELLED:
            return kCancelled;
        case pb::ERROR_REASON_INTERNAL:
            return kInternal;
        case pb::ERROR_REASON_UNAVAILABLE:
        case pb::ERROR_REASON_PEER_SILENT:
            return kUnavailable;
        case pb::ERROR_REASON_SESSION_NOT_OWNED:
            return kPermissionDenied;
        default:
            return kUnknown;
    }
}

Result check_sampling(const pb::SamplingParams & s, uint32_t n_vocab) {
    const auto bad_req = pb::ERROR_REASON_BAD_REQUEST;
    if (s.mode() != pb::SAMPLING_MODE_UNSPECIFIED && s.mode() != pb::SAMPLING_MODE_GREEDY &&
        s.mode() != pb::SAMPLING_MODE_STOCHASTIC) {
        return err(bad_req, "unknown sampling mode " + std::to_string(int(s.mode())));
    }
    if (s.mode() == pb::SAMPLING_MODE_STOCHASTIC && !(s.temperature() > 0)) {
        return err(bad_req, "stochastic sampling needs temperature > 0");
    }
    if (!(s.top_p() >= 0 && s.top_p() <= 1)) {
        return err(bad_req, "top_p outside [0, 1]");
    }
    if (!(s.min_p() >= 0 && s.min_p() < 1)) {
        return err(bad_req, "min_p outside [0, 1)");
    }
    if (s.top_logprobs() > kMaxTopLogprobs) {
        return err(bad_req, "top_logprobs " + std::to_string(s.top_logprobs()) + " above " +
                                std::to_string(kMaxTopLogprobs));
    }
    if (s.stop_token_ids_size() > kMaxStopTokens) {
        return err(bad_req, std::to_string(s.stop_token_ids_size()) + " stop_token_ids, at most " +
                                std::to_string(kMaxStopTokens));
    }
    for (int32_t t : s.stop_token_ids()) {
        if (t < 0 || (n_vocab && uint32_t(t) >= n_vocab)) {
            return err(bad_req, "stop token id " + std::to_string(t) + " outside [0, " +
                                    (n_vocab ? std::to_string(n_vocab) : std::string("n_vocab")) + ")");
        }
    }
    if (s.logit_bias_size() > kMaxLogitBias) {
        return err(bad_req, std::to_string(s.logit_bias_size()) + " logit_bias entries, at most " +
                                std::to_string(kMaxLogitBias));
    }
    std::vector<int32_t> seen;
    seen.reserve(s.logit_bias_size());
    for (const auto & b : s.logit_bias()) {
        const int32_t t = b.token_id();
        if (t < 0 || (n_vocab && uint32_t(t) >= n_vocab)) {
            return err(bad_req, "logit_bias token id " + std::to_string(t) + " outside [0, " +
                                    (n_vocab ? std::to_string(n_vocab) : std::string("n_vocab")) + ")");
        }
        if (!(b.bias() >= -kMaxBias && b.bias() <= kMaxBias)) {  // (NaN fails both)
            return err(bad_req, "logit_bias of token " + std::to_string(t) + " outside [-100, 100]");
        }
        seen.push_back(t);
    }
    std::sort(seen.begin(), seen.end());
    if (std::adjacent_find(seen.begin(), seen.end()) != seen.end()) {
        return err(bad_req, "logit_bias names token " + std::to_string(*std::adjacent_find(seen.begin(), seen.end())) +
                                " twice");
    }
    if (!(s.repeat_penalty() == 0 || (s.repeat_penalty() > 0 && s.repeat_penalty() <= kMaxRepeatPenalty))) {
        return err(bad_req, "repeat_penalty outside (0, 10]");
    }
    if (!(std::fabs(s.frequency_penalty()) <= kMaxFrequencyPenalty)) {
        return err(bad_req, "frequency_penalty outside [-2, 2]");
    }
    if (!(std::fabs(s.presence_penalty()) <= kMaxFrequencyPenalty)) {
        return err(bad_req, "presence_penalty outside [-2, 2]");
    }
    if (s.penalty_last_n() > kMaxPenaltyLastN) {
        return err(bad_req, "penalty_last_n " + std::to_string(s.penalty_last_n()) + " above " +
                                std::to_string(kMaxPenaltyLastN));
    }
    if (uint32_t(s.penalty_prompt_tokens_size()) > s.penalty_last_n()) {
        return err(bad_req, std::to_string(s.penalty_prompt_tokens_size()) +
                                " penalty_prompt_tokens, more than penalty_last_n " +
                                std::to_string(s.penalty_last_n()));
    }
    for (int32_t t : s.penalty_prompt_tokens()) {
        if (t < 0 || (n_vocab && uint32_t(t) >= n_vocab)) {
            return err(bad_req, "penalty prompt token id " + std::to_string(t) + " outside [0, " +
                                    (n_vocab ? std::to_string(n_vocab) : std::string("n_vocab")) + ")");
        }
    }
    if (!s.grammar().empty() && !s.json_schema().empty()) {
        return err(bad_req, "grammar and json_schema are exclusive: send one");
    }
    if (s.grammar().size() > kMaxGrammarBytes || s.json_schema().size() > kMaxGrammarBytes) {
        return err(bad_req, std::string(s.grammar().empty() ? "json_schema" : "grammar") + " of " +
                                std::to_string(std::max(s.grammar().size(), s.json_schema().size())) +
                                " bytes, at most " + std::to_string(kMaxGrammarBytes));
    }
    if (s.ignore_eog() && (!s.grammar().empty() || !s.json_schema().empty())) {
        return err(bad_req, "a grammar ends the answer where it is complete: not together with ignore_eog");
    }
    return std::nullopt;
}

namespace {

Result check_role(bool has_tokens, const pb::ShardIdentity & id) {
    if (has_tokens != id.head()) {
        return err(pb::ERROR_REASON_ROLE_MISMATCH, std::string(has_tokens ? "token ids" : "a boundary bundle") +
                                                       " sent to a " + (id.head() ? "head" : "non-head") + " Shard");
    }
    return std::nullopt;
}

Result check_vocab(int32_t token, const pb::ShardIdentity & id) {
    if (token < 0 || uint32_t(token) >= id.n_vocab()) {
        return err(pb::ERROR_REASON_TOKEN_OUT_OF_VOCAB,
                   "token id " + std::to_string(token) + " outside [0, " + std::to_string(id.n_vocab()) + ")");
    }
    return std::nullopt;
}

const char * phase_name(int phase) {
    const std::string & n = pb::Phase_Name(static_cast<pb::Phase>(phase));
    return n.empty() ? "PHASE_?" : n.c_str();
}

} // namespace

Result check_header(const pb::SessionRequest & req, const pb::GetCapabilityResponse * cap, bool whole_range) {
    const auto                bad_req = pb::ERROR_REASON_BAD_REQUEST;
    const pb::ShardIdentity * id      = cap ? &cap->identity() : nullptr;
    const std::string *       sid     = nullptr;
    const std::string *       rid     = nullptr;
    uint64_t                  epoch   = 0;
    switch (req.frame_case()) {
        case pb::SessionRequest::kFastDecode:
            sid   = &req.fast_decode().session_id();
            rid   = &req.fast_decode().request_id();
            epoch = req.fast_decode().route_epoch();
            break;
        case pb::SessionRequest::kStep: {
            const pb::FrameHeader & h  = req.step().header();
            const int               lo = cap ? cap->min_schema_version() : kMinSchema;
            const int               hi = cap ? cap->schema_version() : kMaxSchema;
            if (h.schema_version() == pb::SCHEMA_VERSION_UNSPECIFIED || h.schema_version() < lo ||
                h.schema_version() > hi) {
                return err(pb::ERROR_REASON_SCHEMA_UNSUPPORTED, "schema_version " +
                                                                    std::to_string(int(h.schema_version())) +
                                                                    " outside [" + std::to_string(lo) + ", " +
                                                                    std::to_string(hi) + "]");
            }
            if (id) {
                if (h.compatibility_fingerprint() != id->compatibility_fingerprint()) {
                    return err(pb::ERROR_REASON_FINGERPRINT_MISMATCH, "fingerprint '" + h.compatibility_fingerprint() +
                                                                          "' != served '" +
                                                                          id->compatibility_fingerprint() + "'");
                }
                if (h.shard_range().start() != id->range().start() || h.shard_range().end() != id->range().end()) {
                    return err(pb::ERROR_REASON_RANGE_MISMATCH,
                               "frame names [" + std::to_string(h.shard_range().start()) + ", " +
                                   std::to_string(h.shard_range().end()) + "), this Shard serves [" +
                                   std::to_string(id->range().start()) + ", " + std::to_string(id->range().end()) +
                                   ")");
                }
                if (h.effective_start() >= id->range().end()) {
                    return err(pb::ERROR_REASON_RANGE_MISMATCH, "effective_start " +
                                                                    std::to_string(h.effective_start()) +
                                                                    " >= " + std::to_string(id->range().end()));
                }
                if (whole_range && h.effective_start() > id->range().start()) {
                    return err(pb::ERROR_REASON_RANGE_MISMATCH,
                               "this worker runs its whole range: effective_start must be unset or the shard start");
                }
            }
            if (h.compression() != pb::COMPRESSION_UNSPECIFIED && h.compression() != pb::COMPRESSION_NONE) {
                return err(pb::ERROR_REASON_UNSUPPORTED_COMPRESSION,
                           "compression " + std::to_string(int(h.compression())) + " not supported");
            }
            const int phase = h.phase();
            if (phase != pb::PHASE_PREFILL && phase != pb::PHASE_DECODE && phase != pb::PHASE_TRUNCATE &&
                phase != pb::PHASE_RELEASE) {
                return err(bad_req, "unknown phase " + std::to_string(phase));
            }
            const int kind = h.cache_expectation().kind();
            if (kind != pb::CACHE_EXPECTATION_KIND_UNSPECIFIED && kind != pb::CACHE_EXPECTATION_KIND_EMPTY &&
                kind != pb::CACHE_EXPECTATION_KIND_POSITION) {
                return err(bad_req, "unknown cache expectation kind " + std::to_string(kind));
            }
            sid   = &h.session_id();
            rid   = &h.request_id();
            epoch = h.route_epoch();
            break;
        }
        default:
            return err(bad_req, "no frame kind this worker knows (sent by a newer schema?)");
    }
    if (sid->empty() || sid->size() > kMaxSessionIdBytes) {
        return err(bad_req, "session_id must be 1.." + std::to_string(kMaxSessionIdBytes) + " bytes");
    }
    if (rid->size() > kMaxRequestIdBytes) {
        return err(bad_req, "request_id above " + std::to_string(kMaxRequestIdBytes) + " bytes");
    }
    if (epoch == 0) {
        return err(bad_req, "route_epoch starts at 1");
    }
    return std::nullopt;
}

Result check_rows(const pb::SessionRequest & req, const pb::GetCapabilityResponse * cap) {
    if (!req.has_step()) {
        return std::nullopt;  // a FastDecodeFrame is one DECODE row by construction
    }
    const pb::StepFrame &   s     = req.step();
    const pb::FrameHeader & h     = s.header();
    const int               phase = h.phase();
    if (phase != pb::PHASE_PREFILL && phase != pb::PHASE_DECODE) {
        if (s.input_case() != pb::StepFrame::INPUT_NOT_SET) {
            return err(pb::ERROR_REASON_BAD_REQUEST, std::string(phase_name(phase)) + " carries no input");
        }
        return verify_checksum(h.payload_checksum(), 0, "frame payload");
    }
    if (h.positions().end() <= h.positions().start()) {
        return err(pb::ERROR_REASON_BAD_REQUEST, "empty positions [" + std::to_string(h.positions().start()) + ", " +
                                                     std::to_string(h.positions().end()) + ")");
    }
    const uint32_t rows = h.positions().end() - h.positions().start();
    if (phase == pb::PHASE_DECODE && rows != 1) {
        return err(pb::ERROR_REASON_CHUNK_TOO_LARGE, "DECODE carries " + std::to_string(rows) + " rows, not 1", {},
                   1);
    }
    if (cap && cap->capacity().max_prefill_chunk_tokens() && rows > cap->capacity().max_prefill_chunk_tokens()) {
        const uint32_t lim = cap->capacity().max_prefill_chunk_tokens();
        return err(pb::ERROR_REASON_CHUNK_TOO_LARGE,
                   std::to_string(rows) + " rows above the chunk limit " + std::to_string(lim), {}, lim);
    }
    return std::nullopt;
}

Result check_input(const pb::SessionRequest & req, const pb::GetCapabilityResponse * cap, bool sampling_applies) {
    const auto                bad_req = pb::ERROR_REASON_BAD_REQUEST;
    const pb::ShardIdentity * id      = cap ? &cap->identity() : nullptr;
    if (req.has_fast_decode()) {
        const pb::FastDecodeFrame & f      = req.fast_decode();
        const bool                  tokens = f.input_case() == pb::FastDecodeFrame::kTokenId;
        if (id && f.input_case() != pb::FastDecodeFrame::INPUT_NOT_SET) {
            if (Result r = check_role(tokens, *id)) {
                return r;
            }
        }
        if (f.input_case() == pb::FastDecodeFrame::INPUT_NOT_SET) {
            return err(bad_req, "fast_decode without input");
        }
        return id && tokens ? check_vocab(f.token_id(), *id) : std::nullopt;
    }
    if (!req.has_step()) {
        return std::nullopt;  // refused by check_header
    }
    const pb::StepFrame &   s     = req.step();
    const pb::FrameHeader & h     = s.header();
    const int               phase = h.phase();
    if (phase != pb::PHASE_PREFILL && phase != pb::PHASE_DECODE) {
        return std::nullopt;  // no input (check_rows)
    }
    if (sampling_applies && s.has_sampling()) {
        if (Result r = check_sampling(s.sampling(), id ? id->n_vocab() : 0)) {
            return r;
        }
    }
    const auto input  = s.input_case();
    const bool tokens = input == pb::StepFrame::kTokens;
    if (id && input != pb::StepFrame::INPUT_NOT_SET) {
        if (Result r = check_role(tokens, *id)) {
            return r;
        }
    }
    if (input == pb::StepFrame::INPUT_NOT_SET) {
        return err(bad_req, std::string(phase_name(phase)) + " without input");
    }
    const uint32_t rows = h.positions().end() - h.positions().start();
    if (tokens && uint32_t(s.tokens().token_ids_size()) != rows) {
        return err(bad_req, std::to_string(s.tokens().token_ids_size()) + " token ids for " + std::to_string(rows) +
                                " positions");
    }
    if (id && tokens) {
        for (int32_t t : s.tokens().token_ids()) {
            if (Result r = check_vocab(t, *id)) {
                return r;
            }
        }
    }
    const uint32_t actual = tokens ? tokens_payload_crc(s.tokens()) : bundle_payload_crc(s.bundle());
    return verify_checksum(h.payload_checksum(), actual, "frame payload");
}

Result check_request(const pb::SessionRequest & req, const pb::GetCapabilityResponse * cap) {
    if (Result r = check_header(req, cap)) {
        return r;
    }
    if (Result r = check_rows(req, cap)) {
        return r;
    }
    return check_input(req, cap);
}

Result check_frame(const pb::SessionRequest & req, const pb::GetCapabilityResponse * cap) {
    if (Result r = check_request(req, cap)) {
        return r;
    }
    const pb::TensorBundle * b = nullptr;
    int compression = pb::COMPRESSION_UNSPECIFIED;
    if (req.has_step() && req.step().has_bundle()) {
        b = &req.step().bundle();
        compression = req.step().header().compression();
    } else if (req.has_fast_decode() && req.fast_decode().has_bundle()) {
        b = &req.fast_decode().bundle();
    }
    if (!b) {
        return std::nullopt;
    }
    Limits lim;
    if (cap) {
        lim.max_tensor_bytes = cap->capacity().max_message_bytes();
        lim.max_fragment_bytes = cap->capacity().max_fragment_bytes();
    }
    std::vector<Tensor> out;
    return read_bundle(*b, &out, lim, compression);
}

} // namespace dgr::bundle
