// Boundary bundle handling for the worker: CRC-32/IEEE, building the "residual" bundle a
// non-tail shard answers with, and assembling + validating the one a non-head shard receives
// (possibly spread over several frames of one step). Rules: NamedTensor in shard_runtime.proto.
#pragma once

#include "dgr/shard/v1/shard_runtime.pb.h"

#include <cstdint>
#include <string>
#include <vector>

namespace dgr::worker {

namespace pb = ::dgr::shard::v1;

uint32_t crc32(const void * data, size_t n, uint32_t crc = 0);
// CRC of token ids as 4-byte little-endian (TokenSpan payload, TailOutput payload).
uint32_t crc32_tokens(const int32_t * ids, size_t n);

// One [rows, n_embd] f32 tensor named "residual", fragments of at most max_fragment bytes.
// *payload_crc: CRC over all fragment data in order (the response header checksum).
pb::TensorBundle make_residual_bundle(const float * rows, uint32_t n_rows, uint32_t n_embd,
                                      uint32_t max_fragment, uint32_t * payload_crc);

struct BundleIssue {
    pb::ErrorReason reason = pb::ERROR_REASON_UNSPECIFIED;  // UNSPECIFIED: none
    std::string message;
    uint64_t limit = 0;
    bool ok() const { return reason == pb::ERROR_REASON_UNSPECIFIED; }
};

// Collects the fragments of the "residual" tensor of one step.
class ResidualAssembly {
public:
    ResidualAssembly(uint32_t rows, uint32_t n_embd, uint64_t max_bytes, uint32_t max_fragment)
        : rows_(rows), n_embd_(n_embd), max_bytes_(max_bytes), max_fragment_(max_fragment) {}
    // Adds one frame's bundle (validating metadata and fragments); on an issue nothing is kept.
    BundleIssue add(const pb::TensorBundle & b);
    bool complete() const { return started_ && n_seen_ == meta_.fragment_count(); }
    // After complete(): checksum check and conversion to native f32 rows.
    BundleIssue finish(std::vector<float> * rows);
private:
    uint32_t rows_, n_embd_;
    uint64_t max_bytes_;
    uint32_t max_fragment_;
    bool started_ = false;
    pb::NamedTensor meta_;  // without fragments
    std::vector<std::string> frags_;
    uint32_t n_seen_ = 0;
};

}  // namespace dgr::worker
