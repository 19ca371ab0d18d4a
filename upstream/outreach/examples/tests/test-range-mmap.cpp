// Patch 0002 (llama : keep the memory of a partial model to the tensors it holds).
//
// With mmap, a model loaded by layer range from the full GGUF must not fault in the whole file.
// Linux only (reads /proc/self/smaps): after loading the tail range [n_layer/2, n_layer) and
// decoding once (so its weights are touched), the resident part of the model file's mapping
// stays within the weights that range holds; the whole model, loaded the same way, has (almost)
// the whole file resident, which shows that the measurement sees what it should.
//
//   test-range-mmap MODEL.gguf
#include "testing.h"

#include <fstream>
#include <sstream>

#if defined(__linux__)
#include <climits>
#include <cstdlib>

// Resident bytes of every mapping of `path` in this process.
static uint64_t resident_bytes_of(const char * path) {
    char real[PATH_MAX];
    if (!realpath(path, real)) {
        return 0;
    }
    std::ifstream smaps("/proc/self/smaps");
    std::string line;
    bool in_file = false;
    uint64_t kib = 0;
    while (std::getline(smaps, line)) {
        const bool header = !line.empty() && std::isxdigit((unsigned char) line[0]) && line.find('-') != std::string::npos &&
                            line.find(':') > line.find(' ');
        if (header) {
            in_file = line.size() >= std::strlen(real) && line.compare(line.size() - std::strlen(real), std::string::npos, real) == 0;
        } else if (in_file && line.rfind("Rss:", 0) == 0) {
            std::istringstream in(line.substr(4));
            uint64_t v = 0;
            in >> v;
            kib += v;
        }
    }
    return kib * 1024;
}

static uint64_t file_size(const char * path) {
    std::ifstream f(path, std::ios::binary | std::ios::ate);
    return f ? (uint64_t) f.tellg() : 0;
}

static uint64_t touch_and_measure(const char * path, llama_model * m) {
    llama_context_ptr ctx = make_context(m);
    CHECK(ctx != nullptr, "context");
    if (!ctx) return 0;
    const int32_t n_embd = llama_model_n_embd(m);
    const std::vector<llama_token> toks = some_tokens(m, 8);
    const std::vector<float> rows((size_t) 8 * n_embd, 0.5f);
    const int32_t rc = llama_model_is_head(m) ? decode_rows(ctx.get(), toks.data(), nullptr, 8, n_embd, 0)
                                              : decode_rows(ctx.get(), nullptr, rows.data(), 8, n_embd, 0);
    CHECK(rc == 0, "decode returned %d", rc);
    return resident_bytes_of(path);
}

int main(int argc, char ** argv) {
    const char * path = get_model_or_exit(argc, argv);
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    const uint64_t file = file_size(path);

    uint64_t tail_resident = 0, tail_weights = 0;
    {
        llama_model_ptr probe = load_range(path, 0, 0);
        CHECK(probe != nullptr, "whole model did not load");
        if (!probe) return finish("test-range-mmap", "");
        const int32_t n_layer = llama_model_n_layer(probe.get());
        probe.reset();
        {   // the weights the range holds: loaded without mmap, its buffers are exactly its tensors
            llama_model_ptr owned = load_range(path, n_layer / 2, 0, LLAMA_LOAD_MODE_NONE);
            CHECK(owned != nullptr, "tail [%d, %d) did not load without mmap", n_layer / 2, n_layer);
            if (!owned) return finish("test-range-mmap", "");
            tail_weights = weight_bytes(owned.get());
        }
        llama_model_ptr tail = load_range(path, n_layer / 2, 0, LLAMA_LOAD_MODE_MMAP);
        CHECK(tail != nullptr, "tail [%d, %d) did not load", n_layer / 2, n_layer);
        if (!tail) return finish("test-range-mmap", "");
        tail_resident = touch_and_measure(path, tail.get());
    }
    uint64_t whole_resident = 0;
    {
        llama_model_ptr whole = load_range(path, 0, 0, LLAMA_LOAD_MODE_MMAP);
        CHECK(whole != nullptr, "whole model did not load with mmap");
        if (!whole) return finish("test-range-mmap", "");
        whole_resident = touch_and_measure(path, whole.get());
    }
    std::printf("file %.2f MiB; tail holds %.2f MiB, %.2f MiB of the file resident; whole model %.2f MiB resident\n",
                file / 1048576.0, tail_weights / 1048576.0, tail_resident / 1048576.0, whole_resident / 1048576.0);
    // slack: the pages a range shares with its neighbours at either end of each contiguous run
    CHECK(tail_weights > 0 && tail_weights < file - file / 4, "the tail holds %llu of %llu bytes (model too small?)",
          (unsigned long long) tail_weights, (unsigned long long) file);
    CHECK(tail_resident <= tail_weights + tail_weights / 20 + (256u << 10),
          "the tail has %llu bytes of the file resident but holds %llu bytes of weights",
          (unsigned long long) tail_resident, (unsigned long long) tail_weights);
    CHECK(whole_resident >= file - file / 10, "whole model: %llu of %llu bytes resident (measurement broken?)",
          (unsigned long long) whole_resident, (unsigned long long) file);
    llama_backend_free();
    return finish("test-range-mmap", "a range keeps only its own weights of the mapped file resident");
}
#else
int main() {
    std::printf("test-range-mmap: skipped (reads /proc/self/smaps, Linux only)\n");
    return EXIT_SUCCESS;
}
#endif
