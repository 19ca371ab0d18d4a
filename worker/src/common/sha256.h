// SHA-256 (FIPS 180-4), small and self-contained: used for the recipe compatibility
// fingerprint and artifact identity checks. Not constant-time; never use it for secrets.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dgr {

class Sha256 {
public:
    Sha256();
    void update(const void * data, size_t len);
    void update(std::string_view s) { update(s.data(), s.size()); }
    std::array<uint8_t, 32> finish();  // the object must not be updated afterwards

private:
    void block(const uint8_t * p);
    uint32_t h_[8];
    uint8_t buf_[64];
    size_t buf_len_ = 0;
    uint64_t total_ = 0;
};

std::string to_hex(const uint8_t * data, size_t len);
std::string sha256_hex(std::string_view data);

}  // namespace dgr
