#include "worker/boundary_io.h"

#include <algorithm>
#include <cstring>

namespace dgr::worker {

namespace {
struct CrcTable {
    uint32_t t[256];
    CrcTable() {
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            t[i] = c;
        }
    }
};
const CrcTable kCrc;

BundleIssue issue(pb::ErrorReason r, std::string msg, uint64_t limit = 0) {
    BundleIssue i;
    i.reason = r;
    i.message = std::move(msg);
    i.limit = limit;
    return i;
}
}  // namespace

uint32_t crc32(const void * data, size_t n, uint32_t crc) {
    const auto * p = static_cast<const unsigned char *>(data);
    crc = ~crc;
    for (size_t i = 0; i < n; ++i) crc = kCrc.t[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return ~crc;
}

uint32_t crc32_tokens(const int32_t * ids, size_t n) {
    uint32_t c = 0;
    for (size_t i = 0; i < n; ++i) {
        const uint32_t v = (uint32_t) ids[i];
        const unsigned char le[4] = {(unsigned char) v, (unsigned char) (v >> 8), (unsigned char) (v >> 16),
                                     (unsigned char) (v >> 24)};
        c = crc32(le, 4, c);
    }
    return c;
}

pb::TensorBundle make_residual_bundle(const float * rows, uint32_t n_rows, uint32_t n_embd,
                                      uint32_t max_fragment, uint32_t * payload_crc) {
    pb::TensorBundle b;
    auto * t = b.add_tensors();
    t->set_name("residual");
    t->add_shape(n_rows);
    t->add_shape(n_embd);
    t->set_dtype(pb::TENSOR_DTYPE_F32);
    t->set_byte_order(pb::BYTE_ORDER_LITTLE_ENDIAN);
    const size_t bytes = (size_t) n_rows * n_embd * sizeof(float);
    t->set_byte_size(bytes);
    const size_t frag = max_fragment ? max_fragment : bytes;
    const uint32_t count = (uint32_t) ((bytes + frag - 1) / frag);
    t->set_fragment_count(count);
    const uint32_t crc = crc32(rows, bytes);  // little-endian hosts only (x86/arm64)
    t->mutable_checksum()->set_algorithm(pb::CHECKSUM_ALGORITHM_CRC32);
    t->mutable_checksum()->set_value(crc);
    for (uint32_t i = 0; i < count; ++i) {
        auto * f = t->add_fragments();
        f->set_index(i);
        const size_t off = (size_t) i * frag;
        f->set_data(reinterpret_cast<const char *>(rows) + off, std::min(frag, bytes - off));
    }
    if (payload_crc) *payload_crc = crc;
    return b;
}

BundleIssue ResidualAssembly::add(const pb::TensorBundle & b) {
    if (b.tensors_size() != 1 || b.tensors(0).name() != "residual") {
        return issue(pb::ERROR_REASON_BAD_BUNDLE, "a boundary bundle carries exactly one tensor named 'residual'");
    }
    const auto & t = b.tensors(0);
    const uint64_t want = (uint64_t) rows_ * n_embd_ * 4;
    if (!started_) {
        if (t.dtype() != pb::TENSOR_DTYPE_F32) return issue(pb::ERROR_REASON_BAD_BUNDLE, "residual dtype must be TENSOR_DTYPE_F32");
        if (t.byte_order() != pb::BYTE_ORDER_UNSPECIFIED && t.byte_order() != pb::BYTE_ORDER_LITTLE_ENDIAN &&
            t.byte_order() != pb::BYTE_ORDER_BIG_ENDIAN) {
            return issue(pb::ERROR_REASON_BAD_BUNDLE, "unknown byte order");
        }
        if (t.shape_size() != 2 || t.shape(0) != rows_ || t.shape(1) != n_embd_) {
            return issue(pb::ERROR_REASON_BAD_BUNDLE, "residual shape must be [" + std::to_string(rows_) + ", " +
                                                          std::to_string(n_embd_) + "] (rows = positions.end - positions.start)");
        }
        if (t.byte_size() > max_bytes_) {
            return issue(pb::ERROR_REASON_MESSAGE_TOO_LARGE, "residual byte_size above max_message_bytes", max_bytes_);
        }
        if (t.byte_size() != want) return issue(pb::ERROR_REASON_BAD_BUNDLE, "byte_size != product(shape) * 4");
        if (t.fragment_count() < 1 || t.fragment_count() > t.byte_size()) {
            return issue(pb::ERROR_REASON_BAD_BUNDLE, "fragment_count must be in [1, byte_size]");
        }
        meta_ = t;
        meta_.clear_fragments();
        frags_.assign(t.fragment_count(), std::string());
        started_ = true;
    } else {
        pb::NamedTensor m = t;
        m.clear_fragments();
        if (m.SerializeAsString() != meta_.SerializeAsString()) {
            return issue(pb::ERROR_REASON_BAD_BUNDLE, "tensor metadata differs between frames of one step");
        }
    }
    // check all fragments first, then keep them (nothing kept on an issue)
    std::vector<bool> seen_here(frags_.size(), false);
    for (const auto & f : t.fragments()) {
        if (f.index() >= frags_.size()) return issue(pb::ERROR_REASON_BAD_BUNDLE, "fragment index >= fragment_count");
        if (f.data().empty()) return issue(pb::ERROR_REASON_BAD_BUNDLE, "empty fragment");
        if (f.data().size() > max_fragment_) {
            return issue(pb::ERROR_REASON_MESSAGE_TOO_LARGE, "fragment above max_fragment_bytes", max_fragment_);
        }
        if (seen_here[f.index()] || !frags_[f.index()].empty()) {
            return issue(pb::ERROR_REASON_BAD_BUNDLE, "fragment " + std::to_string(f.index()) + " seen twice");
        }
        seen_here[f.index()] = true;
    }
    for (const auto & f : t.fragments()) {
        frags_[f.index()] = f.data();
        n_seen_++;
    }
    return {};
}

BundleIssue ResidualAssembly::finish(std::vector<float> * rows) {
    std::string payload;
    payload.reserve(meta_.byte_size());
    for (const auto & f : frags_) payload += f;
    if (payload.size() != meta_.byte_size()) {
        return issue(pb::ERROR_REASON_BAD_BUNDLE, "reassembled payload length != byte_size");
    }
    if (meta_.checksum().algorithm() == pb::CHECKSUM_ALGORITHM_CRC32 &&
        crc32(payload.data(), payload.size()) != meta_.checksum().value()) {
        return issue(pb::ERROR_REASON_BAD_BUNDLE, "tensor checksum mismatch");
    }
    if (meta_.byte_order() == pb::BYTE_ORDER_BIG_ENDIAN) {
        for (size_t i = 0; i + 3 < payload.size(); i += 4) {
            std::swap(payload[i], payload[i + 3]);
            std::swap(payload[i + 1], payload[i + 2]);
        }
    }
    rows->resize(payload.size() / 4);
    std::memcpy(rows->data(), payload.data(), payload.size());
    return {};
}

}  // namespace dgr::worker
