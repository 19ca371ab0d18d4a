#include "common/checksum.h"

#include <zlib.h>

#include <algorithm>

namespace dgr {

uint32_t crc32(const void * data, size_t size, uint32_t crc) {
    // zlib's braided CRC. Measured on the 2-core development machine (loaded, 1 MiB buffers, -O2):
    // 7-9x the throughput of the byte-table loop this replaced, same values. crc32_z takes a
    // size_t length.
    if (size == 0) return crc;
    return (uint32_t) ::crc32_z(crc, static_cast<const Bytef *>(data), size);
}

uint64_t fnv1a64(const void * data, size_t size, uint64_t h) {
    const auto * p = static_cast<const unsigned char *>(data);
    for (size_t i = 0; i < size; ++i) {
        h ^= p[i];
        h *= 1099511628211ULL;
    }
    return h;
}

} // namespace dgr
