// Small helpers shared by the partial-model tests. The model path comes from argv[1] or
// LLAMACPP_TEST_MODELFILE (the test skips without one), as common_get_model_or_exit() does for
// llama.cpp's model tests (test-model-load-cancel, test-autorelease) without linking common;
// CHECK() records a failure and keeps going, and batches are built explicitly (one sequence,
// explicit positions) so the head, the tail and the whole model see exactly the same inputs.
#pragma once

#include "llama-cpp.h"
#include "llama.h"

#include <cmath>
#include <cstdio>
#include <map>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// The boundary output is read through llama.cpp's staging API for layer inputs (src/llama-ext.h,
// not on the public include path at the pinned commit); these are its exact declarations.
LLAMA_API void    llama_set_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid, bool value);
LLAMA_API float * llama_get_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid);
// Memory per buffer type (src/llama-ext.h, staging): the bytes a model's weights occupy. Used
// because llama_model_size() reports the tensors of the file, not those the model created.
struct llama_memory_breakdown_data {
    size_t model   = 0; // memory allocated for the model
    size_t context = 0; // memory allocated for the context
    size_t compute = 0; // memory allocated for temporary compute buffers

    size_t total() const {
        return model + context + compute;
    }
};
using llama_memory_breakdown = std::map<ggml_backend_buffer_type_t, llama_memory_breakdown_data>;
LLAMA_API llama_memory_breakdown llama_get_memory_breakdown(const struct llama_context * ctx);

static int g_failures = 0;

#define CHECK(cond, ...)                                                          \
    do {                                                                          \
        if (!(cond)) {                                                            \
            ++g_failures;                                                         \
            std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            std::fprintf(stderr, __VA_ARGS__);                                    \
            std::fprintf(stderr, "\n");                                           \
        }                                                                         \
    } while (0)

static const char * get_model_or_exit(int argc, char ** argv) {
    if (argc > 1) {
        return argv[1];
    }
    const char * path = std::getenv("LLAMACPP_TEST_MODELFILE");
    if (path == nullptr || *path == '\0') {
        std::fprintf(stderr, "no model file given (argv[1] or LLAMACPP_TEST_MODELFILE): skipping\n");
        std::exit(EXIT_SUCCESS);
    }
    return path;
}

static void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        std::fputs(text, stderr);
    }
}

// Loads layers [start, end) of `path` (end <= 0: up to n_layer); nullptr when the load fails.
static llama_model_ptr load_range(const char * path, int32_t start, int32_t end,
                                  llama_load_mode mode = LLAMA_LOAD_MODE_AUTO) {
    llama_model_params mp = llama_model_default_params();
    mp.layer_start = start;
    mp.layer_end   = end;
    mp.load_mode   = mode;
    return llama_model_ptr(llama_model_load_from_file(path, mp));
}

static llama_context_ptr make_context(llama_model * model, uint32_t n_ctx = 256) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = n_ctx;
    cp.n_batch         = n_ctx;
    cp.n_ubatch        = n_ctx;
    cp.n_threads       = 2;
    cp.n_threads_batch = 2;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (ctx != nullptr && !llama_model_is_tail(model)) {
        // a model without the output layer hands on the input of layer `layer_end`
        llama_set_embeddings_layer_inp(ctx, (uint32_t) llama_model_layer_end(model), true);
    }
    return llama_context_ptr(ctx);
}

// One decode of sequence 0 at positions [pos0, pos0 + n): token ids (tokens != nullptr) or
// n x n_embd rows; outputs for every row. Returns llama_decode's code.
static int32_t decode_rows(llama_context * ctx, const llama_token * tokens, const float * rows, int32_t n,
                           int32_t n_embd, llama_pos pos0) {
    llama_batch b = llama_batch_init(n, tokens ? 0 : n_embd, 1);
    for (int32_t i = 0; i < n; ++i) {
        if (tokens) {
            b.token[i] = tokens[i];
        }
        b.pos[i]       = pos0 + i;
        b.n_seq_id[i]  = 1;
        b.seq_id[i][0] = 0;
        b.logits[i]    = 1;
    }
    if (!tokens) {
        std::memcpy(b.embd, rows, sizeof(float) * (size_t) n * n_embd);
    }
    b.n_tokens = n;
    const int32_t rc = llama_decode(ctx, b);
    llama_batch_free(b);
    return rc;
}

// Bytes of the weights a model holds (load it with LLAMA_LOAD_MODE_NONE: the buffers are then
// exactly its tensors, not a mapped span of the file).
static uint64_t weight_bytes(llama_model * model) {
    llama_context_ptr ctx = make_context(model, 64);
    if (!ctx) {
        return 0;
    }
    uint64_t bytes = 0;
    for (const auto & kv : llama_get_memory_breakdown(ctx.get())) {
        bytes += kv.second.model;
    }
    return bytes;
}

static std::vector<llama_token> some_tokens(const llama_model * model, int32_t n) {
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::vector<llama_token> out;
    uint32_t x = 12345u;
    for (int32_t i = 0; i < n; ++i) {
        x = x * 1103515245u + 12345u;
        out.push_back((llama_token) (3 + (x >> 8) % (uint32_t) (n_vocab - 3)));
    }
    return out;
}

static bool all_finite(const float * v, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        if (!std::isfinite(v[i])) {
            return false;
        }
    }
    return true;
}

static int finish(const char * name, const char * what) {
    if (g_failures) {
        std::fprintf(stderr, "%s: %d failure(s)\n", name, g_failures);
        return EXIT_FAILURE;
    }
    std::printf("%s: OK (%s)\n", name, what);
    return EXIT_SUCCESS;
}
