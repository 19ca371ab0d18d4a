// split-simple: examples/simple, run as two layer ranges and compared with the whole model.
//
// Loads the same GGUF three times: whole, as the head [0, split) and as the tail
// [split, n_layer) (llama_model_params.layer_start/layer_end). The prompt and then every greedy
// token go through the head, whose output (the residual stream entering layer `split`, read with
// llama_get_embeddings_layer_inp) is the tail's input (llama_batch.embd). Prints the text of
// both runs, the largest logit difference over every prompt position and generated token, and
// PASS when the tokens are identical and the difference is within --tolerance (0: bit-identical,
// which is what the same backend and thread count give).
//
//   llama-split-simple -m MODEL.gguf [--split N] [-n N_PREDICT] [-p PROMPT] [-t THREADS] [--tolerance T]
#include "llama-cpp.h"
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// The layer-input staging API (src/llama-ext.h at the pinned commit), declared as it is there.
LLAMA_API void    llama_set_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid, bool value);
LLAMA_API float * llama_get_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid);

static void print_usage(int, char ** argv) {
    std::printf("\nexample usage:\n");
    std::printf("\n    %s -m model.gguf [--split N] [-n n_predict] [-p prompt] [-t threads] [--tolerance T]\n\n", argv[0]);
}

// A model and its context; a head/middle range hands on the input of layer `layer_end`.
struct Stage {
    llama_model_ptr   model;
    llama_context_ptr ctx;
};

static bool open_stage(Stage & s, const std::string & path, int32_t start, int32_t end, int32_t n_ctx,
                       int32_t n_threads) {
    llama_model_params mp = llama_model_default_params();
    mp.layer_start = start;
    mp.layer_end   = end;
    s.model.reset(llama_model_load_from_file(path.c_str(), mp));
    if (!s.model) {
        std::fprintf(stderr, "%s: error: unable to load layers [%d, %d) of %s\n", __func__, start, end, path.c_str());
        return false;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx    = n_ctx;
    cp.n_batch  = n_ctx;
    cp.n_ubatch = n_ctx;  // one ubatch for the prompt on every side: llama.cpp is not batch-invariant
    if (n_threads > 0) {  // the same thread count on every side
        cp.n_threads       = n_threads;
        cp.n_threads_batch = n_threads;
    }
    s.ctx.reset(llama_init_from_model(s.model.get(), cp));
    if (!s.ctx) {
        std::fprintf(stderr, "%s: error: failed to create the llama_context\n", __func__);
        return false;
    }
    if (!llama_model_is_tail(s.model.get())) {
        llama_set_embeddings_layer_inp(s.ctx.get(), (uint32_t) llama_model_layer_end(s.model.get()), true);
    }
    return true;
}

// Decodes n tokens (or n rows of the residual stream) at positions pos0.. with outputs for every row.
static int32_t decode(Stage & s, const llama_token * tokens, const float * rows, int32_t n, llama_pos pos0) {
    const int32_t n_embd = llama_model_n_embd(s.model.get());
    llama_batch batch = llama_batch_init(n, tokens ? 0 : n_embd, 1);
    for (int32_t i = 0; i < n; ++i) {
        if (tokens) batch.token[i] = tokens[i];
        batch.pos[i]       = pos0 + i;
        batch.n_seq_id[i]  = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i]    = 1;
    }
    if (!tokens) std::memcpy(batch.embd, rows, sizeof(float) * (size_t) n * n_embd);
    batch.n_tokens = n;
    const int32_t rc = llama_decode(s.ctx.get(), batch);
    llama_batch_free(batch);
    if (rc != 0) {
        std::fprintf(stderr, "%s: error: llama_decode returned %d\n", __func__, rc);
    }
    return rc;
}

// Runs tokens through the stages (head first); appends the logits of every row to `out`.
static bool forward(std::vector<Stage> & stages, const std::vector<llama_token> & tokens, llama_pos pos0,
                    std::vector<float> & out) {
    const int32_t n = (int32_t) tokens.size();
    std::vector<float> rows;
    for (Stage & s : stages) {
        const bool first = &s == &stages.front();
        if (decode(s, first ? tokens.data() : nullptr, first ? nullptr : rows.data(), n, pos0) != 0) {
            return false;
        }
        if (!llama_model_is_tail(s.model.get())) {
            const float * r = llama_get_embeddings_layer_inp(s.ctx.get(), (uint32_t) llama_model_layer_end(s.model.get()));
            if (r == nullptr) {
                std::fprintf(stderr, "%s: error: no boundary output from layers [%d, %d)\n", __func__,
                             llama_model_layer_start(s.model.get()), llama_model_layer_end(s.model.get()));
                return false;
            }
            rows.assign(r, r + (size_t) n * llama_model_n_embd(s.model.get()));
        }
    }
    const llama_model * tail = stages.back().model.get();
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(tail));
    for (int32_t i = 0; i < n; ++i) {
        const float * l = llama_get_logits_ith(stages.back().ctx.get(), i);
        out.insert(out.end(), l, l + n_vocab);
    }
    return true;
}

// Greedy generation; returns the tokens and every logit row (prompt positions, then one per step).
static bool generate(std::vector<Stage> & stages, const std::vector<llama_token> & prompt, int32_t n_predict,
                     std::vector<llama_token> & tokens, std::vector<float> & logits) {
    const llama_vocab * vocab = llama_model_get_vocab(stages.back().model.get());
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    if (!forward(stages, prompt, 0, logits)) return false;
    for (int32_t k = 0; k < n_predict; ++k) {
        const float * last = logits.data() + logits.size() - n_vocab;
        const llama_token t = (llama_token) (std::max_element(last, last + n_vocab) - last);
        tokens.push_back(t);
        if (llama_vocab_is_eog(vocab, t) || k + 1 == n_predict) break;
        if (!forward(stages, {t}, (llama_pos) (prompt.size() + k), logits)) return false;
    }
    return true;
}

static std::string detokenize(const llama_vocab * vocab, const std::vector<llama_token> & tokens) {
    std::string text;
    for (llama_token t : tokens) {
        char buf[256];
        const int n = llama_token_to_piece(vocab, t, buf, sizeof(buf), 0, true);
        if (n > 0) text.append(buf, n);
    }
    return text;
}

int main(int argc, char ** argv) {
    std::string model_path;
    std::string prompt = "Hello my name is";
    int32_t split = -1, n_predict = 16, n_threads = 0;
    double tolerance = 0.0;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        const bool has_value = i + 1 < argc;
        if (a == "-m" && has_value) model_path = argv[++i];
        else if (a == "-p" && has_value) prompt = argv[++i];
        else if (a == "-n" && has_value) n_predict = std::atoi(argv[++i]);
        else if (a == "--split" && has_value) split = std::atoi(argv[++i]);
        else if (a == "-t" && has_value) n_threads = std::atoi(argv[++i]);
        else if (a == "--tolerance" && has_value) tolerance = std::atof(argv[++i]);
        else {
            print_usage(argc, argv);
            return 2;
        }
    }
    if (model_path.empty() || n_predict < 1) {
        print_usage(argc, argv);
        return 2;
    }
    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level >= GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
    }, nullptr);
    ggml_backend_load_all();

    std::vector<Stage> whole(1);
    if (!open_stage(whole[0], model_path, 0, 0, 512, n_threads)) return 1;
    const int32_t n_layer = llama_model_n_layer(whole[0].model.get());
    if (split < 0) split = n_layer / 2;
    if (split < 1 || split >= n_layer) {
        std::fprintf(stderr, "error: --split must be in [1, %d), got %d\n", n_layer, split);
        return 2;
    }
    const llama_vocab * vocab = llama_model_get_vocab(whole[0].model.get());
    const int n_prompt = -llama_tokenize(vocab, prompt.c_str(), (int32_t) prompt.size(), nullptr, 0, true, true);
    std::vector<llama_token> prompt_tokens(n_prompt);
    if (llama_tokenize(vocab, prompt.c_str(), (int32_t) prompt.size(), prompt_tokens.data(), n_prompt, true, true) < 0) {
        std::fprintf(stderr, "error: failed to tokenize the prompt\n");
        return 1;
    }

    std::vector<llama_token> ref_tokens, got_tokens;
    std::vector<float> ref_logits, got_logits;
    if (!generate(whole, prompt_tokens, n_predict, ref_tokens, ref_logits)) return 1;
    const std::string ref_text = detokenize(vocab, ref_tokens);
    whole.clear();  // frees `vocab` too

    std::vector<Stage> stages(2);
    if (!open_stage(stages[0], model_path, 0, split, 512, n_threads) ||
        !open_stage(stages[1], model_path, split, 0, 512, n_threads)) return 1;
    if (!generate(stages, prompt_tokens, n_predict, got_tokens, got_logits)) return 1;

    double max_diff = ref_logits.size() == got_logits.size() ? 0.0 : INFINITY;
    for (size_t i = 0; i < ref_logits.size() && i < got_logits.size(); ++i) {
        max_diff = std::max(max_diff, (double) std::fabs(ref_logits[i] - got_logits[i]));
    }
    const bool same_tokens = ref_tokens == got_tokens;
    std::printf("model: %d layers, split at %d: [0, %d) + [%d, %d)\n", n_layer, split, split, split, n_layer);
    std::printf("whole: %s%s\n", prompt.c_str(), ref_text.c_str());
    std::printf("split: %s%s\n", prompt.c_str(), detokenize(llama_model_get_vocab(stages[1].model.get()), got_tokens).c_str());
    std::printf("prompt positions: %d, generated tokens: %zu, identical: %s, max |logit diff|: %g\n", n_prompt,
                got_tokens.size(), same_tokens ? "yes" : "no", max_diff);
    const bool pass = same_tokens && max_diff <= tolerance;
    std::printf("split-simple: %s\n", pass ? "PASS" : "FAIL");
    return pass ? 0 : 1;
}
