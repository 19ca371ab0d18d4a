// The strict GGUF header reader (GgufHeader) and the identity computed from it (artifact id,
// manifest, tokenizer digest, local recipe), as docs/identity.md defines them.
// Over 500 lines on purpose: the reader's invariants (bounds, UTF-8, dimension and size checks)
// and the only code that relies on them sit side by side; the fuzz test drives both together.
#include "common/identity.h"

#include "common/sha256.h"
#include "common/slice_verify.h"
#include "version.h"

#include "ggml.h"

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
    return kv_digest("dgr-gguf-metadata/v1\n", [](const std::string & k) { return k.rfind(kSlicePrefix, 0) != 0; });
}

std::string GgufHeader::tokenizer_digest() const {
    return kv_digest("dgr-gguf-tokenizer/v1\n", [](const std::string & k) { return k.rfind("tokenizer.", 0) == 0; });
}

bool GgufHeader::is_slice() const {
    auto it = pairs_.lower_bound(kSlicePrefix);
    return it != pairs_.end() && it->first.rfind(kSlicePrefix, 0) == 0;
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
    GgufHeader g;
    if (!g.open(path, error)) return false;
    *out = ArtifactIdentity{};
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
    std::vector<const GgufTensor *> ts;
    for (const GgufTensor & t : g.tensors()) {
        ts.push_back(&t);
        out->tensor_bytes += t.n_bytes;
    }
    std::sort(ts.begin(), ts.end(), [](const GgufTensor * a, const GgufTensor * b) { return a->name < b->name; });
    if (log) {
        char buf[64];
        std::snprintf(buf, sizeof buf, " (%.0f MiB)", (double) out->tensor_bytes / 1048576.0);
        log("computing the artifact identity of " + path + buf + "...");
    }
    std::string text = std::string(kManifestHeader) + "\nmetadata " + out->metadata_digest + "\ntensors " +
                       std::to_string(ts.size()) + "\n";
    Sha256 wt;
    wt.update("dgr-weight-types/v1\n");
    const std::vector<std::string> digests = tensor_sha256s(g, ts);  // every core
    for (size_t i = 0; i < ts.size(); ++i) {
        const GgufTensor * t = ts[i];
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
