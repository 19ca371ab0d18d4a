// Fuzzing the C++ GGUF header reader (common/identity.cpp: GgufHeader, identify_artifact,
// local_recipe_for): a libFuzzer-style entry point run by the deterministic driver in
// fuzz_driver.h (seeded; 20k inputs by default, DGR_FUZZ_INPUTS or --inputs to change).
//
// Seeds are small GGUF files built here (a whole model header with scalar, string, array and
// nested-array metadata and tensors of several ggml types and ranks; the same with
// general.alignment; a dgr slice with its dgr.slice.* pairs and embedded source manifest). The
// builder records where every structural field lies, so the structure-aware mutation can set a
// count, length, dimension, type or offset to an interesting value (zero, huge, overflowing,
// negative as int64, misaligned) beside the driver's byte-level mutations and truncations.
//
// Each input is written to one anonymous memory file (memfd) and opened by its /proc path as the worker opens its model. An
// input that opens must satisfy what the rest of the worker relies on: every dimension in
// [1, INT64_MAX], every tensor's bytes inside the file, its size the product of its dimensions
// in its type; the digests, identity and recipe then run over it. A refusal must be one line.
// Given files (a corpus, e.g. tests/test_fuzz_gguf.py's) it runs exactly those; with
// DGR_FUZZ_VERDICTS=FILE it writes "opened" or "refused" there, one line per input run, for
// comparing the C++ and Python readers.
#include "common/identity.h"

#include "ggml.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "fuzz_driver.h"

namespace {

bool g_decoded = false;
int g_fd = -1;       // the input file: an anonymous memory file (memfd), opened by path
std::string g_path;  // /proc/self/fd/N
FILE * g_verdicts = nullptr;  // DGR_FUZZ_VERDICTS: one line per input, "opened" or "refused"

// ---- a small GGUF writer that records its structural fields --------------------------------

struct FieldAt {
    size_t offset;
    int width;     // 4 or 8
    char kind;     // 'c' count, 'l' length, 'd' dimension, 'n' n_dims, 't' ggml type, 'v' value type,
                   // 'o' tensor offset, 's' a u32/u64 scalar value
};

struct Builder {
    std::string out;
    std::vector<FieldAt> fields;

    void raw(const void * p, size_t n) { out.append(static_cast<const char *>(p), n); }
    void u32(uint32_t v, char kind = 0) {
        if (kind) fields.push_back({out.size(), 4, kind});
        for (int i = 0; i < 4; ++i) out += char(uint8_t(v >> (8 * i)));
    }
    void u64(uint64_t v, char kind = 0) {
        if (kind) fields.push_back({out.size(), 8, kind});
        for (int i = 0; i < 8; ++i) out += char(uint8_t(v >> (8 * i)));
    }
    void str(const std::string & s) {
        u64(s.size(), 'l');
        out += s;
    }
    void kv_str(const std::string & k, const std::string & v) {
        str(k);
        u32(8, 'v');
        str(v);
    }
    void kv_u32(const std::string & k, uint32_t v) {
        str(k);
        u32(4, 'v');
        u32(v, 's');
    }
};

struct TensorSpec {
    std::string name;
    ggml_type type;
    std::vector<uint64_t> dims;
};

// header + metadata (by `kvs`) + tensor infos + aligned data (a byte pattern)
std::string gguf_file(uint32_t n_kv, const std::function<void(Builder &)> & kvs, const std::vector<TensorSpec> & ts,
                      uint32_t alignment, std::vector<FieldAt> * fields) {
    Builder b;
    b.raw("GGUF", 4);
    b.u32(3, 's');
    b.u64(ts.size(), 'c');
    b.u64(n_kv, 'c');
    kvs(b);
    uint64_t off = 0;
    std::vector<uint64_t> sizes;
    for (const TensorSpec & t : ts) {
        b.str(t.name);
        b.u32(uint32_t(t.dims.size()), 'n');
        uint64_t n = 1;
        for (uint64_t d : t.dims) {
            b.u64(d, 'd');
            n *= d;
        }
        b.u32(uint32_t(t.type), 't');
        b.u64(off, 'o');
        const uint64_t bytes = n / uint64_t(ggml_blck_size(t.type)) * ggml_type_size(t.type);
        sizes.push_back(bytes);
        off += (bytes + alignment - 1) / alignment * alignment;
    }
    b.out.resize((b.out.size() + alignment - 1) / alignment * alignment, '\0');
    for (size_t i = 0; i < ts.size(); ++i) {
        const size_t start = b.out.size();
        for (uint64_t k = 0; k < sizes[i]; ++k) b.out += char(uint8_t(k * 37 + i));
        b.out.resize(start + (sizes[i] + alignment - 1) / alignment * alignment, '\0');
    }
    *fields = b.fields;
    return b.out;
}

std::vector<TensorSpec> model_tensors() {
    return {{"token_embd.weight", GGML_TYPE_F32, {8, 6}},
            {"blk.0.attn_q.weight", GGML_TYPE_Q8_0, {32, 2}},
            {"blk.1.ffn_up.weight", GGML_TYPE_F16, {4, 3, 2}},
            {"blk.1.ffn_gate.weight", GGML_TYPE_Q4_K, {256, 1, 1, 1}},
            {"output_norm.weight", GGML_TYPE_F32, {8}}};
}

void model_kvs(Builder & b, bool with_alignment) {
    b.kv_str("general.architecture", "llama");
    b.kv_u32("llama.block_count", 2);
    b.kv_u32("llama.embedding_length", 8);
    // tokenizer.ggml.tokens: an array of 5 strings
    b.str("tokenizer.ggml.tokens");
    b.u32(9, 'v');
    b.u32(8, 'v');
    b.u64(5, 'c');
    for (const char * t : {"<unk>", "<s>", "</s>", "a", "\xe2\x96\x81the"}) b.str(t);
    // tokenizer.ggml.scores: f32[5]
    b.str("tokenizer.ggml.scores");
    b.u32(9, 'v');
    b.u32(6, 'v');
    b.u64(5, 'c');
    for (int i = 0; i < 5; ++i) {
        const float f = -float(i);
        b.raw(&f, 4);
    }
    // a nested array: [[u8 x3], [u8 x0]]
    b.str("general.nested");
    b.u32(9, 'v');
    b.u32(9, 'v');
    b.u64(2, 'c');
    b.u32(0, 'v');
    b.u64(3, 'c');
    b.raw("\x01\x02\x03", 3);
    b.u32(0, 'v');
    b.u64(0, 'c');
    // one of each remaining scalar type
    b.str("general.u64");
    b.u32(10, 'v');
    b.u64(1ull << 40, 's');
    b.str("general.i8");
    b.u32(1, 'v');
    b.raw("\xff", 1);
    b.str("general.f64");
    b.u32(12, 'v');
    const double d = 0.5;
    b.raw(&d, 8);
    b.str("general.bool");
    b.u32(7, 'v');
    b.raw("\x01", 1);
    b.kv_str("tokenizer.ggml.model", "llama");
    if (with_alignment) b.kv_u32("general.alignment", 64);
}

constexpr uint32_t kModelKvs = 11;  // the pairs model_kvs writes without general.alignment

std::string hex64(char c) { return std::string(64, c); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    g_decoded = false;
    if (::ftruncate(g_fd, 0) != 0 || ::pwrite(g_fd, data, size, 0) != ssize_t(size)) {
        std::perror("gguf_fuzz: writing the input file");
        std::abort();
    }

    auto one_line = [](const std::string & e) {
        if (e.empty() || e.find('\n') != std::string::npos) {
            std::fprintf(stderr, "gguf_fuzz: a refusal is not one line: '%s'\n", e.c_str());
            std::abort();
        }
    };
    std::string error;
    {
        dgr::GgufHeader g;
        const bool opened = g.open(g_path, &error);
        if (g_verdicts) std::fprintf(g_verdicts, "%s\n", opened ? "opened" : "refused");
        if (!opened) {
            one_line(error);
            return 0;
        }
        g_decoded = true;
        for (const dgr::GgufTensor & t : g.tensors()) {
            uint64_t n = 1;
            bool ok = !t.dims.empty() && t.ggml_type < uint32_t(GGML_TYPE_COUNT);
            for (uint64_t d : t.dims) ok = ok && d >= 1 && d <= uint64_t(INT64_MAX) && !__builtin_mul_overflow(n, d, &n);
            ok = ok && t.offset <= g.size() && t.n_bytes <= g.size() - t.offset;
            ok = ok && t.n_bytes == n / uint64_t(ggml_blck_size(ggml_type(t.ggml_type))) *
                                        ggml_type_size(ggml_type(t.ggml_type));
            if (!ok) {
                std::fprintf(stderr, "gguf_fuzz: accepted tensor '%s' breaks the reader's guarantees\n", t.name.c_str());
                std::abort();
            }
        }
        std::string s;
        uint32_t u = 0;
        for (const auto & [key, pair] : g.pairs()) {
            (void) g.get_string(key, &s);
            (void) g.get_u32(key, &u);
        }
        (void) g.metadata_digest();
        (void) g.tokenizer_digest();
        (void) g.is_slice();
    }
    dgr::ArtifactIdentity id;
    if (!dgr::identify_artifact(g_path, &id, &error)) one_line(error);
    dgr::LocalRecipe recipe;
    if (!dgr::local_recipe_for(g_path, &recipe, &error)) one_line(error);
    return 0;
}

// ---- driver hooks -----------------------------------------------------------------------------

namespace dgr_fuzz {

namespace {
std::vector<std::vector<FieldAt>> g_fields;  // per seed
std::vector<std::string> g_seeds;
}  // namespace

namespace {

std::string open_error(const std::string & data) {
    if (::ftruncate(g_fd, 0) != 0 || ::pwrite(g_fd, data.data(), data.size(), 0) != ssize_t(data.size())) std::abort();
    dgr::GgufHeader g;
    std::string error;
    return g.open(g_path, &error) ? std::string() : error;
}

// Before fuzzing: every seed opens; a zero, a negative (as int64) and an overflowing dimension
// are each refused with their own one-line reason.
void self_check() {
    for (size_t i = 0; i < g_seeds.size(); ++i) {
        const std::string e = open_error(g_seeds[i]);
        if (!e.empty()) {
            std::fprintf(stderr, "gguf_fuzz: seed %zu does not open: %s\n", i, e.c_str());
            std::exit(1);
        }
    }
    struct Case {
        std::vector<uint64_t> dims;  // written over the first dimensions of the first 2-d tensor
        const char * want;
    };
    for (const Case & c : {Case{{0}, "has a zero dimension"}, Case{{8, 0}, "has a zero dimension"},
                           Case{{0x8000000000000000ull}, "is negative as a signed 64-bit count"},
                           Case{{1ull << 32, 1ull << 32}, "the element count overflows 64 bits"},
                           Case{{(1ull << 62), 4}, "the element count overflows 64 bits"}}) {
        std::string data = g_seeds[0];
        size_t k = 0;
        for (const FieldAt & f : g_fields[0]) {
            if (f.kind != 'd' || k >= c.dims.size()) continue;
            for (int b = 0; b < 8; ++b) data[f.offset + size_t(b)] = char(uint8_t(c.dims[k] >> (8 * b)));
            ++k;
        }
        const std::string e = open_error(data);
        if (e.find(c.want) == std::string::npos || e.find("'token_embd.weight'") == std::string::npos) {
            std::fprintf(stderr, "gguf_fuzz: expected a refusal with '%s', got '%s'\n", c.want, e.c_str());
            std::exit(1);
        }
    }
    std::printf("gguf_fuzz: %zu seeds open; zero, negative and overflowing dimensions are refused\n", g_seeds.size());
}

}  // namespace

const char * name() { return "gguf"; }
uint64_t default_inputs() { return 20000; }
bool decoded() { return g_decoded; }

std::vector<std::string> seeds() {
    g_fd = ::memfd_create("dgr-gguf-fuzz", 0);
    if (g_fd < 0) {
        std::perror("gguf_fuzz: memfd_create");
        std::exit(2);
    }
    g_path = "/proc/self/fd/" + std::to_string(g_fd);
    if (const char * v = std::getenv("DGR_FUZZ_VERDICTS")) {
        g_verdicts = std::fopen(v, "w");
        if (!g_verdicts) {
            std::perror("gguf_fuzz: DGR_FUZZ_VERDICTS");
            std::exit(2);
        }
        std::atexit([] { std::fclose(g_verdicts); });
    }

    std::vector<FieldAt> f;
    g_seeds.push_back(gguf_file(kModelKvs, [](Builder & b) { model_kvs(b, false); }, model_tensors(), 32, &f));
    g_fields.push_back(f);
    g_seeds.push_back(gguf_file(kModelKvs + 1, [](Builder & b) { model_kvs(b, true); }, model_tensors(), 64, &f));
    g_fields.push_back(f);
    // a slice of layer 1 of a 2-layer source: its dgr.slice.* pairs and the embedded manifest
    const std::string manifest = "dgr-artifact-manifest/v1\nmetadata " + hex64('a') + "\ntensors 3\n" +
                                 "tensor blk.0.attn_q.weight 8 32x2 68 " + hex64('b') + "\n" +
                                 "tensor blk.1.ffn_up.weight 1 4x3x2 48 " + hex64('c') + "\n" +
                                 "tensor token_embd.weight 0 8x6 192 " + hex64('d') + "\n";
    std::vector<TensorSpec> slice_ts = {{"blk.1.ffn_up.weight", GGML_TYPE_F16, {4, 3, 2}}};
    g_seeds.push_back(gguf_file(
        kModelKvs + 5,
        [&](Builder & b) {
            model_kvs(b, false);
            b.kv_u32("dgr.slice.version", 1);
            b.kv_str("dgr.slice.source_artifact_id", hex64('e'));
            b.kv_str("dgr.slice.source_tokenizer_digest", hex64('f'));
            b.kv_str("dgr.slice.source_manifest", manifest);
            b.kv_u32("dgr.slice.start", 1);
        },
        slice_ts, 32, &f));
    g_fields.push_back(f);
    // an empty model (no tensors) and a header-only file
    g_seeds.push_back(gguf_file(kModelKvs, [](Builder & b) { model_kvs(b, false); }, {}, 32, &f));
    g_fields.push_back(f);
    g_seeds.push_back(gguf_file(0, [](Builder &) {}, {}, 32, &f));
    g_fields.push_back(f);
    self_check();
    return g_seeds;
}

bool mutate_structured(std::string & input, Rng & rng) {
    // only when the input is still a seed's length (its fields are where the builder put them)
    for (size_t i = 0; i < g_seeds.size(); ++i) {
        if (g_seeds[i].size() != input.size() || g_fields[i].empty()) continue;
        const FieldAt & f = g_fields[i][below(rng, g_fields[i].size())];
        uint64_t v = interesting_u64(rng);
        switch (f.kind) {
            case 'd': {  // dimensions: zero, negative as int64, overflowing, huge
                static const uint64_t k[] = {0, 0x8000000000000000ull, 0xFFFFFFFFFFFFFFFFull, 1ull << 32, 1ull << 33,
                                             (1ull << 62) + 256, 0x7FFFFFFFFFFFFF00ull, 256, 1};
                v = k[below(rng, sizeof k / sizeof k[0])];
                break;
            }
            case 'n': v = below(rng, 3) ? below(rng, 7) : interesting_u64(rng); break;
            case 't': v = below(rng, 2) ? below(rng, GGML_TYPE_COUNT + 4) : interesting_u64(rng); break;
            case 'v': v = below(rng, 2) ? below(rng, 15) : interesting_u64(rng); break;
            case 'o': v = below(rng, 2) ? v : (uint64_t(below(rng, 64)) * 32 + below(rng, 2)); break;
            default: break;
        }
        for (int b = 0; b < f.width; ++b) input[f.offset + size_t(b)] = char(uint8_t(v >> (8 * b)));
        return true;
    }
    return false;
}

}  // namespace dgr_fuzz
