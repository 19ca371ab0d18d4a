#include "worker/llama_backend.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sys/stat.h>

namespace dgr::worker {

namespace {
std::string hex64(uint64_t v) {
    char b[24];
    std::snprintf(b, sizeof b, "%016llx", (unsigned long long) v);
    return b;
}
uint64_t fnv(uint64_t h, const std::string & s) {
    for (unsigned char c : s) { h ^= c; h *= 1099511628211ULL; }
    return h;
}
std::string meta(const llama_model * m, const char * key) {
    char buf[256];
    const int n = llama_model_meta_val_str(m, key, buf, sizeof buf);
    return n < 0 ? std::string() : std::string(buf);
}
}  // namespace

uint64_t LlamaBackend::kv_bytes_per_cell(const llama_model * model) {
    const uint64_t n_layer = (uint64_t) llama_model_n_layer(model);
    const uint64_t n_head = (uint64_t) std::max(1, llama_model_n_head(model));
    const uint64_t n_head_kv = (uint64_t) std::max(1, llama_model_n_head_kv(model));
    const uint64_t head_dim = (uint64_t) llama_model_n_embd(model) / n_head;
    return 2 /*K,V*/ * 2 /*f16*/ * n_layer * n_head_kv * head_dim;
}

llama_model * llama_backend_peek_model(const std::string & path, std::string * error) {
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * m = llama_model_load_from_file(path.c_str(), mp);
    if (!m && error) *error = "cannot load model '" + path + "'";
    return m;
}

std::unique_ptr<LlamaBackend> LlamaBackend::create(const LlamaBackendOptions & o, std::string * error) {
    std::unique_ptr<LlamaBackend> b(new LlamaBackend());
    llama_model_params mp = llama_model_default_params();
    if (o.n_gpu_layers >= 0) mp.n_gpu_layers = o.n_gpu_layers;
    b->model_ = llama_model_load_from_file(o.path.c_str(), mp);
    if (!b->model_) {
        *error = "cannot load model '" + o.path + "' (see the llama.cpp log above)";
        return nullptr;
    }
    const uint32_t n_layer = (uint32_t) llama_model_n_layer(b->model_);
    const uint32_t end = o.layer_end ? o.layer_end : n_layer;
    if (o.layer_start != 0 || end != n_layer) {
        *error = "this build serves whole models only (range 0:" + std::to_string(n_layer) +
                 "); layer ranges need the range patches (shard_model)";
        return nullptr;
    }
    b->vocab_ = llama_model_get_vocab(b->model_);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = o.kv_cells;
    cp.n_batch = o.max_batch_tokens;
    cp.n_ubatch = o.max_batch_tokens;
    cp.n_seq_max = o.n_seq_max;
    cp.kv_unified = o.kv_unified;
    cp.no_perf = true;
    if (o.threads > 0) {
        cp.n_threads = o.threads;
        cp.n_threads_batch = o.threads;
    }
    b->ctx_ = llama_init_from_model(b->model_, cp);
    if (!b->ctx_) {
        *error = "cannot create a llama context (n_ctx " + std::to_string(o.kv_cells) + ", n_seq_max " +
                 std::to_string(o.n_seq_max) + ")";
        return nullptr;
    }
    b->batch_ = llama_batch_init((int32_t) o.max_batch_tokens, 0, 1);
    b->batch_init_ = true;

    BackendInfo & in = b->info_;
    in.architecture = meta(b->model_, "general.architecture");
    in.n_layer = n_layer;
    in.layer_start = 0;
    in.layer_end = n_layer;
    in.head = true;
    in.tail = true;
    in.n_embd = (uint32_t) llama_model_n_embd(b->model_);
    in.n_vocab = (uint32_t) llama_vocab_n_tokens(b->vocab_);
    in.kv_cells = llama_n_ctx(b->ctx_);
    in.max_batch_tokens = llama_n_batch(b->ctx_);
    in.n_seq_max = llama_n_seq_max(b->ctx_);
    struct stat st{};
    ::stat(o.path.c_str(), &st);
    uint64_t h = 1469598103934665603ULL;
    h = fnv(h, in.architecture);
    h = fnv(h, std::to_string(n_layer) + "/" + std::to_string(in.n_embd) + "/" + std::to_string(in.n_vocab) + "/" +
                   std::to_string((long long) st.st_size));
    char desc[256];
    llama_model_desc(b->model_, desc, sizeof desc);
    h = fnv(h, desc);
    in.artifact_id = o.artifact_id.empty() ? "unverified-" + hex64(h) : o.artifact_id;
    in.fingerprint = o.fingerprint.empty() ? "unverified-" + hex64(fnv(h, "recipe")) : o.fingerprint;
    in.recipe_json = std::string("{\"architecture\":\"") + in.architecture + "\",\"model\":\"" + desc +
                     "\",\"identity\":\"" + (o.fingerprint.empty() ? "unverified" : "given") + "\"}";
    return b;
}

LlamaBackend::~LlamaBackend() {
    if (batch_init_) llama_batch_free(batch_);
    if (ctx_) llama_free(ctx_);
    if (model_) llama_model_free(model_);
}

BackendStatus LlamaBackend::decode(const DecodeBatch & in, std::string * error) {
    const int32_t n = in.n_rows();
    if (n <= 0 || (uint32_t) n > info_.max_batch_tokens) {
        if (error) *error = "batch size out of range";
        return BackendStatus::invalid_argument;
    }
    batch_.n_tokens = n;
    for (int32_t i = 0; i < n; ++i) {
        batch_.token[i] = in.tokens[i];
        batch_.pos[i] = in.pos[i];
        batch_.n_seq_id[i] = 1;
        batch_.seq_id[i][0] = in.seq[i];
        batch_.logits[i] = in.output[i];
    }
    const int32_t rc = llama_decode(ctx_, batch_);
    if (rc == 0) return BackendStatus::ok;
    if (error) *error = "llama_decode returned " + std::to_string(rc);
    std::fprintf(stderr, "%s: error: llama_decode returned %d\n", __func__, rc);
    if (rc == 1) return BackendStatus::resource_exhausted;
    if (rc == 2) return BackendStatus::aborted;
    if (rc == -1) return BackendStatus::invalid_argument;
    return BackendStatus::internal;
}

const float * LlamaBackend::output_row(int32_t i) { return llama_get_logits_ith(ctx_, i); }

void LlamaBackend::seq_rm(int32_t seq, int32_t p0, int32_t p1) {
    if (!llama_memory_seq_rm(llama_get_memory(ctx_), seq, p0, p1)) {
        std::fprintf(stderr, "%s: error: llama_memory_seq_rm(%d, %d, %d) failed\n", __func__, seq, p0, p1);
    }
}

bool LlamaBackend::tokenize(const std::string & text, bool add_special, bool parse_special, std::vector<int32_t> * out,
                            std::string * error) {
    out->resize(text.size() + 8);
    int32_t n = llama_tokenize(vocab_, text.data(), (int32_t) text.size(), out->data(), (int32_t) out->size(),
                               add_special, parse_special);
    if (n < 0) {
        out->resize((size_t) -n);
        n = llama_tokenize(vocab_, text.data(), (int32_t) text.size(), out->data(), (int32_t) out->size(), add_special,
                           parse_special);
    }
    if (n < 0) {
        if (error) *error = "llama_tokenize failed";
        return false;
    }
    out->resize((size_t) n);
    return true;
}

std::string LlamaBackend::piece(int32_t token, bool unparse_special) {
    char buf[256];
    const int32_t n = llama_token_to_piece(vocab_, token, buf, sizeof buf, 0, unparse_special);
    return n < 0 ? std::string() : std::string(buf, (size_t) n);
}

std::string LlamaBackend::detokenize(const std::vector<int32_t> & tokens, bool remove_special, bool unparse_special) {
    std::string s(tokens.size() * 8 + 16, '\0');
    int32_t n = llama_detokenize(vocab_, tokens.data(), (int32_t) tokens.size(), s.data(), (int32_t) s.size(),
                                 remove_special, unparse_special);
    if (n < 0) {
        s.resize((size_t) -n);
        n = llama_detokenize(vocab_, tokens.data(), (int32_t) tokens.size(), s.data(), (int32_t) s.size(),
                             remove_special, unparse_special);
    }
    s.resize(n < 0 ? 0 : (size_t) n);
    return s;
}

bool LlamaBackend::is_eog(int32_t token) const { return llama_vocab_is_eog(vocab_, token); }

}  // namespace dgr::worker
