// Identity proven by the file: the SHA-256 of every tensor's bytes (in parallel), and the
// verification of a dgr slice against the manifest it carries (docs/identity.md "Slices"),
// the same checks as `dgr gguf verify-slice` minus the architecture adapter's tensor plan:
//   - the embedded source manifest hashes to dgr.slice.source_artifact_id;
//   - the slice's own pairs (minus dgr.slice.*) reproduce the source metadata and tokenizer
//     digests;
//   - the range pairs are consistent (start < end <= n_layer, head/tail flags);
//   - every tensor's manifest line (name, type, shape, size, sha256 of its bytes) is one of
//     dgr.slice.tensor_entries, every entry is a tensor of the file, and every entry is a line
//     of the source manifest.
// A failure names the tensor (or the pair) and both values.
#pragma once

#include "common/identity.h"

#include <string>
#include <vector>

namespace dgr {

// sha256 hex of each tensor's data, in the order given; `threads` workers (0: all cores).
// Pages hashed are dropped from the process again (MADV_DONTNEED) as it goes, so that proving
// the identity of a model larger than the memory it may hold does not make it resident.
std::vector<std::string> tensor_sha256s(const std::vector<TensorRef> & ts, unsigned threads = 0);
std::vector<std::string> tensor_sha256s(const GgufHeader & g, const std::vector<const GgufTensor *> & ts,
                                        unsigned threads = 0);

// "tensor NAME TYPE SHAPE NBYTES SHA256" (docs/identity.md) for one tensor and its digest.
std::string manifest_line(const GgufTensor & t, const std::string & sha256);

// Reads a string-array pair; false if missing or of another type.
bool get_string_array(const GgufHeader & g, const std::string & key, std::vector<std::string> * out);

struct SliceVerdict {
    uint64_t bytes_hashed = 0;
    size_t tensors = 0;
};

// Verifies an opened slice (g.is_slice()); false + *error (one line, naming the tensor or pair).
bool verify_slice(const GgufHeader & g, SliceVerdict * verdict, std::string * error, unsigned threads = 0);

}  // namespace dgr
