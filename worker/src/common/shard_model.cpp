#include "common/shard_model.h"

#include "ggml-backend.h"

#include <cstdio>
#include <cstring>
#include <map>

// Staging API of the pinned llama.cpp (src/llama-ext.h, which is not on the public include path).
// A non-tail shard reads its boundary output as the input of layer `layer_end`. The exact
// signatures are listed in upstream/assumptions.toml, so a change fails `dgr patches verify`.
LLAMA_API void    llama_set_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid, bool value);
LLAMA_API float * llama_get_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid);
// Memory per buffer type: weights held, context (KV), compute scratch.
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

namespace dgr {

DecodeStatus decode_status_from_code(int32_t code) {
    switch (code) {
        case 0:  return DecodeStatus::ok;
        case 1:  return DecodeStatus::resource_exhausted;
        case 2:  return DecodeStatus::aborted;
        case -1: return DecodeStatus::invalid_argument;
        default: return DecodeStatus::internal;
    }
}

const char * decode_status_name(DecodeStatus status) {
    switch (status) {
        case DecodeStatus::ok:                 return "OK";
        case DecodeStatus::resource_exhausted: return "RESOURCE_EXHAUSTED";
        case DecodeStatus::aborted:            return "ABORTED";
        case DecodeStatus::invalid_argument:   return "INVALID_ARGUMENT";
        case DecodeStatus::internal:           return "INTERNAL";
    }
    return "INTERNAL";
}

// ---------------------------------------------------------------------------- ShardModel

std::unique_ptr<ShardModel> ShardModel::load(const ShardModelOptions & opts, std::string * error) {
    llama_model_params mp = llama_model_default_params();
    mp.layer_start  = opts.layer_start;
    mp.layer_end    = opts.layer_end;
    mp.n_gpu_layers = opts.n_gpu_layers;
    if (!opts.use_mmap || opts.no_alloc) {
        mp.load_mode = LLAMA_LOAD_MODE_NONE;
    }
    mp.no_alloc = opts.no_alloc;
    llama_model * model = llama_model_load_from_file(opts.path.c_str(), mp);
    if (model == nullptr) {
        if (error) {
            char buf[512];
            std::snprintf(buf, sizeof(buf), "%s: error: failed to load %s layers [%d, %d) (see the llama.cpp log)",
                          __func__, opts.path.c_str(), opts.layer_start, opts.layer_end);
            *error = buf;
        }
        return nullptr;
    }
    return std::unique_ptr<ShardModel>(new ShardModel(model));
}

ShardModel::~ShardModel() {
    if (model_) {
        llama_model_free(model_);
    }
}

std::vector<llama_token> ShardModel::tokenize(const std::string & text, bool add_special) const {
    const int32_t n = -llama_tokenize(vocab(), text.c_str(), (int32_t) text.size(), nullptr, 0, add_special, true);
    if (n <= 0) {
        return {};
    }
    std::vector<llama_token> out(n);
    if (llama_tokenize(vocab(), text.c_str(), (int32_t) text.size(), out.data(), n, add_special, true) < 0) {
        return {};
    }
    return out;
}

// ---------------------------------------------------------------------------- ShardBatch

void ShardBatch::add_tokens(const llama_token * ids, int32_t n, llama_pos pos0, llama_seq_id seq_id, bool logits_last) {
    for (int32_t i = 0; i < n; ++i) {
        tokens.push_back(ids[i]);
        pos.push_back(pos0 + i);
        seq.push_back(seq_id);
        logits.push_back(logits_last && i == n - 1 ? 1 : 0);
    }
}

void ShardBatch::add_rows(const float * rows, int32_t n, int32_t n_embd, llama_pos pos0, llama_seq_id seq_id,
                          bool logits_last) {
    embd.insert(embd.end(), rows, rows + (size_t) n * n_embd);
    for (int32_t i = 0; i < n; ++i) {
        pos.push_back(pos0 + i);
        seq.push_back(seq_id);
        logits.push_back(logits_last && i == n - 1 ? 1 : 0);
    }
}

void ShardBatch::clear() {
    tokens.clear();
    embd.clear();
    pos.clear();
    seq.clear();
    logits.clear();
}

// ---------------------------------------------------------------------------- ShardContext

std::unique_ptr<ShardContext> ShardContext::create(const ShardModel & model, const ShardContextOptions & opts,
                                                   std::string * error) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx     = opts.n_ctx;
    cp.n_batch   = opts.n_batch;
    cp.n_ubatch  = opts.n_ubatch;
    cp.n_seq_max = opts.n_seq_max;
    cp.kv_unified = opts.kv_unified;
    cp.n_outputs_max = opts.n_outputs_max;
    if (opts.n_threads > 0) {
        cp.n_threads       = opts.n_threads;
        cp.n_threads_batch = opts.n_threads;
    }
    llama_context * ctx = llama_init_from_model(model.get(), cp);
    if (ctx == nullptr) {
        if (error) {
            *error = "ShardContext::create: error: llama_init_from_model failed (see the llama.cpp log)";
        }
        return nullptr;
    }
    if (!model.is_tail()) {
        // every row of every batch leaves through the seam: the input of layer `layer_end`
        llama_set_embeddings_layer_inp(ctx, (uint32_t) model.layer_end(), true);
    }
    return std::unique_ptr<ShardContext>(new ShardContext(model, ctx));
}

ShardContext::~ShardContext() {
    if (ctx_) {
        llama_free(ctx_);
    }
}

DecodeStatus ShardContext::decode(const ShardBatch & b, std::string * error) {
    const int32_t n = b.n_tokens();
    auto fail = [&](DecodeStatus st, const std::string & why) {
        if (error) {
            *error = "ShardContext::decode: error: " + why;
        }
        return st;
    };
    if (n <= 0) {
        return fail(DecodeStatus::invalid_argument, "empty batch");
    }
    if ((int32_t) b.seq.size() != n || (int32_t) b.logits.size() != n) {
        return fail(DecodeStatus::invalid_argument, "batch arrays differ in length");
    }
    const bool by_token = !b.tokens.empty();
    if (by_token == !b.embd.empty()) {
        return fail(DecodeStatus::invalid_argument, "a batch carries either token ids or boundary rows");
    }
    if (by_token && (int32_t) b.tokens.size() != n) {
        return fail(DecodeStatus::invalid_argument, "token count differs from position count");
    }
    if (!by_token && b.embd.size() != (size_t) n * model_.n_embd()) {
        return fail(DecodeStatus::invalid_argument, "boundary rows are not n_tokens x n_embd");
    }
    if (by_token && !model_.is_head()) {
        return fail(DecodeStatus::invalid_argument, "token ids given to a shard that does not hold the token embedding");
    }

    std::vector<int32_t> n_seq_id(n, 1);
    std::vector<llama_seq_id> seq_store(b.seq);
    std::vector<llama_seq_id *> seq_ptrs(n);
    for (int32_t i = 0; i < n; ++i) {
        seq_ptrs[i] = &seq_store[i];
    }
    llama_batch batch = {
        /*.n_tokens =*/ n,
        /*.token    =*/ by_token ? const_cast<llama_token *>(b.tokens.data()) : nullptr,
        /*.embd     =*/ by_token ? nullptr : const_cast<float *>(b.embd.data()),
        /*.pos      =*/ const_cast<llama_pos *>(b.pos.data()),
        /*.n_seq_id =*/ n_seq_id.data(),
        /*.seq_id   =*/ seq_ptrs.data(),
        /*.logits   =*/ const_cast<int8_t *>(b.logits.data()),
    };
    const int32_t rc = llama_decode(ctx_, batch);
    const DecodeStatus st = decode_status_from_code(rc);
    if (st != DecodeStatus::ok) {
        last_n_tokens_ = 0;
        return fail(st, std::string("llama_decode returned ") + std::to_string(rc) + " (" + decode_status_name(st) + ")");
    }
    last_n_tokens_ = n;
    return DecodeStatus::ok;
}

MemoryUse ShardContext::memory_use() const {
    MemoryUse m;
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_buffer_type_t cpu_default = cpu ? ggml_backend_dev_buffer_type(cpu) : nullptr;
    for (const auto & kv : llama_get_memory_breakdown(ctx_)) {
        m.weights += kv.second.model;
        m.kv += kv.second.context;
        m.scratch += kv.second.compute;
        // the CPU's extra buffer types (CPU_REPACK, AMX) say they are not "host" (their layout
        // is not plain), but they are host memory: their device is the CPU
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(kv.first);
        const bool on_cpu = ggml_backend_buft_is_host(kv.first) || !dev || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
        if (!on_cpu) {
            m.device += kv.second.total();
            m.device_weights += kv.second.model;
            m.device_kv += kv.second.context;
            m.device_compute += kv.second.compute;
        } else if (kv.first != cpu_default) {
            m.weights_copied += kv.second.model;
        }
    }
    return m;
}

DeviceMemoryUse ShardContext::memory_on(ggml_backend_dev_t dev) const {
    DeviceMemoryUse m;
    if (!dev) return m;
    for (const auto & kv : llama_get_memory_breakdown(ctx_)) {
        if (ggml_backend_buft_is_host(kv.first) || ggml_backend_buft_get_device(kv.first) != dev) continue;
        m.weights += kv.second.model;
        m.kv += kv.second.context;
        m.compute += kv.second.compute;
    }
    return m;
}

const float * ShardContext::boundary_output() const {
    if (model_.is_tail() || last_n_tokens_ == 0) {
        return nullptr;
    }
    return llama_get_embeddings_layer_inp(ctx_, (uint32_t) model_.layer_end());
}

const float * ShardContext::logits_ith(int32_t i) const {
    if (!model_.is_tail()) {
        return nullptr;
    }
    return llama_get_logits_ith(ctx_, i);
}

bool ShardContext::seq_rm(llama_seq_id seq, llama_pos p0, llama_pos p1) {
    return llama_memory_seq_rm(llama_get_memory(ctx_), seq, p0, p1);
}

void ShardContext::clear() {
    llama_memory_clear(llama_get_memory(ctx_), true);
    last_n_tokens_ = 0;
}

}  // namespace dgr
