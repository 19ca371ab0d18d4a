#include "common/bundle.h"

#include "common/checksum.h"

#include <google/protobuf/util/message_differencer.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>
#include <utility>

namespace dgr::bundle {

namespace {

// gRPC status code numbers (grpc/doc/statuscodes.md).
constexpr int kCancelled = 1, kUnknown = 2, kInvalidArgument = 3, kResourceExhausted = 8,
              kFailedPrecondition = 9, kAborted = 10, kInternal = 13, kUnavailable = 14;

bool host_little_endian() {
    const uint16_t one = 1;
    uint8_t        first;
    std::memcpy(&first, &one, 1);
    return first == 1;
}

void swap_elements(uint8_t * data, size_t size, size_t elem) {
    if (elem < 2) {
        return;
    }
    for (size_t i = 0; i + elem <= size; i += elem) {
        std::reverse(data + i, data + i + elem);
    }
}

ProtocolError err(pb::ErrorReason reason, std::string message, std::string tensor = {}, uint64_t limit = 0) {
    ProtocolError e;
    e.reason  = reason;
    e.message = std::move(message);
    e.tensor  = std::move(tensor);
    e.limit   = limit;
    return e;
}

ProtocolError bad(std::string message, std::string tensor = {}) {
    return err(pb::ERROR_REASON_BAD_BUNDLE, std::move(message), std::move(tensor));
}

std::string shape_str(const google::protobuf::RepeatedField<uint64_t> & shape) {
    std::string s = "[";
    for (int i = 0; i < shape.size(); ++i) {
        s += (i ? ", " : "") + std::to_string(shape.Get(i));
    }
    return s + "]";
}

std::string hex32(uint32_t v) {
    char buf[9];
    std::snprintf(buf, sizeof buf, "%08x", v);
    return buf;
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
            return kUnavailable;
        default:
            return kUnknown;
    }
}

std::string ProtocolError::reason_name() const {
    const std::string & name = pb::ErrorReason_Name(reason);
    return name.empty() ? std::to_string(int(reason)) : name;
}

std::string ProtocolError::to_string() const {
    std::string s = reason_name() + ": " + message;
    if (!tensor.empty()) {
        s += " (tensor '" + tensor + "')";
    }
    return s;
}

pb::ShardError ProtocolError::to_message(bool session_terminated) const {
    pb::ShardError m;
    m.set_reason(reason);
    m.set_grpc_code(grpc_code());
    m.set_message(to_string());
    m.set_session_terminated(session_terminated);
    m.set_limit(limit);
    return m;
}

size_t dtype_size(int dtype) {
    switch (dtype) {
        case pb::TENSOR_DTYPE_F32:
        case pb::TENSOR_DTYPE_I32:
            return 4;
        case pb::TENSOR_DTYPE_F16:
        case pb::TENSOR_DTYPE_BF16:
            return 2;
        default:
            return 0;
    }
}

// ---- Assembler -----------------------------------------------------------------------------

Assembler::Assembler(Limits limits, int compression) : limits_(limits), compression_(compression) {}

Result Assembler::check_meta(const pb::NamedTensor & t) const {
    const std::string & name = t.name();
    if (name.empty()) {
        return bad("tensor with an empty name");
    }
    const size_t esize = dtype_size(t.dtype());
    if (esize == 0) {
        return bad("unknown dtype " + std::to_string(int(t.dtype())), name);
    }
    if (t.byte_order() != pb::BYTE_ORDER_UNSPECIFIED && t.byte_order() != pb::BYTE_ORDER_LITTLE_ENDIAN &&
        t.byte_order() != pb::BYTE_ORDER_BIG_ENDIAN) {
        return bad("unknown byte order " + std::to_string(int(t.byte_order())), name);
    }
    if (t.shape_size() > kMaxDims) {
        return bad(std::to_string(t.shape_size()) + " dimensions, at most " + std::to_string(kMaxDims), name);
    }
    for (uint64_t d : t.shape()) {
        if (d == 0) {
            return bad("shape " + shape_str(t.shape()) + " has a zero dimension", name);
        }
    }
    if (limits_.max_tensor_bytes && t.byte_size() > limits_.max_tensor_bytes) {
        return err(pb::ERROR_REASON_MESSAGE_TOO_LARGE,
                   "byte_size " + std::to_string(t.byte_size()) + " above the limit " +
                       std::to_string(limits_.max_tensor_bytes),
                   name, limits_.max_tensor_bytes);
    }
    uint64_t want = esize;
    bool     overflow = false;
    for (uint64_t d : t.shape()) {
        overflow = overflow || __builtin_mul_overflow(want, d, &want);
    }
    if (overflow || want != t.byte_size()) {
        return bad("shape " + shape_str(t.shape()) + " x " + pb::TensorDtype_Name(t.dtype()) + " is " +
                       (overflow ? std::string("too many") : std::to_string(want)) + " bytes, byte_size says " +
                       std::to_string(t.byte_size()),
                   name);
    }
    if (t.fragment_count() < 1 || t.fragment_count() > t.byte_size()) {
        return bad("fragment_count " + std::to_string(t.fragment_count()) + " outside [1, " +
                       std::to_string(t.byte_size()) + "]",
                   name);
    }
    if (t.checksum().algorithm() != pb::CHECKSUM_ALGORITHM_UNSPECIFIED &&
        t.checksum().algorithm() != pb::CHECKSUM_ALGORITHM_CRC32) {
        return bad("unknown checksum algorithm " + std::to_string(int(t.checksum().algorithm())), name);
    }
    return std::nullopt;
}

Result Assembler::add(const pb::TensorBundle & bundle) {
    if (compression_ != pb::COMPRESSION_UNSPECIFIED && compression_ != pb::COMPRESSION_NONE) {
        return err(pb::ERROR_REASON_UNSUPPORTED_COMPRESSION,
                   "compression " + std::to_string(compression_) + " is not supported by schema v1 receivers");
    }
    std::set<std::string> seen_here;
    for (const pb::NamedTensor & t : bundle.tensors()) {
        if (!seen_here.insert(t.name()).second) {
            return bad("tensor named twice in one bundle", t.name());
        }
        pb::NamedTensor meta = t;
        meta.clear_fragments();
        auto it = std::find_if(tensors_.begin(), tensors_.end(),
                               [&](const Pending & p) { return p.meta.name() == t.name(); });
        if (it == tensors_.end()) {
            if (Result r = check_meta(t)) {
                return r;
            }
            tensors_.push_back(Pending{ std::move(meta), {}, 0 });
            it = tensors_.end() - 1;
        } else if (!google::protobuf::util::MessageDifferencer::Equals(it->meta, meta)) {
            return bad("tensor metadata differs between frames of one step", t.name());
        }
        for (const pb::TensorFragment & f : t.fragments()) {
            const std::string idx = std::to_string(f.index());
            if (f.index() >= t.fragment_count()) {
                return bad("fragment index " + idx + " >= fragment_count " + std::to_string(t.fragment_count()),
                           t.name());
            }
            if (it->parts.count(f.index())) {
                return bad("fragment " + idx + " received twice", t.name());
            }
            if (f.data().empty()) {
                return bad("fragment " + idx + " is empty", t.name());
            }
            if (limits_.max_fragment_bytes && f.data().size() > limits_.max_fragment_bytes) {
                return err(pb::ERROR_REASON_MESSAGE_TOO_LARGE,
                           "fragment " + idx + " is " + std::to_string(f.data().size()) + " bytes, above " +
                               std::to_string(limits_.max_fragment_bytes),
                           t.name(), limits_.max_fragment_bytes);
            }
            if (it->received + f.data().size() > t.byte_size()) {
                return bad("fragments exceed byte_size " + std::to_string(t.byte_size()), t.name());
            }
            it->parts.emplace(f.index(), f.data());
            it->received += f.data().size();
        }
    }
    return std::nullopt;
}

bool Assembler::complete() const {
    if (tensors_.empty()) {
        return false;
    }
    for (const Pending & p : tensors_) {
        if (p.parts.size() != p.meta.fragment_count()) {
            return false;
        }
    }
    return true;
}

std::map<std::string, std::vector<uint32_t>> Assembler::missing() const {
    std::map<std::string, std::vector<uint32_t>> out;
    for (const Pending & p : tensors_) {
        if (p.parts.size() == p.meta.fragment_count()) {
            continue;
        }
        auto & gaps = out[p.meta.name()];
        for (uint32_t i = 0; i < p.meta.fragment_count() && gaps.size() < 1024; ++i) {
            if (!p.parts.count(i)) {
                gaps.push_back(i);
            }
        }
    }
    return out;
}

Result Assembler::finish(std::vector<Tensor> * out) {
    if (tensors_.empty()) {
        return bad("bundle carries no tensor");
    }
    std::vector<Tensor> result;
    result.reserve(tensors_.size());
    for (Pending & p : tensors_) {
        const pb::NamedTensor & t = p.meta;
        if (p.parts.size() != t.fragment_count()) {
            std::string shown;
            int         n = 0;
            for (uint32_t i = 0; i < t.fragment_count() && n <= 8; ++i) {
                if (!p.parts.count(i)) {
                    shown += (n ? ", " : "") + (n == 8 ? std::string("...") : std::to_string(i));
                    ++n;
                }
            }
            return bad("missing fragment(s) " + shown + " of " + std::to_string(t.fragment_count()), t.name());
        }
        Tensor out_t;
        out_t.data.reserve(p.received);
        for (auto & [index, part] : p.parts) { // std::map: index order
            out_t.data.insert(out_t.data.end(), part.begin(), part.end());
            std::string().swap(part);
        }
        if (out_t.data.size() != t.byte_size()) {
            return bad("reassembled " + std::to_string(out_t.data.size()) + " bytes, byte_size says " +
                           std::to_string(t.byte_size()),
                       t.name());
        }
        if (t.checksum().algorithm() == pb::CHECKSUM_ALGORITHM_CRC32) {
            const uint32_t got = crc32(out_t.data.data(), out_t.data.size());
            if (got != t.checksum().value()) {
                return bad("checksum " + hex32(got) + " != " + hex32(t.checksum().value()), t.name());
            }
        }
        const bool wire_big = t.byte_order() == pb::BYTE_ORDER_BIG_ENDIAN;
        if (wire_big == host_little_endian()) {
            swap_elements(out_t.data.data(), out_t.data.size(), dtype_size(t.dtype()));
        }
        out_t.name  = t.name();
        out_t.shape = std::vector<uint64_t>(t.shape().begin(), t.shape().end());
        out_t.dtype = t.dtype();
        result.push_back(std::move(out_t));
    }
    *out = std::move(result);
    return std::nullopt;
}

Result read_bundle(const pb::TensorBundle & bundle, std::vector<Tensor> * out, Limits limits, int compression) {
    Assembler asm_(limits, compression);
    if (Result r = asm_.add(bundle)) {
        return r;
    }
    return asm_.finish(out);
}

Result read_boundary(const pb::TensorBundle & bundle, uint32_t n_tokens, uint32_t n_embd, std::vector<float> * out,
                     Limits limits) {
    std::vector<Tensor> tensors;
    if (Result r = read_bundle(bundle, &tensors, limits)) {
        return r;
    }
    if (tensors.size() != 1 || tensors[0].name != kResidual) {
        return bad(std::string("boundary bundle must carry exactly '") + kResidual + "'");
    }
    const Tensor & t = tensors[0];
    if (t.dtype != pb::TENSOR_DTYPE_F32 || t.shape.size() != 2 || t.shape[0] != n_tokens || t.shape[1] != n_embd) {
        std::string got = "[";
        for (size_t i = 0; i < t.shape.size(); ++i) {
            got += (i ? ", " : "") + std::to_string(t.shape[i]);
        }
        return bad("expected f32 [" + std::to_string(n_tokens) + ", " + std::to_string(n_embd) + "], got " +
                       pb::TensorDtype_Name(t.dtype) + " " + got + "]",
                   kResidual);
    }
    out->resize(size_t(n_tokens) * n_embd);
    std::memcpy(out->data(), t.data.data(), t.data.size());
    return std::nullopt;
}

// ---- writing -------------------------------------------------------------------------------

void write_tensor(pb::NamedTensor * out, const std::string & name, const std::vector<uint64_t> & shape,
                  pb::TensorDtype dtype, const void * data, size_t size, size_t fragment_bytes) {
    if (fragment_bytes == 0) {
        fragment_bytes = kDefaultFragmentBytes;
    }
    std::string bytes(static_cast<const char *>(data), size);
    if (!host_little_endian()) {
        swap_elements(reinterpret_cast<uint8_t *>(bytes.data()), bytes.size(), dtype_size(dtype));
    }
    out->Clear();
    out->set_name(name);
    for (uint64_t d : shape) {
        out->add_shape(d);
    }
    out->set_dtype(dtype);
    out->set_byte_order(pb::BYTE_ORDER_LITTLE_ENDIAN);
    out->set_byte_size(bytes.size());
    const size_t n_frag = std::max<size_t>(1, (bytes.size() + fragment_bytes - 1) / fragment_bytes);
    out->set_fragment_count(uint32_t(n_frag));
    *out->mutable_checksum() = crc_checksum(crc32(bytes.data(), bytes.size()));
    for (size_t i = 0; i < n_frag; ++i) {
        pb::TensorFragment * f = out->add_fragments();
        f->set_index(uint32_t(i));
        const size_t off = i * fragment_bytes;
        f->set_data(bytes.substr(off, std::min(fragment_bytes, bytes.size() - std::min(off, bytes.size()))));
    }
}

pb::TensorBundle boundary_bundle(const float * rows, uint32_t n_tokens, uint32_t n_embd, size_t fragment_bytes) {
    pb::TensorBundle b;
    write_tensor(b.add_tensors(), kResidual, { n_tokens, n_embd }, pb::TENSOR_DTYPE_F32, rows,
                 size_t(n_tokens) * n_embd * sizeof(float), fragment_bytes);
    return b;
}

// ---- frame checks --------------------------------------------------------------------------

uint32_t tokens_payload_crc(const pb::TokenSpan & tokens) {
    uint32_t crc = 0;
    for (int32_t id : tokens.token_ids()) {
        const uint32_t u     = static_cast<uint32_t>(id);
        const uint8_t  le[4] = { uint8_t(u), uint8_t(u >> 8), uint8_t(u >> 16), uint8_t(u >> 24) };
        crc                  = crc32(le, 4, crc);
    }
    return crc;
}

uint32_t bundle_payload_crc(const pb::TensorBundle & bundle) {
    uint32_t crc = 0;
    for (const pb::NamedTensor & t : bundle.tensors()) {
        for (const pb::TensorFragment & f : t.fragments()) {
            crc = crc32(f.data().data(), f.data().size(), crc);
        }
    }
    return crc;
}

pb::Checksum crc_checksum(uint32_t value) {
    pb::Checksum c;
    c.set_algorithm(pb::CHECKSUM_ALGORITHM_CRC32);
    c.set_value(value);
    return c;
}

Result verify_checksum(const pb::Checksum & expected, uint32_t actual, const char * what) {
    if (expected.algorithm() == pb::CHECKSUM_ALGORITHM_UNSPECIFIED) {
        return std::nullopt;
    }
    if (expected.algorithm() != pb::CHECKSUM_ALGORITHM_CRC32) {
        return err(pb::ERROR_REASON_BAD_REQUEST,
                   "unknown checksum algorithm " + std::to_string(int(expected.algorithm())));
    }
    if (expected.value() != actual) {
        return bad(std::string(what) + " checksum " + hex32(actual) + " != " + hex32(expected.value()));
    }
    return std::nullopt;
}

Result check_sampling(const pb::SamplingParams & s) {
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

Result check_request(const pb::SessionRequest & req, const pb::GetCapabilityResponse * cap) {
    const auto                bad_req = pb::ERROR_REASON_BAD_REQUEST;
    const pb::ShardIdentity * id      = cap ? &cap->identity() : nullptr;
    switch (req.frame_case()) {
        case pb::SessionRequest::kFastDecode: {
            const pb::FastDecodeFrame & f = req.fast_decode();
            if (f.session_id().empty()) {
                return err(bad_req, "fast_decode without session_id");
            }
            if (f.input_case() == pb::FastDecodeFrame::INPUT_NOT_SET) {
                return err(bad_req, "fast_decode without input");
            }
            if (id) {
                const bool tokens = f.input_case() == pb::FastDecodeFrame::kTokenId;
                if (Result r = check_role(tokens, *id)) {
                    return r;
                }
                if (tokens) {
                    return check_vocab(f.token_id(), *id);
                }
            }
            return std::nullopt;
        }
        case pb::SessionRequest::kStep:
            break;
        default:
            return err(bad_req, "no frame kind this worker knows (sent by a newer schema?)");
    }
    const pb::StepFrame & s = req.step();
    if (!s.has_header()) {
        return err(bad_req, "step frame without header");
    }
    const pb::FrameHeader & h  = s.header();
    const int               lo = cap ? cap->min_schema_version() : kMinSchema;
    const int               hi = cap ? cap->schema_version() : kMaxSchema;
    if (h.schema_version() == pb::SCHEMA_VERSION_UNSPECIFIED || h.schema_version() < lo || h.schema_version() > hi) {
        return err(pb::ERROR_REASON_SCHEMA_UNSUPPORTED, "schema_version " + std::to_string(int(h.schema_version())) +
                                                            " outside [" + std::to_string(lo) + ", " +
                                                            std::to_string(hi) + "]");
    }
    if (h.session_id().empty()) {
        return err(bad_req, "header without session_id");
    }
    const int  phase = h.phase();
    const bool rows_phase = phase == pb::PHASE_PREFILL || phase == pb::PHASE_DECODE;
    if (!rows_phase && phase != pb::PHASE_TRUNCATE && phase != pb::PHASE_RELEASE) {
        return err(bad_req, "unknown phase " + std::to_string(phase));
    }
    if (id) {
        if (h.compatibility_fingerprint() != id->compatibility_fingerprint()) {
            return err(pb::ERROR_REASON_FINGERPRINT_MISMATCH, "fingerprint '" + h.compatibility_fingerprint() +
                                                                  "' != served '" + id->compatibility_fingerprint() +
                                                                  "'");
        }
        if (h.shard_range().start() != id->range().start() || h.shard_range().end() != id->range().end()) {
            return err(pb::ERROR_REASON_RANGE_MISMATCH,
                       "frame names [" + std::to_string(h.shard_range().start()) + ", " +
                           std::to_string(h.shard_range().end()) + "), this Shard serves [" +
                           std::to_string(id->range().start()) + ", " + std::to_string(id->range().end()) + ")");
        }
        if (h.effective_start() >= id->range().end()) {
            return err(pb::ERROR_REASON_RANGE_MISMATCH, "effective_start " + std::to_string(h.effective_start()) +
                                                            " >= " + std::to_string(id->range().end()));
        }
    }
    const auto input = s.input_case();
    if (rows_phase) {
        if (h.positions().end() <= h.positions().start()) {
            return err(bad_req, "empty positions [" + std::to_string(h.positions().start()) + ", " +
                                    std::to_string(h.positions().end()) + ")");
        }
        const uint32_t rows = h.positions().end() - h.positions().start();
        if (input == pb::StepFrame::INPUT_NOT_SET) {
            return err(bad_req, std::string(phase_name(phase)) + " without input");
        }
        if (phase == pb::PHASE_DECODE && rows != 1) {
            return err(pb::ERROR_REASON_CHUNK_TOO_LARGE, "DECODE carries " + std::to_string(rows) + " rows, not 1",
                       {}, 1);
        }
        if (cap && cap->capacity().max_prefill_chunk_tokens() && rows > cap->capacity().max_prefill_chunk_tokens()) {
            const uint32_t lim = cap->capacity().max_prefill_chunk_tokens();
            return err(pb::ERROR_REASON_CHUNK_TOO_LARGE,
                       std::to_string(rows) + " rows above the chunk limit " + std::to_string(lim), {}, lim);
        }
        const bool tokens = input == pb::StepFrame::kTokens;
        if (tokens && uint32_t(s.tokens().token_ids_size()) != rows) {
            return err(bad_req, std::to_string(s.tokens().token_ids_size()) + " token ids for " +
                                    std::to_string(rows) + " positions");
        }
        if (id) {
            if (Result r = check_role(tokens, *id)) {
                return r;
            }
            if (tokens) {
                for (int32_t t : s.tokens().token_ids()) {
                    if (Result r = check_vocab(t, *id)) {
                        return r;
                    }
                }
            }
        }
    } else if (input != pb::StepFrame::INPUT_NOT_SET) {
        return err(bad_req, std::string(phase_name(phase)) + " carries no input");
    }
    if (h.compression() != pb::COMPRESSION_UNSPECIFIED && h.compression() != pb::COMPRESSION_NONE) {
        return err(pb::ERROR_REASON_UNSUPPORTED_COMPRESSION,
                   "compression " + std::to_string(int(h.compression())) + " not supported");
    }
    if (s.has_sampling()) {
        if (Result r = check_sampling(s.sampling())) {
            return r;
        }
    }
    uint32_t actual = 0;
    if (input == pb::StepFrame::kTokens) {
        actual = tokens_payload_crc(s.tokens());
    } else if (input == pb::StepFrame::kBundle) {
        actual = bundle_payload_crc(s.bundle());
    }
    return verify_checksum(h.payload_checksum(), actual, "frame payload");
}

} // namespace dgr::bundle
