#include "common/sha256.h"

#include <openssl/evp.h>

#include <cstdlib>
#include <cstdio>
#include <utility>

namespace dgr {

namespace {
[[noreturn]] void die(const char * what) {
    // Only reachable when OpenSSL cannot allocate a digest context: nothing sensible to do.
    std::fprintf(stderr, "dgr: OpenSSL SHA-256 failed: %s\n", what);
    std::abort();
}
}  // namespace

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
    if (!ctx_ || EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr) != 1) die("init");
}

Sha256::~Sha256() { EVP_MD_CTX_free(ctx_); }

Sha256::Sha256(Sha256 && o) noexcept : ctx_(std::exchange(o.ctx_, nullptr)) {}

Sha256 & Sha256::operator=(Sha256 && o) noexcept {
    std::swap(ctx_, o.ctx_);
    return *this;
}

void Sha256::update(const void * data, size_t len) {
    if (len && EVP_DigestUpdate(ctx_, data, len) != 1) die("update");
}

std::array<uint8_t, 32> Sha256::finish() {
    std::array<uint8_t, 32> out{};
    unsigned int n = 0;
    if (EVP_DigestFinal_ex(ctx_, out.data(), &n) != 1 || n != out.size()) die("final");
    return out;
}

std::string to_hex(const uint8_t * data, size_t len) {
    static const char * digits = "0123456789abcdef";
    std::string s(len * 2, '0');
    for (size_t i = 0; i < len; ++i) {
        s[2 * i] = digits[data[i] >> 4];
        s[2 * i + 1] = digits[data[i] & 15];
    }
    return s;
}

std::string sha256_hex(std::string_view data) {
    Sha256 h;
    h.update(data);
    const auto d = h.finish();
    return to_hex(d.data(), d.size());
}

}  // namespace dgr
