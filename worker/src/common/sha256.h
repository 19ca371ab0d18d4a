// SHA-256 through OpenSSL's EVP interface: used for the recipe compatibility fingerprint and
// artifact identity checks (docs/identity.md).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

typedef struct evp_md_ctx_st EVP_MD_CTX;

namespace dgr {

class Sha256 {
public:
    Sha256();
    ~Sha256();
    Sha256(Sha256 &&) noexcept;
    Sha256 & operator=(Sha256 &&) noexcept;
    void update(const void * data, size_t len);
    void update(std::string_view s) { update(s.data(), s.size()); }
    std::array<uint8_t, 32> finish();  // the object must not be updated afterwards

private:
    EVP_MD_CTX * ctx_ = nullptr;
};

std::string to_hex(const uint8_t * data, size_t len);
std::string sha256_hex(std::string_view data);

}  // namespace dgr
