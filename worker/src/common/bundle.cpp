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
    return protocol_error(reason, std::move(message), std::move(tensor), limit);
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

ProtocolError protocol_error(pb::ErrorReason reason, std::string message, std::string tensor, uint64_t limit) {
    ProtocolError e;
    e.reason  = reason;
    e.message = std::move(message);
    e.tensor  = std::move(tensor);
    e.limit   = limit;
    return e;
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
    m.set_message(tensor.empty() ? message : message + " (tensor '" + tensor + "')");
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

void Assembler::expect_only(std::string name, pb::TensorDtype dtype, std::vector<uint64_t> shape) {
    expect_          = true;
    expected_.name  = std::move(name);
    expected_.dtype = dtype;
    expected_.shape = std::move(shape);
}

Result Assembler::add(const pb::TensorBundle & bundle) {
    if (compression_ != pb::COMPRESSION_UNSPECIFIED && compression_ != pb::COMPRESSION_NONE) {
        return err(pb::ERROR_REASON_UNSUPPORTED_COMPRESSION,
                   "compression " + std::to_string(compression_) + " is not supported by schema v1 receivers");
    }
    if (expect_) {
        if (bundle.tensors_size() != 1 || bundle.tensors(0).name() != expected_.name) {
            return bad("a boundary bundle carries exactly one tensor named '" + expected_.name + "'");
        }
        const pb::NamedTensor & t = bundle.tensors(0);
        const bool same_shape = t.shape_size() == int(expected_.shape.size()) &&
                                std::equal(expected_.shape.begin(), expected_.shape.end(), t.shape().begin());
        if (t.dtype() != expected_.dtype || !same_shape) {
            std::string want = "[";
            for (size_t i = 0; i < expected_.shape.size(); ++i) {
                want += (i ? ", " : "") + std::to_string(expected_.shape[i]);
            }
            return bad("expected " + pb::TensorDtype_Name(expected_.dtype) + " " + want + "], got " +
                           pb::TensorDtype_Name(t.dtype()) + " " + shape_str(t.shape()) +
                           " (rows = positions.end - positions.start)",
                       t.name());
        }
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
    const char * bytes = static_cast<const char *>(data);
    std::string  swapped;  // big-endian hosts only: the wire is little-endian
    if (!host_little_endian()) {
        swapped.assign(bytes, size);
        swap_elements(reinterpret_cast<uint8_t *>(swapped.data()), swapped.size(), dtype_size(dtype));
        bytes = swapped.data();
    }
    out->Clear();
    out->set_name(name);
    for (uint64_t d : shape) {
        out->add_shape(d);
    }
    out->set_dtype(dtype);
    out->set_byte_order(pb::BYTE_ORDER_LITTLE_ENDIAN);
    out->set_byte_size(size);
    const size_t n_frag = std::max<size_t>(1, (size + fragment_bytes - 1) / fragment_bytes);
    out->set_fragment_count(uint32_t(n_frag));
    *out->mutable_checksum() = crc_checksum(crc32(bytes, size));
    for (size_t i = 0; i < n_frag; ++i) {
        pb::TensorFragment * f = out->add_fragments();
        f->set_index(uint32_t(i));
        const size_t off = std::min(i * fragment_bytes, size);
        f->set_data(bytes + off, std::min(fragment_bytes, size - off));
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
    return tokens_crc(tokens.token_ids().data(), size_t(tokens.token_ids_size()));
}

uint32_t tokens_crc(const int32_t * ids, size_t n) {
    uint32_t crc = 0;
    for (size_t i = 0; i < n; ++i) {
        const int32_t id = ids[i];
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

} // namespace dgr::bundle
