// Patch 0003 (llama : take the input of a model without token embedding as embeddings).
//
// A model loaded from layer_start > 0 holds no token embedding: its input is the residual stream
// entering layer_start, n_tokens x n_embd f32 rows in llama_batch.embd. Checks: such a model
// refuses a batch of token ids with llama_decode() == -1 (and stays usable), accepts rows and
// returns finite logits for every row; the head still takes token ids.
//
//   test-boundary-input MODEL.gguf
#include "testing.h"

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
    const int32_t n_embd  = llama_model_n_embd(probe.get());
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(probe.get()));
    const std::vector<llama_token> toks = some_tokens(probe.get(), 6);
    probe.reset();

    llama_model_ptr tail = load_range(path, n_layer / 2, 0);
    CHECK(tail != nullptr, "tail [%d, %d) did not load", n_layer / 2, n_layer);
    if (!tail) return finish("test-boundary-input", "");
    llama_context_ptr ctx = make_context(tail.get());
    CHECK(ctx != nullptr, "tail context");
    if (!ctx) return finish("test-boundary-input", "");

    // token ids: an explicit error, not a crash in the graph
    const int32_t rc_tokens = decode_rows(ctx.get(), toks.data(), nullptr, (int32_t) toks.size(), n_embd, 0);
    CHECK(rc_tokens == -1, "a model without token embedding took token ids: llama_decode returned %d", rc_tokens);

    // rows: decoded, one finite logit row per input row
    std::vector<float> rows(toks.size() * n_embd);
    for (size_t i = 0; i < rows.size(); ++i) {
        rows[i] = 0.01f * (float) ((i * 7919) % 200) - 1.0f;
    }
    const int32_t rc_rows = decode_rows(ctx.get(), nullptr, rows.data(), (int32_t) toks.size(), n_embd, 0);
    CHECK(rc_rows == 0, "rows were refused: llama_decode returned %d", rc_rows);
    if (rc_rows == 0) {
        for (int32_t i = 0; i < (int32_t) toks.size(); ++i) {
            const float * logits = llama_get_logits_ith(ctx.get(), i);
            CHECK(logits != nullptr && all_finite(logits, n_vocab), "no finite logits for row %d", i);
        }
    }

    // the head still takes token ids
    llama_model_ptr head = load_range(path, 0, n_layer / 2);
    llama_context_ptr hctx = head ? make_context(head.get()) : nullptr;
    CHECK(hctx != nullptr, "head [0, %d) did not load", n_layer / 2);
    if (hctx) {
        const int32_t rc = decode_rows(hctx.get(), toks.data(), nullptr, (int32_t) toks.size(), n_embd, 0);
        CHECK(rc == 0, "the head refused token ids: %d", rc);
    }
    llama_backend_free();
    return finish("test-boundary-input", "a model without token embedding takes rows and refuses token ids");
}
