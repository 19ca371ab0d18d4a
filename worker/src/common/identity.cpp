// The strict GGUF header reader (GgufHeader) and the identity computed from it (artifact id,
// manifest, tokenizer digest, local recipe), as docs/identity.md defines them.
// Over 500 lines on purpose: the reader's invariants (bounds, UTF-8, dimension and size checks)
// and the only code that relies on them sit side by side; the fuzz test drives both together.
#include "common/identity.h"

#include "common/sha256.h"
#include "common/slice_verify.h"
#include "version.h"

#include "ggml.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <set>

namespace dgr {

namespace {

constexpr uint32_t T_UINT8 = 0, T_INT8 = 1, T_UINT16 = 2, T_INT16 = 3, T_UINT32 = 4, T_INT32 = 5,
                   T_FLOAT32 = 6, T_BOOL = 7, T_STRING = 8, T_ARRAY = 9, T_UINT64 = 10, T_INT64 = 11,
                   T_FLOAT64 = 12;
constexpr uint32_t kMaxDims = 4;
constexpr const char * kSlicePrefix = "dgr.slice.";
constexpr const char * kSplitPrefix = "split.";
constexpr const char * kManifestHeader = "dgr-artifact-manifest/v1";

// fixed size of a scalar value type, 0 if not a scalar
uint64_t scalar_size(uint32_t t) {
    switch (t) {
        case T_UINT8: case T_INT8: case T_BOOL: return 1;
        case T_UINT16: case T_INT16: return 2;
        case T_UINT32: case T_INT32: case T_FLOAT32: return 4;
        case T_UINT64: case T_INT64: case T_FLOAT64: return 8;
        default: return 0;
    }
}

struct Corrupt {
    std::string what;
};

// A name read from the file, for a one-line error: quoted, control bytes as \xNN, at most 120 bytes.
std::string quoted(const std::string & s) {
    std::string out = "'";
    for (size_t i = 0; i < s.size(); ++i) {
        if (out.size() > 120) {
            out += "...";
            break;
        }
        const unsigned char c = (unsigned char) s[i];
        if (c < 0x20 || c == 0x7F || c == '\\' || c == '\'') {
            char b[8];
            std::snprintf(b, sizeof b, "\\x%02x", (unsigned) c);
            out += b;
        } else {
            out += char(c);
        }
    }
    return out + "'";
}

// Bounds-checked little-endian reads over the map.
struct Cursor {
    const uint8_t * buf;
    uint64_t size;
    uint64_t pos = 0;

    void need(uint64_t n) const {
        if (n > size || pos > size - n) {
            throw Corrupt{"needs " + std::to_string(n) + " bytes at offset " + std::to_string(pos) +
                          ", the file ends at " + std::to_string(size)};
        }
    }
    uint32_t u32() {
        need(4);
        uint32_t v = 0;
        for (int i = 3; i >= 0; --i) v = (v << 8) | buf[pos + i];
        pos += 4;
        return v;
    }
    uint64_t u64() {
        need(8);
        uint64_t v = 0;
        for (int i = 7; i >= 0; --i) v = (v << 8) | buf[pos + i];
        pos += 8;
        return v;
    }
    std::string string() {
        const uint64_t n = u64();
        need(n);
        std::string s(reinterpret_cast<const char *>(buf + pos), (size_t) n);
        pos += n;
        return s;
    }
    void skip_value(uint32_t vtype, int depth = 0) {
        if (const uint64_t sz = scalar_size(vtype)) {
            need(sz);
            pos += sz;
        } else if (vtype == T_STRING) {
            const uint64_t n = u64();
            need(n);
            pos += n;
        } else if (vtype == T_ARRAY) {
            if (depth > 2) throw Corrupt{"metadata arrays nested too deeply"};
            const uint32_t itype = u32();
            const uint64_t count = u64();
            if (const uint64_t sz = scalar_size(itype)) {
                if (count > (size - std::min(pos, size)) / sz) {
                    throw Corrupt{"array at offset " + std::to_string(pos) + " runs past the end of the file"};
                }
                pos += count * sz;
            } else if (itype == T_STRING) {
                if (count > (size - std::min(pos, size)) / 8) {
                    throw Corrupt{"string array at offset " + std::to_string(pos) + " runs past the end of the file"};
                }
                for (uint64_t i = 0; i < count; ++i) {
                    const uint64_t n = u64();
                    need(n);
                    pos += n;
                }
            } else if (itype == T_ARRAY) {
                for (uint64_t i = 0; i < count; ++i) skip_value(T_ARRAY, depth + 1);
            } else {
                throw Corrupt{"unknown array element type " + std::to_string(itype)};
            }
        } else {
            throw Corrupt{"unknown metadata value type " + std::to_string(vtype)};
        }
    }
};

bool valid_utf8(const std::string & s) {
    size_t i = 0;
    const size_t n = s.size();
    while (i < n) {
        const unsigned char c = (unsigned char) s[i];
        size_t len;
        uint32_t cp;
        if (c < 0x80) { ++i; continue; }
        if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
        else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
        else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
        else return false;
        if (i + len > n) return false;
        for (size_t k = 1; k < len; ++k) {
            const unsigned char d = (unsigned char) s[i + k];
            if ((d & 0xC0) != 0x80) return false;
            cp = (cp << 6) | (d & 0x3F);
        }
        if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
            (cp >= 0xD800 && cp <= 0xDFFF)) {
            return false;
        }
        i += len;
    }
    return true;
}

std::string hex_digest(Sha256 & h) {
    const auto d = h.finish();
    return to_hex(d.data(), d.size());
}

bool is_hex64(const std::string & s) {
    if (s.size() != 64) return false;
    for (char c : s) {
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
    }
    return true;
}

// dgr.gguf_slice.ADAPTERS: (architecture -> adapter name, version)
bool adapter_for(const std::string & arch, std::string * name, int64_t * version) {
    static const char * const known[] = {"llama", "gemma3", "qwen3", "qwen3moe"};
    for (const char * k : known) {
        if (arch == k) {
            *name = arch;
            *version = 1;
            return true;
        }
    }
    return false;
}

std::string json_string(const std::string & s) {
    std::string out = "\"";
    for (const char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += c;
        } else if ((unsigned char) c < 0x20) {
            char b[8];
            std::snprintf(b, sizeof b, "\\u%04x", (unsigned) (unsigned char) c);
            out += b;
        } else {
            out += c;
        }
    }
    return out + "\"";
}

}  // namespace

GgufHeader::~GgufHeader() {
    if (base_) ::munmap(base_, (size_t) size_);
    if (fd_ >= 0) ::close(fd_);
}

bool GgufHeader::open(const std::string & path, std::string * error) {
    path_ = path;
    auto fail = [&](const std::string & why) {
        if (error) *error = why;
        return false;
    };
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) return fail("cannot read " + path + ": " + std::strerror(errno));
    struct stat st{};
    if (::fstat(fd_, &st) != 0) return fail("cannot read " + path + ": " + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) return fail(path + " is not a regular file");
    size_ = (uint64_t) st.st_size;
    if (size_ > 0) {
        void * p = ::mmap(nullptr, (size_t) size_, PROT_READ, MAP_PRIVATE, fd_, 0);
        if (p == MAP_FAILED) return fail("cannot map " + path + ": " + std::strerror(errno));
        base_ = static_cast<uint8_t *>(p);
    }
    Cursor cur{base_, size_};
    try {
        cur.need(4);
        if (std::memcmp(base_, "GGUF", 4) != 0) throw Corrupt{"GGUF magic missing"};
        cur.pos = 4;
        const uint32_t version = cur.u32();
        if (version != 2 && version != 3) {
            if ((version & 0xFFFF) == 0) throw Corrupt{"big-endian GGUF files are not supported"};
            throw Corrupt{"GGUF version " + std::to_string(version) + " is not supported (2 or 3)"};
        }
        const uint64_t n_tensors = cur.u64();
        const uint64_t n_kv = cur.u64();
        if (n_tensors > size_ / 24 || n_kv > size_ / 12) {
            throw Corrupt{"the header declares " + std::to_string(n_tensors) + " tensors and " + std::to_string(n_kv) +
                          " metadata pairs, more than a " + std::to_string(size_) + "-byte file can hold"};
        }
        for (uint64_t i = 0; i < n_kv; ++i) {
            GgufPair p;
            p.start = cur.pos;
            std::string key = cur.string();
            if (!valid_utf8(key)) throw Corrupt{"metadata key at offset " + std::to_string(p.start) + " is not UTF-8"};
            p.value_start = cur.pos;
            p.vtype = cur.u32();
            cur.skip_value(p.vtype);
            p.end = cur.pos;
            if (!pairs_.emplace(key, p).second) throw Corrupt{"duplicate metadata key " + quoted(key)};
        }
        struct Raw {
            std::string name;
            std::vector<uint64_t> dims;
            uint32_t type;
            uint64_t off;
        };
        std::vector<Raw> raw;
        raw.reserve((size_t) n_tensors);
        for (uint64_t i = 0; i < n_tensors; ++i) {
            Raw r;
            const uint64_t at = cur.pos;
            r.name = cur.string();
            if (!valid_utf8(r.name)) throw Corrupt{"tensor name at offset " + std::to_string(at) + " is not UTF-8"};
            const uint32_t n_dims = cur.u32();
            if (n_dims < 1 || n_dims > kMaxDims) {
                throw Corrupt{"tensor " + quoted(r.name) + " has " + std::to_string(n_dims) + " dimensions"};
            }
            for (uint32_t d = 0; d < n_dims; ++d) r.dims.push_back(cur.u64());
            r.type = cur.u32();
            r.off = cur.u64();
            raw.push_back(std::move(r));
        }
        alignment_ = 32;
        if (auto it = pairs_.find("general.alignment"); it != pairs_.end()) {
            uint32_t a = 0;
            if (!get_u32("general.alignment", &a) || a == 0 || (a & (a - 1))) {
                throw Corrupt{"general.alignment must be a power-of-two u32"};
            }
            alignment_ = a;
        }
        const uint64_t data_offset = (cur.pos + alignment_ - 1) / alignment_ * alignment_;
        std::set<std::string> seen;
        for (Raw & r : raw) {
            if (!seen.insert(r.name).second) throw Corrupt{"duplicate tensor " + quoted(r.name)};
            if (r.type >= (uint32_t) GGML_TYPE_COUNT || ggml_blck_size((ggml_type) r.type) <= 0 ||
                ggml_type_size((ggml_type) r.type) == 0) {
                throw Corrupt{"tensor " + quoted(r.name) + " has unknown ggml type " + std::to_string(r.type)};
            }
            // ggml holds dimensions and element counts as int64: refuse a zero dimension, one that
            // is negative as int64 and a count that overflows it (as Python's dgr.gguf does)
            uint64_t n_el = 1;
            for (size_t d = 0; d < r.dims.size(); ++d) {
                const std::string ne = "ne" + std::to_string(d) + " = " + std::to_string(r.dims[d]);
                if (r.dims[d] == 0) throw Corrupt{"tensor " + quoted(r.name) + " has a zero dimension (" + ne + ")"};
                if (r.dims[d] > (uint64_t) INT64_MAX) {
                    throw Corrupt{"tensor " + quoted(r.name) + " dimension " + ne + " is negative as a signed 64-bit count"};
                }
                if (__builtin_mul_overflow(n_el, r.dims[d], &n_el) || n_el > (uint64_t) INT64_MAX) {
                    throw Corrupt{"tensor " + quoted(r.name) + ": the element count overflows 64 bits"};
                }
            }
            const uint64_t block = (uint64_t) ggml_blck_size((ggml_type) r.type);
            if (r.dims[0] % block) {
                throw Corrupt{"tensor " + quoted(r.name) + ": ne0 " + std::to_string(r.dims[0]) +
                              " is not a multiple of the block size " + std::to_string(block)};
            }
            // ggml_row_size(type, ne0) * ne1 * ne2 * ne3, overflow-checked
            uint64_t n_bytes = 0;
            bool overflow = __builtin_mul_overflow(r.dims[0] / block, (uint64_t) ggml_type_size((ggml_type) r.type), &n_bytes);
            for (size_t d = 1; d < r.dims.size(); ++d) overflow |= __builtin_mul_overflow(n_bytes, r.dims[d], &n_bytes);
            if (overflow) throw Corrupt{"tensor " + quoted(r.name) + " is too large"};
            if (r.off % alignment_) {
                throw Corrupt{"tensor " + quoted(r.name) + " data offset " + std::to_string(r.off) + " is not aligned to " +
                              std::to_string(alignment_)};
            }
            uint64_t start = 0, end = 0;
            if (__builtin_add_overflow(data_offset, r.off, &start) || __builtin_add_overflow(start, n_bytes, &end) ||
                end > size_) {
                throw Corrupt{"tensor " + quoted(r.name) + " ends past the end of the file (" + std::to_string(size_) +
                              " bytes)"};
            }
            tensors_.push_back(GgufTensor{std::move(r.name), r.type, std::move(r.dims), start, n_bytes});
        }
    } catch (const Corrupt & c) {
        return fail(path + " is not a readable GGUF file, truncated or corrupt (" + c.what + ")");
    }
    if (base_) ::madvise(base_, (size_t) size_, MADV_SEQUENTIAL);
    return true;
}

bool GgufHeader::get_string(const std::string & key, std::string * out) const {
    auto it = pairs_.find(key);
    if (it == pairs_.end() || it->second.vtype != T_STRING) return false;
    Cursor cur{base_, size_, it->second.value_start + 4};
    *out = cur.string();
    return true;
}

bool GgufHeader::get_u32(const std::string & key, uint32_t * out) const {
    auto it = pairs_.find(key);
    if (it == pairs_.end() || it->second.vtype != T_UINT32) return false;
    Cursor cur{base_, size_, it->second.value_start + 4};
    *out = cur.u32();
    return true;
}

bool GgufHeader::get_u16(const std::string & key, uint16_t * out) const {
    auto it = pairs_.find(key);
    if (it == pairs_.end() || it->second.vtype != T_UINT16) return false;
    const uint8_t * p = base_ + it->second.value_start + 4;
    *out = (uint16_t) (p[0] | (p[1] << 8));
    return true;
}

bool GgufHeader::get_i32(const std::string & key, int32_t * out) const {
    auto it = pairs_.find(key);
    if (it == pairs_.end() || it->second.vtype != T_INT32) return false;
    Cursor cur{base_, size_, it->second.value_start + 4};
    *out = (int32_t) cur.u32();
    return true;
}

std::string GgufHeader::kv_digest(const std::string & domain,
                                  const std::function<bool(const std::string &)> & keep) const {
    Sha256 h;
    h.update(domain);
    for (const auto & [key, p] : pairs_) {  // std::map<std::string>: sorted by key bytes
        if (keep(key)) h.update(base_ + p.start, (size_t) (p.end - p.start));
    }
    return hex_digest(h);
}

std::string GgufHeader::metadata_digest() const {
    // split.* says how the artifact is cut into files, not what it is: a split set and the same
    // model in one file have one metadata digest (docs/identity.md "Split GGUF sets")
    return kv_digest("dgr-gguf-metadata/v1\n", [](const std::string & k) {
        return k.rfind(kSlicePrefix, 0) != 0 && k.rfind(kSplitPrefix, 0) != 0;
    });
}

std::string GgufHeader::tokenizer_digest() const {
    return kv_digest("dgr-gguf-tokenizer/v1\n", [](const std::string & k) { return k.rfind("tokenizer.", 0) == 0; });
}

bool GgufHeader::is_slice() const {
    auto it = pairs_.lower_bound(kSlicePrefix);
    return it != pairs_.end() && it->first.rfind(kSlicePrefix, 0) == 0;
}

std::string split_part_path(const std::string & prefix, uint32_t index, uint32_t n_parts) {
    char tail[40];
    std::snprintf(tail, sizeof tail, "-%05u-of-%05u.gguf", index + 1, n_parts);
    return prefix + tail;
}

namespace {

// "-NNNNN-of-MMMMM.gguf" at the end of a file name: the 1-based part number and the count
bool parse_split_tail(const std::string & name, std::string * prefix, uint32_t * number, uint32_t * count) {
    constexpr size_t kTail = 20;  // "-00001-of-00003.gguf"
    if (name.size() <= kTail) return false;
    const std::string t = name.substr(name.size() - kTail);
    unsigned a = 0, b = 0;
    char rest[8] = {0};
    if (t[0] != '-' || t.compare(6, 4, "-of-") != 0 || t.compare(15, 5, ".gguf") != 0) return false;
    for (size_t i : {1, 2, 3, 4, 5, 10, 11, 12, 13, 14}) {
        if (t[i] < '0' || t[i] > '9') return false;
    }
    if (std::sscanf(t.c_str(), "-%5u-of-%5u%7s", &a, &b, rest) != 3) return false;
    *prefix = name.substr(0, name.size() - kTail);
    *number = a;
    *count = b;
    return true;
}

}  // namespace

uint64_t GgufSet::file_bytes() const {
    uint64_t n = 0;
    for (const auto & p : parts_) n += p->size();
    return n;
}

bool GgufSet::open(const std::string & path, std::string * error) {
    path_ = path;
    parts_.clear();
    tensors_.clear();
    auto fail = [&](const std::string & why) {
        if (error) *error = why;
        return false;
    };
    parts_.push_back(std::make_unique<GgufHeader>());
    if (!parts_[0]->open(path, error)) return false;
    const GgufHeader & g0 = *parts_[0];
    const std::string::size_type slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
    const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
    std::string prefix;
    uint32_t number = 0, named_count = 0;
    const bool named_as_part = parse_split_tail(base, &prefix, &number, &named_count);
    uint16_t count = 0, no = 0;
    if (g0.has("split.count") && !g0.get_u16("split.count", &count)) {
        return fail(path + ": split.count must be a u16 (a split GGUF set's part)");
    }
    if (count <= 1) {
        // one file (llama-gguf-split --merge writes split.count 0); a name that says part k of
        // M >= 2 without split.count is a renamed file, not a part
        if (named_as_part && named_count >= 2 && !g0.has("split.count")) {
            return fail(path + " is named as part " + std::to_string(number) + " of " + std::to_string(named_count) +
                        " of a split GGUF set but has no split.count pair");
        }
        for (size_t i = 0; i < g0.tensors().size(); ++i) tensors_.push_back(TensorRef{&g0, &g0.tensors()[i], 0});
        return true;
    }
    if (!g0.get_u16("split.no", &no) || no >= count) {
        return fail(path + ": split.no is missing, not a u16 or not below split.count " + std::to_string(count));
    }
    if (!named_as_part || number != (uint32_t) no + 1 || named_count != count) {
        return fail(path + ": part " + std::to_string(no + 1) + " of a " + std::to_string(count) +
                    "-part split GGUF set (split.no " + std::to_string(no) + ") must be named PREFIX" +
                    split_part_path("", no, count) + " so that the other parts can be found");
    }
    if (no != 0) {
        // any part names the set; the set is opened (and handed to llama.cpp) from part 1
        const std::string first = split_part_path(dir + prefix, 0, count);
        struct stat st{};
        if (::stat(first.c_str(), &st) != 0) {
            return fail("split GGUF set " + dir + prefix + ": part 1 of " + std::to_string(count) + " (" + first +
                        ") is missing");
        }
        return open(first, error);
    }
    if (g0.is_slice()) return fail(path + ": a dgr slice is one file, never a split set");
    int32_t total = 0;
    if (!g0.get_i32("split.tensors.count", &total) || total < 0) {
        return fail(path + ": split.tensors.count (i32) is missing from part 1 of the split set");
    }
    const std::string set_name = dir + prefix + "-*-of-" + split_part_path("", 0, count).substr(10);
    for (uint32_t i = 1; i < count; ++i) {
        const std::string pp = split_part_path(dir + prefix, i, count);
        struct stat st{};
        if (::stat(pp.c_str(), &st) != 0) {
            return fail("split GGUF set " + set_name + ": part " + std::to_string(i + 1) + " of " +
                        std::to_string(count) + " (" + pp + ") is missing");
        }
        parts_.push_back(std::make_unique<GgufHeader>());
        std::string why;
        if (!parts_.back()->open(pp, &why)) {
            return fail("split GGUF set " + set_name + ": part " + std::to_string(i + 1) + " of " +
                        std::to_string(count) + ": " + why);
        }
        const GgufHeader & g = *parts_.back();
        uint16_t c = 0, n = 0;
        int32_t t = 0;
        if (!g.get_u16("split.count", &c) || !g.get_u16("split.no", &n) || !g.get_i32("split.tensors.count", &t)) {
            return fail("split GGUF set " + set_name + ": part " + pp +
                        " lacks split.no/split.count (u16) or split.tensors.count (i32): not a part of this set");
        }
        if (c != count || t != total) {
            return fail("split GGUF set " + set_name + ": part " + pp + " says split.count " + std::to_string(c) +
                        ", split.tensors.count " + std::to_string(t) + "; part 1 says " + std::to_string(count) +
                        ", " + std::to_string(total) + " (a part of another set)");
        }
        if (n != i) {
            return fail("split GGUF set " + set_name + ": part " + pp + " holds split.no " + std::to_string(n) +
                        " (part " + std::to_string(n + 1) + "), expected " + std::to_string(i) +
                        ": the parts are reordered or renamed");
        }
        // only part 1 carries metadata: what another part says would be unchecked by the identity
        for (const auto & [key, pair] : g.pairs()) {
            if (key.rfind(kSplitPrefix, 0) != 0 && key != "general.alignment") {
                return fail("split GGUF set " + set_name + ": part " + pp + " holds metadata pair " + quoted(key) +
                            "; only part 1 carries metadata");
            }
        }
    }
    // an extra part: another file of the same prefix with a part number or count outside the set
    if (DIR * d = ::opendir(dir.empty() ? "." : dir.c_str())) {
        std::string extra;
        while (const dirent * e = ::readdir(d)) {
            std::string p2;
            uint32_t num = 0, cnt = 0;
            if (parse_split_tail(e->d_name, &p2, &num, &cnt) && p2 == prefix && (cnt != count || num == 0 || num > count)) {
                extra = dir + e->d_name;
                break;
            }
        }
        ::closedir(d);
        if (!extra.empty()) {
            return fail("split GGUF set " + set_name + ": extra part " + extra + " next to the set's " +
                        std::to_string(count) + " parts; remove it or keep each set in its own directory");
        }
    }
    std::map<std::string, size_t> owner;
    for (size_t i = 0; i < parts_.size(); ++i) {
        for (const GgufTensor & t : parts_[i]->tensors()) {
            auto [it, fresh] = owner.emplace(t.name, i);
            if (!fresh) {
                return fail("split GGUF set " + set_name + ": tensor " + quoted(t.name) + " is in part " +
                            parts_[it->second]->path() + " and in part " + parts_[i]->path());
            }
            tensors_.push_back(TensorRef{parts_[i].get(), &t, i});
        }
    }
    if (tensors_.size() != (size_t) total) {
        return fail("split GGUF set " + set_name + ": the parts hold " + std::to_string(tensors_.size()) +
                    " tensors, split.tensors.count says " + std::to_string(total));
    }
    return true;
}

std::string manifest_encode_name(const std::string & name) {
    static const char * hex = "0123456789ABCDEF";
    std::string out;
    for (const char ch : name) {
        const unsigned char b = (unsigned char) ch;
        if (b >= 0x21 && b <= 0x7E && b != 0x25) {
            out += ch;
        } else {
            out += '%';
            out += hex[b >> 4];
            out += hex[b & 15];
        }
    }
    return out;
}

bool identify_artifact(const std::string & path, ArtifactIdentity * out, std::string * error, const IdentityLog & log) {
    GgufSet set;
    if (!set.open(path, error)) return false;
    const GgufHeader & g = set.first();
    *out = ArtifactIdentity{};
    out->n_parts = (uint32_t) set.n_parts();
    out->model_path = set.path();
    if (!g.get_string("general.architecture", &out->architecture) || out->architecture.empty()) {
        if (error) *error = path + ": general.architecture is missing; not a model GGUF";
        return false;
    }
    if (g.is_slice()) {
        // dgr.recipe.recipe_for: a slice serves its source's identity (docs/identity.md "Slices")
        uint32_t version = 0;
        if (!g.get_u32("dgr.slice.version", &version) || version != 1) {
            if (error) *error = path + ": dgr slice format version is missing or not supported (want 1)";
            return false;
        }
        out->slice = true;
        for (const auto & [key, dest] : {std::pair<const char *, std::string *>{"dgr.slice.source_artifact_id", &out->artifact_id},
                                         {"dgr.slice.source_tokenizer_digest", &out->tokenizer_digest},
                                         {"dgr.slice.source_manifest", &out->manifest_text}}) {
            if (!g.get_string(key, dest)) {
                if (error) *error = path + ": slice metadata " + key + " is missing or has the wrong type";
                return false;
            }
        }
        // weight types from the embedded source manifest: "tensor NAME TYPE SHAPE NBYTES SHA256"
        Sha256 wt;
        wt.update("dgr-weight-types/v1\n");
        size_t pos = 0;
        int line_no = 0;
        const std::string & m = out->manifest_text;
        while (pos < m.size()) {
            size_t nl = m.find('\n', pos);
            if (nl == std::string::npos) nl = m.size();
            const std::string line = m.substr(pos, nl - pos);
            pos = nl + 1;
            if (line_no++ < 3) continue;
            const size_t a = line.find(' '), b = a == std::string::npos ? a : line.find(' ', a + 1),
                         c = b == std::string::npos ? b : line.find(' ', b + 1);
            if (line.rfind("tensor ", 0) != 0 || c == std::string::npos) {
                if (error) *error = path + ": the embedded source manifest has a malformed line";
                return false;
            }
            wt.update(line.substr(a + 1, c - a - 1) + "\n");
        }
        out->weight_types_digest = hex_digest(wt);
        // the ids are the slice's own claim: prove them (every tensor's bytes against the
        // manifest it carries) before anything is served under them
        if (log) {
            uint64_t bytes = 0;
            for (const GgufTensor & t : g.tensors()) bytes += t.n_bytes;
            char buf[64];
            std::snprintf(buf, sizeof buf, " (%.0f MiB)", (double) bytes / 1048576.0);
            log("verifying slice " + path + buf + " against its embedded manifest...");
        }
        SliceVerdict v;
        if (!verify_slice(g, &v, error)) return false;
        out->tensor_bytes = v.bytes_hashed;
        return true;
    }
    out->metadata_digest = g.metadata_digest();
    out->tokenizer_digest = g.tokenizer_digest();
    // every tensor of every part: a split set has the id of the same model in one file
    std::vector<TensorRef> ts = set.tensors();
    for (const TensorRef & t : ts) out->tensor_bytes += t.tensor->n_bytes;
    std::sort(ts.begin(), ts.end(), [](const TensorRef & a, const TensorRef & b) { return a.tensor->name < b.tensor->name; });
    if (log) {
        char buf[96];
        std::snprintf(buf, sizeof buf, " (%.0f MiB", (double) out->tensor_bytes / 1048576.0);
        std::string what = buf;
        if (set.is_split()) what += " in " + std::to_string(set.n_parts()) + " parts";
        log("computing the artifact identity of " + path + what + ")...");
    }
    std::string text = std::string(kManifestHeader) + "\nmetadata " + out->metadata_digest + "\ntensors " +
                       std::to_string(ts.size()) + "\n";
    Sha256 wt;
    wt.update("dgr-weight-types/v1\n");
    const std::vector<std::string> digests = tensor_sha256s(ts);  // every core
    for (size_t i = 0; i < ts.size(); ++i) {
        const GgufTensor * t = ts[i].tensor;
        text += manifest_line(*t, digests[i]) + "\n";
        wt.update(manifest_encode_name(t->name) + " " + std::to_string(t->ggml_type) + "\n");
    }
    out->manifest_text = std::move(text);
    out->artifact_id = sha256_hex(out->manifest_text);
    out->weight_types_digest = hex_digest(wt);
    return true;
}

bool local_recipe_for(const std::string & path, LocalRecipe * out, std::string * error, const IdentityLog & log) {
    *out = LocalRecipe{};
    if (!identify_artifact(path, &out->identity, error, log)) return false;
    const ArtifactIdentity & id = out->identity;
    if (!is_hex64(id.artifact_id) || !is_hex64(id.tokenizer_digest)) {
        if (error) *error = path + ": the artifact id or tokenizer digest is not 64 lowercase hex digits";
        return false;
    }
    RecipeFingerprintFields & f = out->fields;
    if (!adapter_for(id.architecture, &f.arch_adapter, &f.arch_adapter_version)) {
        if (error) {
            *error = path + ": architecture " + quoted(id.architecture) +
                     " has no dgr adapter; unsupported architectures fail closed (supported: llama, gemma3, qwen3, qwen3moe)";
        }
        return false;
    }
    // defaults of dgr.recipe.recipe_for
    const BuildInfo & bi = build_info();
    f.activation_dtype = "f32";
    f.artifact_id = id.artifact_id;
    f.backends = bi.backend;           // a route of this build's backend alone
    f.boundary_schema_version = 1;
    f.kv_dtype = "f16";
    f.kv_layout = "llama-unified-layer-filtered";
    f.patch_digest = bi.patch_digest;
    f.pin_commit = bi.pin_commit;
    f.tokenizer_digest = id.tokenizer_digest;
    std::string why;
    if (!recipe_fingerprint(f, &out->fingerprint, &why)) {
        if (error) *error = "cannot compute the recipe fingerprint of " + path + ": " + why;
        return false;
    }
    // The recipe fields (those of dgr.recipe.RuntimeRecipe.to_json() but the weight_types
    // summary) plus "fingerprint" and "identity"; it is NOT byte-for-byte Python's to_json()
    // (key order, summary and the "identity" marker differ): only the fingerprint is canonical.
    std::string j = "{";
    auto add = [&](const std::string & k, const std::string & v, bool str = true) {
        if (j.size() > 1) j += ",";
        j += json_string(k) + ":" + (str ? json_string(v) : v);
    };
    add("artifact_id", f.artifact_id);
    add("tokenizer_digest", f.tokenizer_digest);
    add("arch_adapter", f.arch_adapter);
    add("arch_adapter_version", std::to_string(f.arch_adapter_version), false);
    add("weight_types_digest", id.weight_types_digest);
    add("activation_dtype", f.activation_dtype);
    add("compute_dtype", "f32");
    add("kv_dtype", f.kv_dtype);
    add("kv_layout", f.kv_layout);
    add("backend", bi.backend);
    add("backends", f.backends);
    add("dgr_version", bi.dgr_version);
    add("pin_commit", f.pin_commit);
    add("patch_digest", f.patch_digest);
    add("boundary_schema_version", std::to_string(f.boundary_schema_version), false);
    add("fingerprint", out->fingerprint);
    add("identity", "computed-by-worker");
    out->recipe_json = j + "}";
    return true;
}

}  // namespace dgr
