// Patch 0004 (llama : output the residual stream of a model without the output layer).
//
// A model loaded with layer_end < n_layer ends with the unnormalized residual stream after its
// last layer, read as the input of layer layer_end through the layer-input staging API, for
// every token of the batch. Checks: the head's output rows are bit-identical to the input of
// layer `split` that the whole model computes for the same tokens (asked for with the same
// API), for every row even when only the last row requests logits; fed to the tail, they give
// bit-identical logits to the whole model.
//
//   test-boundary-output MODEL.gguf
#include "testing.h"

int main(int argc, char ** argv) {
    const char * path = get_model_or_exit(argc, argv);
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_ptr whole = load_range(path, 0, 0);
    if (!whole) {
        std::fprintf(stderr, "FAIL: the model did not load\n");
        return EXIT_FAILURE;
    }
    const int32_t n_layer = llama_model_n_layer(whole.get());
    const int32_t n_embd  = llama_model_n_embd(whole.get());
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(whole.get()));
    const int32_t split   = n_layer / 2;
    const std::vector<llama_token> toks = some_tokens(whole.get(), 12);
    const int32_t n = (int32_t) toks.size();

    // the whole model: its input of layer `split` and its logits
    std::vector<float> ref_rows, ref_logits;
    {
        llama_context_ptr ctx = make_context(whole.get());
        llama_set_embeddings_layer_inp(ctx.get(), (uint32_t) split, true);
        CHECK(decode_rows(ctx.get(), toks.data(), nullptr, n, n_embd, 0) == 0, "whole model decode");
        const float * r = llama_get_embeddings_layer_inp(ctx.get(), (uint32_t) split);
        CHECK(r != nullptr, "whole model: no input of layer %d", split);
        if (r) ref_rows.assign(r, r + (size_t) n * n_embd);
        for (int32_t i = 0; i < n; ++i) {
            const float * l = llama_get_logits_ith(ctx.get(), i);
            if (l) ref_logits.insert(ref_logits.end(), l, l + n_vocab);
        }
    }

    // the head [0, split): every row leaves through the boundary, even with logits only for the last
    std::vector<float> rows;
    {
        llama_model_ptr head = load_range(path, 0, split);
        llama_context_ptr ctx = head ? make_context(head.get()) : nullptr;
        CHECK(ctx != nullptr, "head [0, %d) did not load", split);
        if (!ctx) return finish("test-boundary-output", "");
        llama_batch b = llama_batch_get_one(const_cast<llama_token *>(toks.data()), n);  // logits: last row only
        CHECK(llama_decode(ctx.get(), b) == 0, "head decode");
        const float * r = llama_get_embeddings_layer_inp(ctx.get(), (uint32_t) split);
        CHECK(r != nullptr, "head: no boundary output");
        if (r) rows.assign(r, r + (size_t) n * n_embd);
    }
    CHECK(rows.size() == ref_rows.size() && !rows.empty() &&
          std::memcmp(rows.data(), ref_rows.data(), rows.size() * sizeof(float)) == 0,
          "the head's boundary output differs from the whole model's input of layer %d", split);

    // the tail [split, n_layer) on those rows: the whole model's logits, bit for bit
    {
        llama_model_ptr tail = load_range(path, split, 0);
        llama_context_ptr ctx = tail ? make_context(tail.get()) : nullptr;
        CHECK(ctx != nullptr, "tail [%d, %d) did not load", split, n_layer);
        if (!ctx || rows.empty()) return finish("test-boundary-output", "");
        CHECK(decode_rows(ctx.get(), nullptr, rows.data(), n, n_embd, 0) == 0, "tail decode");
        std::vector<float> logits;
        for (int32_t i = 0; i < n; ++i) {
            const float * l = llama_get_logits_ith(ctx.get(), i);
            if (l) logits.insert(logits.end(), l, l + n_vocab);
        }
        CHECK(logits.size() == ref_logits.size() &&
              std::memcmp(logits.data(), ref_logits.data(), logits.size() * sizeof(float)) == 0,
              "head -> tail logits differ from the whole model");
    }
    llama_backend_free();
    return finish("test-boundary-output", "the head hands on the whole model's residual stream, bit for bit");
}
