// CRC-32/IEEE as the shard protocol's CHECKSUM_ALGORITHM_CRC32 (proto/dgr/shard/v1).
#pragma once

#include <cstddef>
#include <cstdint>

namespace dgr {

// Reflected polynomial 0xEDB88320, init and final xor 0xFFFFFFFF: the value of Python's
// zlib.crc32 and zlib's crc32(). Chainable: crc32(b, nb, crc32(a, na)) == crc32(a || b).
uint32_t crc32(const void * data, size_t size, uint32_t crc = 0);

} // namespace dgr
