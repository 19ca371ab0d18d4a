// CTest: the range patches through dgr::ShardModel, on tiny llama GGUFs written here with the
// gguf API (random weights, byte-fallback SPM vocabulary), so it needs no model download and no
// Python. For tied and untied models: whole model vs splits 3 | 2,5 | 1 | 5 of 6 layers must give
// bit-identical prefill logits (every position) and identical greedy tokens; a non-head shard
// must refuse token ids; the model must report the range and roles it loaded.
#include "common/shard_model.h"

#include "ggml.h"
#include "gguf.h"
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

constexpr int N_LAYER = 6, N_EMBD = 64, N_HEAD = 4, N_HEAD_KV = 2, N_FF = 128;
int g_failures = 0;

#define EXPECT(cond, ...)                                        \
    do {                                                         \
        if (!(cond)) {                                           \
            std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            std::fprintf(stderr, __VA_ARGS__);                   \
            std::fprintf(stderr, "\n");                          \
            ++g_failures;                                        \
        }                                                        \
    } while (0)

void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        std::fputs(text, stderr);
    }
}

std::vector<std::string> vocab_tokens(std::vector<float> & scores, std::vector<int32_t> & types) {
    std::vector<std::string> toks = {"<unk>", "<s>", "</s>"};
    types = {2, 3, 3};
    scores = {0.0f, 0.0f, 0.0f};
    char buf[16];
    for (int b = 0; b < 256; ++b) {
        std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
        toks.push_back(buf);
        types.push_back(6);
        scores.push_back(0.0f);
    }
    const std::string sp = "\xE2\x96\x81";  // U+2581
    for (char c = 'a'; c <= 'z'; ++c) {
        toks.push_back(std::string(1, c));
        toks.push_back(sp + c);
        types.insert(types.end(), 2, 1);
        scores.push_back(-(float) toks.size());
        scores.push_back(-(float) toks.size());
    }
    return toks;
}

// Writes a 6-layer llama GGUF with F32 random weights.
bool write_model(const std::string & path, bool tied, uint32_t seed) {
    std::vector<float> scores;
    std::vector<int32_t> types;
    const std::vector<std::string> toks = vocab_tokens(scores, types);
    const int n_vocab = (int) toks.size();

    gguf_context * g = gguf_init_empty();
    gguf_set_val_str(g, "general.architecture", "llama");
    gguf_set_val_str(g, "general.name", "dgr range_parity_test");
    gguf_set_val_u32(g, "llama.context_length", 256);
    gguf_set_val_u32(g, "llama.embedding_length", N_EMBD);
    gguf_set_val_u32(g, "llama.block_count", N_LAYER);
    gguf_set_val_u32(g, "llama.feed_forward_length", N_FF);
    gguf_set_val_u32(g, "llama.attention.head_count", N_HEAD);
    gguf_set_val_u32(g, "llama.attention.head_count_kv", N_HEAD_KV);
    gguf_set_val_f32(g, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    gguf_set_val_f32(g, "llama.rope.freq_base", 10000.0f);
    gguf_set_val_u32(g, "llama.rope.dimension_count", N_EMBD / N_HEAD);
    gguf_set_val_u32(g, "llama.vocab_size", (uint32_t) n_vocab);
    gguf_set_val_str(g, "tokenizer.ggml.model", "llama");
    std::vector<const char *> cstr;
    for (const auto & t : toks) cstr.push_back(t.c_str());
    gguf_set_arr_str(g, "tokenizer.ggml.tokens", cstr.data(), cstr.size());
    gguf_set_arr_data(g, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, scores.data(), scores.size());
    gguf_set_arr_data(g, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, types.data(), types.size());
    gguf_set_val_u32(g, "tokenizer.ggml.bos_token_id", 1);
    gguf_set_val_u32(g, "tokenizer.ggml.eos_token_id", 2);
    gguf_set_val_u32(g, "tokenizer.ggml.unknown_token_id", 0);

    const int kv = N_HEAD_KV * (N_EMBD / N_HEAD);
    struct Spec { std::string name; int64_t ne0, ne1; float std; };
    std::vector<Spec> specs = {{"token_embd.weight", N_EMBD, n_vocab, tied ? 0.03f : 0.25f}};
    const float out_std = 1.0f / std::sqrt(2.0f * N_LAYER);
    for (int i = 0; i < N_LAYER; ++i) {
        const std::string b = "blk." + std::to_string(i) + ".";
        specs.push_back({b + "attn_norm.weight", N_EMBD, 1, 0.0f});
        specs.push_back({b + "attn_q.weight", N_EMBD, N_EMBD, 1.0f / std::sqrt((float) N_EMBD)});
        specs.push_back({b + "attn_k.weight", N_EMBD, kv, 1.0f / std::sqrt((float) N_EMBD)});
        specs.push_back({b + "attn_v.weight", N_EMBD, kv, 1.0f / std::sqrt((float) N_EMBD)});
        specs.push_back({b + "attn_output.weight", N_EMBD, N_EMBD, out_std / std::sqrt((float) N_EMBD)});
        specs.push_back({b + "ffn_norm.weight", N_EMBD, 1, 0.0f});
        specs.push_back({b + "ffn_gate.weight", N_EMBD, N_FF, 1.0f / std::sqrt((float) N_EMBD)});
        specs.push_back({b + "ffn_up.weight", N_EMBD, N_FF, 1.0f / std::sqrt((float) N_EMBD)});
        specs.push_back({b + "ffn_down.weight", N_FF, N_EMBD, out_std / std::sqrt((float) N_FF)});
    }
    specs.push_back({"output_norm.weight", N_EMBD, 1, 0.0f});
    if (!tied) specs.push_back({"output.weight", N_EMBD, n_vocab, 2.0f / std::sqrt((float) N_EMBD)});

    size_t bytes = 0;
    for (const auto & s : specs) bytes += (size_t) s.ne0 * s.ne1 * sizeof(float) + ggml_tensor_overhead();
    ggml_init_params ip = {bytes + (1 << 20), nullptr, false};
    ggml_context * ctx = ggml_init(ip);
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (const auto & s : specs) {
        ggml_tensor * t = s.ne1 == 1 ? ggml_new_tensor_1d(ctx, GGML_TYPE_F32, s.ne0)
                                     : ggml_new_tensor_2d(ctx, GGML_TYPE_F32, s.ne0, s.ne1);
        ggml_set_name(t, s.name.c_str());
        float * d = (float *) t->data;
        for (int64_t k = 0; k < ggml_nelements(t); ++k) d[k] = s.std == 0.0f ? 1.0f : nd(rng) * s.std;
        gguf_add_tensor(g, t);
    }
    const bool ok = gguf_write_to_file(g, path.c_str(), false);
    gguf_free(g);
    ggml_free(ctx);
    return ok;
}

struct Shard {
    std::unique_ptr<dgr::ShardModel> model;
    std::unique_ptr<dgr::ShardContext> ctx;
};

bool open(Shard & s, const std::string & path, int a, int b) {
    std::string err;
    s.model = dgr::ShardModel::load({path, a, b, -1, true}, &err);
    if (!s.model) return false;
    dgr::ShardContextOptions co;
    co.n_ctx = 256;
    co.n_batch = 256;
    co.n_ubatch = 256;
    co.n_threads = 2;
    s.ctx = dgr::ShardContext::create(*s.model, co, &err);
    return (bool) s.ctx;
}

// Forward through the chain; returns the logits of every row (n x n_vocab).
bool forward(std::vector<Shard> & chain, const std::vector<llama_token> & toks, llama_pos pos0, std::vector<float> & out) {
    const int n = (int) toks.size();
    std::vector<float> rows;
    for (size_t i = 0; i < chain.size(); ++i) {
        dgr::ShardBatch b;
        if (i == 0) b.add_tokens(toks.data(), n, pos0, 0, true);
        else b.add_rows(rows.data(), n, N_EMBD, pos0, 0, true);
        std::fill(b.logits.begin(), b.logits.end(), 1);
        if (chain[i].ctx->decode(b) != dgr::DecodeStatus::ok) return false;
        if (!chain[i].model->is_tail()) {
            const float * o = chain[i].ctx->boundary_output();
            if (!o) return false;
            rows.assign(o, o + (size_t) n * N_EMBD);
        }
    }
    const int n_vocab = chain.back().model->n_vocab();
    out.clear();
    for (int r = 0; r < n; ++r) {
        const float * l = chain.back().ctx->logits_ith(r);
        if (!l) return false;
        out.insert(out.end(), l, l + n_vocab);
    }
    return true;
}

bool run(std::vector<Shard> & chain, const std::vector<llama_token> & prompt, int n_predict,
         std::vector<float> & prefill, std::vector<llama_token> & gen) {
    if (!forward(chain, prompt, 0, prefill)) return false;
    const int n_vocab = chain.back().model->n_vocab();
    std::vector<float> last(prefill.end() - n_vocab, prefill.end());
    for (int k = 0; k < n_predict; ++k) {
        const llama_token t = (llama_token) (std::max_element(last.begin(), last.end()) - last.begin());
        gen.push_back(t);
        if (!forward(chain, {t}, (llama_pos) (prompt.size() + k), last)) return false;
    }
    return true;
}

void check_model(const std::string & path, bool tied) {
    std::vector<Shard> whole(1);
    EXPECT(open(whole[0], path, 0, 0), "whole model did not load");
    if (!whole[0].model) return;
    EXPECT(whole[0].model->layer_start() == 0 && whole[0].model->layer_end() == N_LAYER, "whole range");
    EXPECT(whole[0].model->is_head() && whole[0].model->is_tail(), "whole roles");
    std::mt19937 rng(7);
    std::vector<llama_token> prompt;
    for (int i = 0; i < 24; ++i) prompt.push_back(3 + (llama_token) (rng() % (whole[0].model->n_vocab() - 3)));
    std::vector<float> ref;
    std::vector<llama_token> ref_gen;
    EXPECT(run(whole, prompt, 16, ref, ref_gen), "whole model run failed");
    whole.clear();

    const std::vector<std::vector<int>> splits = {{3}, {2, 5}, {1}, {5}};
    for (const auto & ends_in : splits) {
        std::vector<int> ends(ends_in);
        ends.push_back(N_LAYER);
        std::vector<Shard> chain(ends.size());
        int a = 0;
        for (size_t i = 0; i < ends.size(); ++i) {
            EXPECT(open(chain[i], path, a, ends[i]), "shard [%d, %d) did not load", a, ends[i]);
            if (!chain[i].model) return;
            const auto & m = *chain[i].model;
            EXPECT(m.layer_start() == a && m.layer_end() == ends[i], "shard [%d, %d) reports [%d, %d)", a, ends[i],
                   m.layer_start(), m.layer_end());
            EXPECT(m.is_head() == (a == 0) && m.is_tail() == (ends[i] == N_LAYER), "roles of [%d, %d)", a, ends[i]);
            if (a > 0) {
                dgr::ShardBatch tb;
                const llama_token t = 5;
                tb.add_tokens(&t, 1, 0, 0, true);
                EXPECT(chain[i].ctx->decode(tb) == dgr::DecodeStatus::invalid_argument,
                       "non-head [%d, %d) accepted token ids", a, ends[i]);
            }
            a = ends[i];
        }
        std::vector<float> got;
        std::vector<llama_token> gen;
        const bool ran = run(chain, prompt, 16, got, gen);
        EXPECT(ran, "split run failed (tied=%d, %zu shards)", tied, chain.size());
        EXPECT(got.size() == ref.size() && std::memcmp(got.data(), ref.data(), ref.size() * sizeof(float)) == 0,
               "prefill logits not bit-identical (tied=%d, split ending %d)", tied, ends.front());
        EXPECT(gen == ref_gen, "greedy tokens differ (tied=%d, split ending %d)", tied, ends.front());
    }
}

}  // namespace

int main() {
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    char dir[] = "/tmp/dgr-range-parity-XXXXXX";
    if (!mkdtemp(dir)) {
        std::perror("mkdtemp");
        return 1;
    }
    for (bool tied : {false, true}) {
        const std::string path = std::string(dir) + (tied ? "/tied.gguf" : "/untied.gguf");
        EXPECT(write_model(path, tied, tied ? 2u : 1u), "could not write %s", path.c_str());
        check_model(path, tied);
        std::remove(path.c_str());
    }
    rmdir(dir);
    llama_backend_free();
    if (g_failures) {
        std::fprintf(stderr, "range_parity_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("range_parity_test: ok (tied and untied; splits 3 | 2,5 | 1 | 5 of %d layers bit-identical)\n", N_LAYER);
    return 0;
}
