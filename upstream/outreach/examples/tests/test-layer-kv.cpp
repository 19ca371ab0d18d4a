// Patch 0005 (llama : cache only the layers a partial model holds).
//
// The KV cache of a model loaded by layer range holds cells only for its own layers. Checks,
// through the public sequence-state API after decoding the same tokens: the saved state of a
// head [0, split) and of a tail [split, n_layer) are each smaller than the whole model's, and
// together about as large (each holds its share of the layers, not all of them).
//
//   test-layer-kv MODEL.gguf
#include "testing.h"

static size_t state_after_decode(const char * path, int32_t start, int32_t end, const std::vector<llama_token> & toks) {
    llama_model_ptr m = load_range(path, start, end);
    CHECK(m != nullptr, "range [%d, %d) did not load", start, end);
    if (!m) return 0;
    llama_context_ptr ctx = make_context(m.get());
    CHECK(ctx != nullptr, "context for [%d, %d)", start, end);
    if (!ctx) return 0;
    const int32_t n_embd = llama_model_n_embd(m.get());
    const int32_t n = (int32_t) toks.size();
    const std::vector<float> rows((size_t) n * n_embd, 0.25f);
    const int32_t rc = llama_model_is_head(m.get()) ? decode_rows(ctx.get(), toks.data(), nullptr, n, n_embd, 0)
                                                    : decode_rows(ctx.get(), nullptr, rows.data(), n, n_embd, 0);
    CHECK(rc == 0, "decode of [%d, %d) returned %d", start, end, rc);
    return llama_state_seq_get_size(ctx.get(), 0);
}

int main(int argc, char ** argv) {
    const char * path = get_model_or_exit(argc, argv);
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_ptr probe = load_range(path, 0, 0);
    if (!probe) {
        std::fprintf(stderr, "FAIL: the model did not load\n");
        return EXIT_FAILURE;
    }
    const int32_t n_layer = llama_model_n_layer(probe.get());
    const int32_t split   = n_layer / 2;
    const std::vector<llama_token> toks = some_tokens(probe.get(), 32);
    probe.reset();

    const size_t whole = state_after_decode(path, 0, 0, toks);
    const size_t head  = state_after_decode(path, 0, split, toks);
    const size_t tail  = state_after_decode(path, split, 0, toks);
    std::printf("sequence state after %zu tokens: whole %zu bytes, head [0, %d) %zu, tail [%d, %d) %zu\n",
                toks.size(), whole, split, head, split, n_layer, tail);
    // KV bytes scale with the layers held; a few hundred bytes of header per state are shared
    const double head_share = (double) split / n_layer, tail_share = 1.0 - head_share;
    CHECK(head < whole && (double) head <= whole * (head_share + 0.05), "head state %zu vs whole %zu", head, whole);
    CHECK(tail < whole && (double) tail <= whole * (tail_share + 0.05), "tail state %zu vs whole %zu", tail, whole);
    CHECK(head + tail >= whole - whole / 20, "head %zu + tail %zu is far below whole %zu", head, tail, whole);
    llama_backend_free();
    return finish("test-layer-kv", "a range caches only its own layers");
}
