// Patch 0001 (llama : load a model by layer range).
//
// llama_model_params.layer_start/layer_end load only the repeating layers [start, end) of a
// model; the model reports what it holds. Checks, on any dense llama GGUF with at least three
// layers: the default loads the whole model; a head, a middle and a tail range each report
// their range and roles and hold fewer weight bytes than the whole model (loaded without mmap,
// so the buffers are exactly the tensors created); a head and a tail that meet at the split
// together hold every layer; invalid ranges fail to load.
//
//   test-layer-range MODEL.gguf
#include "testing.h"

int main(int argc, char ** argv) {
    const char * path = get_model_or_exit(argc, argv);
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_ptr whole = load_range(path, 0, 0, LLAMA_LOAD_MODE_NONE);
    if (!whole) {
        std::fprintf(stderr, "FAIL: the whole model did not load\n");
        return EXIT_FAILURE;
    }
    const int32_t n_layer = llama_model_n_layer(whole.get());
    const int32_t split   = n_layer / 2;
    CHECK(n_layer >= 3, "needs a model with at least three layers, got %d", n_layer);
    CHECK(llama_model_layer_start(whole.get()) == 0 && llama_model_layer_end(whole.get()) == n_layer,
          "whole model reports [%d, %d)", llama_model_layer_start(whole.get()), llama_model_layer_end(whole.get()));
    CHECK(llama_model_is_head(whole.get()) && llama_model_is_tail(whole.get()), "whole model is head and tail");
    const uint64_t whole_bytes = weight_bytes(whole.get());
    CHECK(whole_bytes > 0, "no weight bytes for the whole model");

    struct Case { int32_t start, end; bool head, tail; };
    const Case cases[] = {{0, split, true, false}, {1, n_layer - 1, false, false}, {split, n_layer, false, true}};
    uint64_t head_bytes = 0, tail_bytes = 0;
    for (const Case & c : cases) {
        llama_model_ptr m = load_range(path, c.start, c.end, LLAMA_LOAD_MODE_NONE);
        CHECK(m != nullptr, "range [%d, %d) did not load", c.start, c.end);
        if (!m) {
            continue;
        }
        CHECK(llama_model_layer_start(m.get()) == c.start && llama_model_layer_end(m.get()) == c.end,
              "range [%d, %d) reports [%d, %d)", c.start, c.end, llama_model_layer_start(m.get()), llama_model_layer_end(m.get()));
        CHECK(llama_model_is_head(m.get()) == c.head && llama_model_is_tail(m.get()) == c.tail,
              "roles of [%d, %d): head %d tail %d", c.start, c.end, llama_model_is_head(m.get()), llama_model_is_tail(m.get()));
        CHECK(llama_model_n_layer(m.get()) == n_layer, "n_layer stays the full count (%d)", llama_model_n_layer(m.get()));
        const uint64_t bytes = weight_bytes(m.get());
        CHECK(bytes > 0 && bytes < whole_bytes, "range [%d, %d) holds %llu bytes, the whole model %llu", c.start, c.end,
              (unsigned long long) bytes, (unsigned long long) whole_bytes);
        if (c.head) head_bytes = bytes;
        if (c.tail) tail_bytes = bytes;
    }
    // head + tail hold every layer once (a tied output makes the tail hold the embedding again)
    CHECK(head_bytes + tail_bytes >= whole_bytes, "head %llu + tail %llu bytes < whole %llu",
          (unsigned long long) head_bytes, (unsigned long long) tail_bytes, (unsigned long long) whole_bytes);

    const int32_t bad[][2] = {{split, split}, {-1, split}, {0, n_layer + 1}, {n_layer, n_layer + 1}};
    for (const auto & r : bad) {
        llama_model_ptr m = load_range(path, r[0], r[1]);
        CHECK(m == nullptr, "invalid range [%d, %d) loaded", r[0], r[1]);
    }

    llama_backend_free();
    return finish("test-layer-range", "ranges load, report their roles and hold only their layers");
}
