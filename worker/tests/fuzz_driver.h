// A deterministic driver for libFuzzer-style fuzz targets, so that they run as plain CTest
// programs under gcc (no libFuzzer, no coverage feedback): a seeded mutator over a corpus.
//
// A fuzz program defines the libFuzzer entry point
//     extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size);
// plus the driver's hooks (below): its name and default input count, its seed corpus, a
// structure-aware mutation and whether the last input decoded. It then `#include "fuzz_driver.h"` once, in the
// file that has no main(): the driver is main().
//
// Each input is a seed (or an earlier input that the target reported as decoded through the
// `decoded()` hook: kept in a bounded pool so that mutations stack up) put through 1..4 mutations:
// byte-level ones (bit flips, interesting bytes, inserts, erases, chunk copies, crossover with
// another seed, truncation, protobuf varints) or the target's own structure-aware one. Every run
// with the same seed tries the same inputs.
//
// usage: NAME [--inputs N] [--seed S] [FILE...]
//   FILE...: run exactly these inputs (a reproducer) instead of mutating.
// Hangs: an input running longer than DGR_FUZZ_HANG_S seconds (default 10) aborts the run.
// Crashes (a signal, or a sanitizer report in a sanitizer build): the current input is written to
// fuzz-crash-NAME.bin in the working directory before the process dies. At the end the driver
// prints "fuzz NAME: N inputs tried ..." and, when DGR_FUZZ_SUMMARY_DIR is set, writes
// fuzz-NAME.json there.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size);

namespace dgr_fuzz {

using Rng = std::mt19937_64;

// ---- hooks a fuzz program defines ----
// Its name (fuzz-NAME.json, fuzz-crash-NAME.bin) and default input count.
const char * name();
uint64_t default_inputs();
// The seed corpus (valid inputs).
std::vector<std::string> seeds();
// A structure-aware mutation of `input` (e.g. through a parsed form); false = not applicable.
bool mutate_structured(std::string & input, Rng & rng);
// Whether the last input got past the decoder (such inputs seed further mutations). The entry
// point itself returns 0 as libFuzzer requires, so the same file also builds under libFuzzer.
bool decoded();

// ---- the driver ----

inline uint64_t below(Rng & rng, uint64_t n) { return n ? rng() % n : 0; }

// Interesting integers for length, count and index fields.
inline uint64_t interesting_u64(Rng & rng) {
    static const uint64_t k[] = {0, 1, 2, 7, 8, 31, 32, 127, 128, 255, 256, 1023, 1024, 4096, 65535, 65536,
                                 0x7FFFFFFFull, 0x80000000ull, 0xFFFFFFFFull, 0x100000000ull,
                                 0x7FFFFFFFFFFFFFFFull, 0x8000000000000000ull, 0xFFFFFFFFFFFFFFFFull};
    return k[below(rng, sizeof k / sizeof k[0])];
}

inline std::string varint(uint64_t v) {
    std::string out;
    while (v >= 0x80) {
        out += char(uint8_t(v) | 0x80);
        v >>= 7;
    }
    out += char(uint8_t(v));
    return out;
}

inline void mutate_bytes(std::string & s, const std::vector<std::string> & corpus, Rng & rng) {
    switch (below(rng, 10)) {
        case 0:  // flip one bit
            if (!s.empty()) s[below(rng, s.size())] ^= char(1u << below(rng, 8));
            break;
        case 1: {  // an interesting byte
            static const uint8_t k[] = {0x00, 0x01, 0x7F, 0x80, 0xFF, 0x08, 0x0A, 0x10, 0x12, 0x1A};
            if (!s.empty()) s[below(rng, s.size())] = char(k[below(rng, sizeof k)]);
            break;
        }
        case 2:  // insert random bytes
            s.insert(below(rng, s.size() + 1), std::string(1 + below(rng, 8), char(rng())));
            break;
        case 3:  // erase a run
            if (!s.empty()) {
                const size_t at = below(rng, s.size());
                s.erase(at, 1 + below(rng, std::min<size_t>(16, s.size() - at)));
            }
            break;
        case 4:  // duplicate a chunk
            if (!s.empty()) {
                const size_t at = below(rng, s.size()), n = 1 + below(rng, std::min<size_t>(64, s.size() - at));
                s.insert(below(rng, s.size() + 1), s.substr(at, n));
            }
            break;
        case 5:  // crossover: splice a chunk of another corpus entry
            if (!corpus.empty()) {
                const std::string & o = corpus[below(rng, corpus.size())];
                if (!o.empty()) {
                    const size_t at = below(rng, o.size()), n = 1 + below(rng, o.size() - at);
                    const size_t to = below(rng, s.size() + 1);
                    s = s.substr(0, to) + o.substr(at, n) + (below(rng, 2) ? s.substr(to) : std::string());
                }
            }
            break;
        case 6:  // truncate
            s.resize(below(rng, s.size() + 1));
            break;
        case 7: {  // overwrite with a varint of an interesting value (protobuf lengths, counts)
            const std::string v = varint(interesting_u64(rng));
            const size_t at = below(rng, s.size() + 1);
            s.replace(at, std::min(v.size(), s.size() - at), v);
            break;
        }
        case 8: {  // insert a field: random tag (field 1..20, any wire type) + varint or short bytes
            std::string f = varint((1 + below(rng, 20)) << 3 | below(rng, 6));
            f += below(rng, 2) ? varint(interesting_u64(rng)) : varint(below(rng, 4)) + std::string(below(rng, 4), 'x');
            s.insert(below(rng, s.size() + 1), f);
            break;
        }
        default: {  // overwrite 4 or 8 bytes with a little-endian interesting value (binary formats)
            const uint64_t v = interesting_u64(rng);
            const size_t w = below(rng, 2) ? 4 : 8;
            if (s.size() >= w) {
                const size_t at = below(rng, s.size() - w + 1);
                for (size_t i = 0; i < w; ++i) s[at + i] = char(uint8_t(v >> (8 * i)));
            }
        }
    }
}

// The input being run (for the crash and hang reporters; written before each run).
inline const std::string * g_current = nullptr;
inline char g_crash_path[512] = "fuzz-crash.bin";

inline void dump_current() {  // async-signal-safe
    if (!g_current) return;
    const int fd = ::open(g_crash_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return;
    const char * p = g_current->data();
    size_t left = g_current->size();
    while (left > 0) {
        const ssize_t n = ::write(fd, p, left);
        if (n <= 0) break;
        p += n;
        left -= size_t(n);
    }
    ::close(fd);
}

inline void on_fatal(int sig) {
    dump_current();
    const char msg[] = "\nfuzz: fatal signal; the input is in the fuzz-crash file\n";
    (void) !::write(2, msg, sizeof msg - 1);
    ::signal(sig, SIG_DFL);
    ::raise(sig);
}

inline void on_alarm(int) {
    dump_current();
    const char msg[] = "\nfuzz: HANG (an input ran past DGR_FUZZ_HANG_S); the input is in the fuzz-crash file\n";
    (void) !::write(2, msg, sizeof msg - 1);
    ::_exit(3);
}

inline std::string read_file(const char * path, bool * ok) {
    std::ifstream in(path, std::ios::binary);
    *ok = bool(in);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

inline int run(int argc, char ** argv) {
    uint64_t n_inputs = default_inputs();
    uint64_t seed = 20261201;
    std::vector<const char *> files;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--inputs" && i + 1 < argc) {
            n_inputs = std::strtoull(argv[++i], nullptr, 10);
        } else if (a == "--seed" && i + 1 < argc) {
            seed = std::strtoull(argv[++i], nullptr, 10);
        } else if (a == "-h" || a == "--help") {
            std::printf("usage: %s [--inputs N] [--seed S] [FILE...]\n", argv[0]);
            return 0;
        } else {
            files.push_back(argv[i]);
        }
    }
    if (const char * e = std::getenv("DGR_FUZZ_INPUTS")) n_inputs = std::strtoull(e, nullptr, 10);
    unsigned hang_s = 10;
    if (const char * e = std::getenv("DGR_FUZZ_HANG_S")) hang_s = unsigned(std::strtoul(e, nullptr, 10));
    std::snprintf(g_crash_path, sizeof g_crash_path, "fuzz-crash-%s.bin", name());
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) ::signal(sig, on_fatal);
    ::signal(SIGALRM, on_alarm);
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_set_death_callback(dump_current);
#endif
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t tried = 0, interesting = 0;
    const std::vector<std::string> corpus = seeds();  // also the target's setup, in both modes
    if (!files.empty()) {
        for (const char * f : files) {
            bool ok = false;
            const std::string data = read_file(f, &ok);
            if (!ok) {
                std::fprintf(stderr, "%s: cannot read %s\n", name(), f);
                return 2;
            }
            g_current = &data;
            ::alarm(hang_s);
            LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t *>(data.data()), data.size());
            ::alarm(0);
            interesting += decoded();
            ++tried;
        }
    } else {
        if (corpus.empty()) {
            std::fprintf(stderr, "%s: empty seed corpus\n", name());
            return 2;
        }
        std::vector<std::string> pool;  // interesting inputs, bounded; replaced at random when full
        constexpr size_t kPool = 512;
        Rng rng(seed);
        std::string input;
        for (uint64_t i = 0; i < n_inputs; ++i) {
            if (i < corpus.size()) {
                input = corpus[i];  // every seed runs once as it is
            } else {
                const bool from_pool = !pool.empty() && below(rng, 2);
                input = from_pool ? pool[below(rng, pool.size())] : corpus[below(rng, corpus.size())];
                const uint64_t n_mut = 1 + below(rng, 4);
                for (uint64_t m = 0; m < n_mut; ++m) {
                    if (below(rng, 2) == 0 && mutate_structured(input, rng)) continue;
                    mutate_bytes(input, corpus, rng);
                }
            }
            g_current = &input;
            ::alarm(hang_s);
            LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t *>(input.data()), input.size());
            ::alarm(0);
            ++tried;
            if (decoded()) {
                ++interesting;
                if (pool.size() < kPool) {
                    pool.push_back(input);
                } else {
                    pool[below(rng, kPool)] = input;
                }
            }
        }
    }
    g_current = nullptr;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("fuzz %s: %llu inputs tried (%llu decoded, seed %llu), 0 crashes, 0 hangs, %.1f s\n", name(),
                (unsigned long long) tried, (unsigned long long) interesting, (unsigned long long) seed, secs);
    if (const char * dir = std::getenv("DGR_FUZZ_SUMMARY_DIR")) {
        const std::string path = std::string(dir) + "/fuzz-" + name() + ".json";
        if (FILE * f = std::fopen(path.c_str(), "w")) {
            std::fprintf(f,
                         "{\"fuzz\": \"%s\", \"inputs_tried\": %llu, \"decoded\": %llu, \"seed\": %llu, "
                         "\"crashes\": 0, \"hangs\": 0, \"seconds\": %.2f, \"sanitizers\": %s}\n",
                         name(), (unsigned long long) tried, (unsigned long long) interesting,
                         (unsigned long long) seed, secs,
#if defined(__SANITIZE_ADDRESS__)
                         "\"address,undefined\""
#else
                         "null"
#endif
            );
            std::fclose(f);
        }
    }
    return 0;
}

}  // namespace dgr_fuzz

int main(int argc, char ** argv) { return dgr_fuzz::run(argc, argv); }
