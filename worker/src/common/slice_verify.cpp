#include "common/slice_verify.h"

#include "common/sha256.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <set>
#include <thread>

#include <sys/mman.h>
#include <unistd.h>

namespace dgr {

namespace {

constexpr uint32_t kTypeU32 = 4, kTypeBool = 7, kTypeString = 8, kTypeArray = 9;

bool read_u32(const GgufHeader & g, uint64_t at, uint32_t * v) {
    if (at + 4 > g.size()) return false;
    std::memcpy(v, g.data() + at, 4);
    return true;
}

bool read_u64(const GgufHeader & g, uint64_t at, uint64_t * v) {
    if (at + 8 > g.size()) return false;
    std::memcpy(v, g.data() + at, 8);
    return true;
}

bool get_bool(const GgufHeader & g, const std::string & key, bool * out) {
    auto it = g.pairs().find(key);
    if (it == g.pairs().end() || it->second.vtype != kTypeBool || it->second.end <= it->second.value_start + 4) {
        return false;
    }
    *out = g.data()[it->second.value_start + 4] != 0;
    return true;
}

}  // namespace

std::vector<std::string> tensor_sha256s(const GgufHeader & g, const std::vector<const GgufTensor *> & ts,
                                        unsigned threads) {
    std::vector<TensorRef> refs;
    refs.reserve(ts.size());
    for (const GgufTensor * t : ts) refs.push_back(TensorRef{&g, t, 0});
    return tensor_sha256s(refs, threads);
}

std::vector<std::string> tensor_sha256s(const std::vector<TensorRef> & ts, unsigned threads) {
    std::vector<std::string> out(ts.size());
    if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
    threads = std::min<unsigned>(threads, (unsigned) std::max<size_t>(1, ts.size()));
    // largest first, so that one big tensor does not start last
    std::vector<size_t> order(ts.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ts[a].tensor->n_bytes > ts[b].tensor->n_bytes; });
    const uint64_t page = (uint64_t) ::sysconf(_SC_PAGESIZE);
    std::atomic<size_t> next{0};
    auto work = [&] {
        for (size_t k; (k = next.fetch_add(1)) < order.size();) {
            const GgufHeader & g = *ts[order[k]].part;
            const GgufTensor * t = ts[order[k]].tensor;
            Sha256 h;
            constexpr uint64_t kChunk = 16u << 20;
            for (uint64_t off = 0; off < t->n_bytes; off += kChunk) {
                const uint64_t n = std::min(kChunk, t->n_bytes - off);
                h.update(g.data() + t->offset + off, (size_t) n);
                // whole pages inside this chunk (a page shared with a neighbour may refault: harmless)
                const uint64_t a = (t->offset + off + page - 1) / page * page, b = (t->offset + off + n) / page * page;
                if (b > a) ::madvise(const_cast<uint8_t *>(g.data()) + a, (size_t) (b - a), MADV_DONTNEED);
            }
            const auto d = h.finish();
            out[order[k]] = to_hex(d.data(), d.size());
        }
    };
    std::vector<std::thread> pool;
    for (unsigned i = 1; i < threads; ++i) pool.emplace_back(work);
    work();
    for (auto & th : pool) th.join();
    return out;
}

std::string manifest_line(const GgufTensor & t, const std::string & sha256) {
    std::string shape;
    for (size_t d = 0; d < t.dims.size(); ++d) shape += (d ? "x" : "") + std::to_string(t.dims[d]);
    return "tensor " + manifest_encode_name(t.name) + " " + std::to_string(t.ggml_type) + " " + shape + " " +
           std::to_string(t.n_bytes) + " " + sha256;
}

bool get_string_array(const GgufHeader & g, const std::string & key, std::vector<std::string> * out) {
    auto it = g.pairs().find(key);
    if (it == g.pairs().end() || it->second.vtype != kTypeArray) return false;
    uint64_t at = it->second.value_start + 4;
    uint32_t elem = 0;
    uint64_t n = 0;
    if (!read_u32(g, at, &elem) || elem != kTypeString || !read_u64(g, at + 4, &n)) return false;
    at += 12;
    out->clear();
    for (uint64_t i = 0; i < n; ++i) {
        uint64_t len = 0;
        if (!read_u64(g, at, &len) || len > it->second.end - at - 8) return false;  // the reader bounded the pair
        out->emplace_back(reinterpret_cast<const char *>(g.data() + at + 8), (size_t) len);
        at += 8 + len;
    }
    return at == it->second.end;
}

bool verify_slice(const GgufHeader & g, SliceVerdict * verdict, std::string * error, unsigned threads) {
    auto fail = [&](const std::string & why) {
        if (error) *error = "slice " + g.path() + " fails verification: " + why;
        return false;
    };
    std::string source_id, source_meta, source_tok, manifest;
    for (const auto & [key, dest] : {std::pair<const char *, std::string *>{"dgr.slice.source_artifact_id", &source_id},
                                     {"dgr.slice.source_metadata_digest", &source_meta},
                                     {"dgr.slice.source_tokenizer_digest", &source_tok},
                                     {"dgr.slice.source_manifest", &manifest}}) {
        if (!g.get_string(key, dest)) return fail(std::string(key) + " is missing or has the wrong type");
    }
    // 1. the embedded source manifest is the one the source artifact id names
    const std::string manifest_id = sha256_hex(manifest);
    if (manifest_id != source_id) {
        return fail("the embedded source manifest hashes to " + manifest_id + ", the slice names source " + source_id);
    }
    // 2. the copied pairs reproduce the source's digests
    const std::string meta_line = "metadata " + source_meta + "\n";
    if (manifest.find("\n" + meta_line) == std::string::npos) {
        return fail("dgr.slice.source_metadata_digest " + source_meta + " is not the embedded manifest's");
    }
    if (g.metadata_digest() != source_meta) {
        return fail("metadata pair(s) changed: metadata digest " + g.metadata_digest() + " != source " + source_meta);
    }
    if (g.tokenizer_digest() != source_tok) {
        return fail("tokenizer pair(s) changed: tokenizer digest " + g.tokenizer_digest() + " != source " + source_tok);
    }
    // 3. the range
    uint32_t start = 0, end = 0, n_layer = 0;
    bool head = false, tail = false;
    if (!g.get_u32("dgr.slice.layer_start", &start) || !g.get_u32("dgr.slice.layer_end", &end) ||
        !g.get_u32("dgr.slice.n_layer", &n_layer) || !get_bool(g, "dgr.slice.head", &head) ||
        !get_bool(g, "dgr.slice.tail", &tail)) {
        return fail("the dgr.slice range pairs are missing or have the wrong type");
    }
    if (!(start < end && end <= n_layer) || head != (start == 0) || tail != (end == n_layer)) {
        return fail("range [" + std::to_string(start) + ", " + std::to_string(end) + ") of " + std::to_string(n_layer) +
                    " with head=" + (head ? "true" : "false") + " tail=" + (tail ? "true" : "false") +
                    " is inconsistent");
    }
    // 4. every tensor's bytes against its entry; entries exactly the file's tensors, all in the source manifest
    std::vector<std::string> entries;
    if (!get_string_array(g, "dgr.slice.tensor_entries", &entries)) {
        return fail("dgr.slice.tensor_entries is missing or has the wrong type");
    }
    std::map<std::string, std::string> entry_by_name;  // encoded name -> line
    for (const std::string & e : entries) {
        const size_t a = e.find(' '), b = a == std::string::npos ? a : e.find(' ', a + 1);
        if (e.rfind("tensor ", 0) != 0 || b == std::string::npos) return fail("malformed tensor entry '" + e + "'");
        if (!entry_by_name.emplace(e.substr(a + 1, b - a - 1), e).second) {
            return fail("tensor " + e.substr(a + 1, b - a - 1) + " is listed twice");
        }
        if (manifest.find("\n" + e + "\n") == std::string::npos) {
            return fail("tensor entry '" + e + "' is not in the source manifest");
        }
    }
    std::vector<const GgufTensor *> ts;
    uint64_t bytes = 0;
    for (const GgufTensor & t : g.tensors()) {
        if (!entry_by_name.count(manifest_encode_name(t.name))) {
            return fail("tensor " + t.name + " is not in dgr.slice.tensor_entries");
        }
        ts.push_back(&t);
        bytes += t.n_bytes;
    }
    if (ts.size() != entry_by_name.size()) {
        return fail(std::to_string(entry_by_name.size() - ts.size()) + " listed tensor(s) are missing from the file");
    }
    const std::vector<std::string> digests = tensor_sha256s(g, ts, threads);
    for (size_t i = 0; i < ts.size(); ++i) {
        const std::string got = manifest_line(*ts[i], digests[i]);
        const std::string & want = entry_by_name[manifest_encode_name(ts[i]->name)];
        if (got != want) {
            const std::string want_sha = want.substr(want.rfind(' ') + 1);
            return fail("tensor " + ts[i]->name + ": bytes hash to " + digests[i] + ", the manifest says " + want_sha +
                        (got.substr(0, got.rfind(' ')) == want.substr(0, want.rfind(' '))
                             ? std::string()
                             : " (type/shape/size also differ: '" + got + "' vs '" + want + "')"));
        }
    }
    if (verdict) {
        verdict->bytes_hashed = bytes;
        verdict->tensors = ts.size();
    }
    return true;
}

}  // namespace dgr
