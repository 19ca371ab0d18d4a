#include "worker/llama_backend.h"

#include "common/checksum.h"

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
std::string meta(const llama_model * m, const char * key) {
    char buf[256];
    const int n = llama_model_meta_val_str(m, key, buf, sizeof buf);
    return n < 0 ? std::string() : std::string(buf);
}
}  // namespace

uint32_t llama_outputs_max(uint32_t n_seq_max) { return std::max<uint32_t>(1, n_seq_max); }

uint64_t LlamaBackend::kv_bytes_per_cell(const llama_model * model) {
    // layer-filtered KV: only the owned layers hold cells
    const uint64_t n_layer = (uint64_t) std::max(1, llama_model_layer_end(model) - llama_model_layer_start(model));
    const uint64_t n_head = (uint64_t) std::max(1, llama_model_n_head(model));
    const uint64_t n_head_kv = (uint64_t) std::max(1, llama_model_n_head_kv(model));
    const uint64_t head_dim = (uint64_t) llama_model_n_embd(model) / n_head;
    return 2 /*K,V*/ * 2 /*f16*/ * n_layer * n_head_kv * head_dim;
}

uint64_t llama_kv_bytes_per_cell(const std::string & path, uint32_t layer_start, uint32_t layer_end,
                                 std::string * error) {
    dgr::ShardModelOptions mo;
    mo.path = path;
    mo.layer_start = (int32_t) layer_start;
    mo.layer_end = (int32_t) layer_end;
    mo.n_gpu_layers = 0;
    mo.no_alloc = true;  // hyperparameters only: nothing is read or allocated
    auto m = dgr::ShardModel::load(mo, error);
    if (!m) {
        if (error && error->empty()) *error = "cannot load model '" + path + "'";
        return 0;
    }
    return LlamaBackend::kv_bytes_per_cell(m->get());
}

std::unique_ptr<LlamaBackend> LlamaBackend::create(const LlamaBackendOptions & o, std::string * error) {
    std::unique_ptr<LlamaBackend> b(new LlamaBackend());
    dgr::ShardModelOptions mo;
    mo.path = o.path;
    mo.layer_start = (int32_t) o.layer_start;
    mo.layer_end = (int32_t) o.layer_end;
    mo.n_gpu_layers = o.n_gpu_layers;
    b->model_ = dgr::ShardModel::load(mo, error);
    if (!b->model_) {
        if (error && error->empty()) *error = "cannot load model '" + o.path + "' (see the llama.cpp log above)";
        return nullptr;
    }
    const dgr::ShardModel & m = *b->model_;
    b->vocab_ = m.vocab();
    dgr::ShardContextOptions co;
    co.n_ctx = o.kv_cells;
    co.n_batch = o.max_batch_tokens;
    co.n_ubatch = o.max_batch_tokens;
    co.n_seq_max = o.n_seq_max;
    co.kv_unified = o.kv_unified;
    co.n_threads = o.threads;
    co.n_outputs_max = llama_outputs_max(o.n_seq_max);
    b->ctx_ = dgr::ShardContext::create(m, co, error);
    if (!b->ctx_) {
        if (error && error->empty()) {
            *error = "cannot create a llama context (n_ctx " + std::to_string(o.kv_cells) + ", n_seq_max " +
                     std::to_string(o.n_seq_max) + ")";
        }
        return nullptr;
    }
    llama_context * ctx = b->ctx_->get();

    BackendInfo & in = b->info_;
    in.architecture = meta(m.get(), "general.architecture");
    in.n_layer = (uint32_t) m.n_layer();
    in.layer_start = (uint32_t) m.layer_start();
    in.layer_end = (uint32_t) m.layer_end();
    in.head = m.is_head();
    in.tail = m.is_tail();
    in.n_embd = (uint32_t) m.n_embd();
    in.n_vocab = (uint32_t) m.n_vocab();
    in.kv_cells = llama_n_ctx(ctx);
    in.max_batch_tokens = llama_n_batch(ctx);
    in.n_seq_max = llama_n_seq_max(ctx);
    const dgr::MemoryUse mem = b->ctx_->memory_use();
    in.weight_bytes = mem.weights;
    in.kv_bytes = mem.kv;
    in.scratch_bytes = mem.scratch;
    struct stat st{};
    ::stat(o.path.c_str(), &st);
    uint64_t h = kFnv1aOffset;
    h = fnv1a64_text(in.architecture, h);
    h = fnv1a64_text(std::to_string(in.n_layer) + "/" + std::to_string(in.n_embd) + "/" + std::to_string(in.n_vocab) + "/" +
                    std::to_string((long long) st.st_size),
                h);
    char desc[256];
    llama_model_desc(m.get(), desc, sizeof desc);
    h = fnv1a64_text(desc, h);
    in.artifact_id = o.artifact_id.empty() ? "unverified-" + hex64(h) : o.artifact_id;
    in.fingerprint = o.fingerprint.empty() ? "unverified-" + hex64(fnv1a64_text("recipe", h)) : o.fingerprint;
    in.recipe_json = std::string("{\"architecture\":\"") + in.architecture + "\",\"model\":\"" + desc +
                     "\",\"identity\":\"" + (o.fingerprint.empty() ? "unverified" : "given") + "\"}";
    return b;
}

LlamaBackend::~LlamaBackend() {
    ctx_.reset();
    model_.reset();
}

BackendStatus LlamaBackend::decode(const DecodeBatch & in, std::string * error) {
    const int32_t n = in.n_rows();
    if (n <= 0 || (uint32_t) n > info_.max_batch_tokens) {
        if (error) *error = "batch size out of range";
        return BackendStatus::invalid_argument;
    }
    batch_.tokens.assign(in.tokens.begin(), in.tokens.end());
    batch_.embd.assign(in.embd.begin(), in.embd.end());
    batch_.pos.assign(in.pos.begin(), in.pos.end());
    batch_.seq.assign(in.seq.begin(), in.seq.end());
    // a non-tail shard returns every row's boundary output regardless of the flags
    batch_.logits.assign(in.output.begin(), in.output.end());
    // the context is sized for n_seq_max output rows per call (llama.cpp aborts beyond it)
    int64_t n_out = 0;
    for (const int8_t o : in.output) n_out += o != 0;
    if (n_out > (int64_t) llama_outputs_max(info_.n_seq_max)) {
        if (error) *error = "batch asks output for " + std::to_string(n_out) + " rows, more than one per sequence";
        return BackendStatus::invalid_argument;
    }
    const dgr::DecodeStatus st = ctx_->decode(batch_, error);
    switch (st) {
        case dgr::DecodeStatus::ok: return BackendStatus::ok;
        case dgr::DecodeStatus::resource_exhausted: return BackendStatus::resource_exhausted;
        case dgr::DecodeStatus::aborted: return BackendStatus::aborted;
        case dgr::DecodeStatus::invalid_argument: return BackendStatus::invalid_argument;
        default: return BackendStatus::internal;
    }
}

const float * LlamaBackend::output_row(int32_t i) {
    if (info_.tail) return ctx_->logits_ith(i);
    const float * rows = ctx_->boundary_output();
    return rows ? rows + (size_t) i * info_.n_embd : nullptr;
}

void LlamaBackend::seq_rm(int32_t seq, int32_t p0, int32_t p1) {
    if (!ctx_->seq_rm(seq, p0, p1)) {
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
