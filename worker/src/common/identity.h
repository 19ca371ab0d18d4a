// Model Artifact identity in C++: the same artifact id, tokenizer digest and compatibility
// fingerprint as Python's dgr.identity.identify(path) and dgr.recipe.recipe_for(path)
// (docs/identity.md), so that a bare `dgr-worker serve --model FILE` serves the real identity.
//
// GgufHeader is a strict little-endian GGUF (v2/v3) header reader over a read-only map of the
// file: every read is bounds-checked and a truncated or corrupt file is a one-line error. It
// records each metadata pair's raw byte span [start of the u64 key length, end of the value) --
// those raw bytes ARE the canonical encoding of the pair -- and each tensor's name, type, dims,
// absolute data offset and data size.
#pragma once

#include "common/fingerprint.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dgr {

struct GgufPair {
    uint32_t vtype = 0;
    uint64_t start = 0;        // offset of the u64 key length
    uint64_t value_start = 0;  // offset of the u32 value type
    uint64_t end = 0;          // one past the value's last byte
};

struct GgufTensor {
    std::string name;
    uint32_t ggml_type = 0;
    std::vector<uint64_t> dims;  // GGUF order, ne0 first
    uint64_t offset = 0;         // absolute offset of the data in the file
    uint64_t n_bytes = 0;
};

class GgufHeader {
public:
    GgufHeader() = default;
    ~GgufHeader();
    GgufHeader(const GgufHeader &) = delete;
    GgufHeader & operator=(const GgufHeader &) = delete;

    // Map and parse the file; false + *error (one line) on a missing, truncated or corrupt file.
    bool open(const std::string & path, std::string * error);

    const std::string & path() const { return path_; }
    uint64_t size() const { return size_; }
    const uint8_t * data() const { return base_; }
    const std::map<std::string, GgufPair> & pairs() const { return pairs_; }  // sorted by key bytes
    const std::vector<GgufTensor> & tensors() const { return tensors_; }       // file order
    uint32_t alignment() const { return alignment_; }

    bool has(const std::string & key) const { return pairs_.count(key) != 0; }
    // Typed reads of one pair; false if it is missing or of another type.
    bool get_string(const std::string & key, std::string * out) const;
    bool get_u32(const std::string & key, uint32_t * out) const;
    bool get_u16(const std::string & key, uint16_t * out) const;
    bool get_i32(const std::string & key, int32_t * out) const;

    // sha256 hex over the domain line and the raw bytes of the chosen pairs, sorted by key bytes.
    std::string kv_digest(const std::string & domain, const std::function<bool(const std::string &)> & keep) const;
    std::string metadata_digest() const;   // every pair but dgr.slice.* and split.*
    std::string tokenizer_digest() const;  // tokenizer.* pairs
    bool is_slice() const;

private:
    std::string path_;
    int fd_ = -1;
    uint8_t * base_ = nullptr;
    uint64_t size_ = 0;
    uint32_t alignment_ = 32;
    std::map<std::string, GgufPair> pairs_;
    std::vector<GgufTensor> tensors_;
};

// One tensor of a model artifact and the file (part) that holds it.
struct TensorRef {
    const GgufHeader * part = nullptr;
    const GgufTensor * tensor = nullptr;
    size_t part_index = 0;  // 0-based, as split.no
};

// A model artifact as files: one GGUF, or the parts of a split set as llama.cpp's gguf-split
// writes them (docs/identity.md "Split GGUF sets"): PREFIX-00001-of-0000N.gguf ..
// PREFIX-0000N-of-0000N.gguf, each with split.no (u16, 0-based), split.count (u16) and
// split.tensors.count (i32, the set's total); part 1 carries the metadata, every part tensors.
// open() takes any part's path and opens the set from part 1 (path()); it refuses, naming the
// part, a set with a missing, extra, reordered or mismatched part, or a tensor held twice.
class GgufSet {
public:
    bool open(const std::string & path, std::string * error);

    const std::string & path() const { return path_; }  // the file, or part 1 of a set
    const GgufHeader & first() const { return *parts_.front(); }
    size_t n_parts() const { return parts_.size(); }
    bool is_split() const { return parts_.size() > 1; }
    const GgufHeader & part(size_t i) const { return *parts_[i]; }
    const std::vector<TensorRef> & tensors() const { return tensors_; }  // part order, then file order
    uint64_t file_bytes() const;  // all parts

private:
    std::string path_;
    std::vector<std::unique_ptr<GgufHeader>> parts_;
    std::vector<TensorRef> tensors_;
};

// The path of part `index` (0-based) of an n-part set named PREFIX-%05d-of-%05d.gguf.
std::string split_part_path(const std::string & prefix, uint32_t index, uint32_t n_parts);

// Tensor names in manifest lines: bytes outside '!'..'~' and '%' itself become %XX.
std::string manifest_encode_name(const std::string & name);

struct ArtifactIdentity {
    std::string architecture;
    bool slice = false;           // a dgr slice: the ids below are its source's (dgr.slice.*)
    std::string artifact_id;
    std::string tokenizer_digest;
    std::string metadata_digest;  // whole artifacts only
    std::string manifest_text;    // whole artifacts: computed; slices: the embedded source manifest
    std::string weight_types_digest;
    uint64_t tensor_bytes = 0;    // bytes hashed (whole artifacts)
    uint32_t n_parts = 1;         // files of a split set (docs/identity.md "Split GGUF sets")
    std::string model_path;       // what llama.cpp is given: the file, or part 1 of a set
};

using IdentityLog = std::function<void(const std::string &)>;

// dgr.identity.identify(path) for a whole artifact, one file or a split set given by part 1
// (hashes every tensor's bytes of every part; `log`, if set, is told once before hashing starts); for a slice, the source artifact id and tokenizer digest
// read from its dgr.slice.* pairs (as dgr.recipe.recipe_for does; nothing is hashed).
bool identify_artifact(const std::string & path, ArtifactIdentity * out, std::string * error,
                       const IdentityLog & log = nullptr);

struct LocalRecipe {
    ArtifactIdentity identity;
    RecipeFingerprintFields fields;
    std::string fingerprint;
    std::string recipe_json;
};

// dgr.recipe.recipe_for(path, backend=build backend) with the default dtypes/layout and the pin
// commit + patch digest of this build (dgr::build_info()). false + *error if the file cannot be
// read, the architecture has no dgr adapter (fail closed) or a value is not canonical.
bool local_recipe_for(const std::string & path, LocalRecipe * out, std::string * error,
                      const IdentityLog & log = nullptr);

}  // namespace dgr
