// The worker's one CRC-32 and one non-cryptographic hash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace dgr {

// CRC-32/IEEE as the shard protocol's CHECKSUM_ALGORITHM_CRC32 (proto/dgr/shard/v1): zlib's
// crc32() (the value of Python's zlib.crc32). Chainable: crc32(b, nb, crc32(a, na)) ==
// crc32(a || b).
uint32_t crc32(const void * data, size_t size, uint32_t crc = 0);

// FNV-1a 64-bit over bytes, continuing from `h`: short stable ids (fake model identity, a
// llama worker's "unverified-…" fingerprint). Never for integrity or security.
constexpr uint64_t kFnv1aOffset = 1469598103934665603ULL;
uint64_t fnv1a64(const void * data, size_t size, uint64_t h = kFnv1aOffset);
inline uint64_t fnv1a64_text(std::string_view s, uint64_t h = kFnv1aOffset) { return fnv1a64(s.data(), s.size(), h); }

} // namespace dgr
