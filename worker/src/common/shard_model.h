// RAII wrapper over the patched llama.cpp API for one Shard: a model loaded by layer range
// [start, end) and a context that decodes token ids (head) or boundary rows (non-head) and
// returns boundary rows (non-tail) or logits (tail).
//
// The range and the endpoint roles are always read back from the loaded model
// (llama_model_layer_start/_end, llama_model_is_head/_is_tail), never taken from the caller.
#pragma once

#include "llama.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dgr {

// llama_decode results mapped as the style guide asks (gRPC status meaning).
enum class DecodeStatus {
    ok,
    resource_exhausted,  // 1: no KV slot for the batch
    aborted,             // 2: aborted by the abort callback
    invalid_argument,    // -1: invalid batch (e.g. token ids given to a non-head shard)
    internal,            // < -1 (or any other code)
};

DecodeStatus decode_status_from_code(int32_t code);
const char * decode_status_name(DecodeStatus status);

struct ShardModelOptions {
    std::string path;          // full GGUF or a `dgr gguf slice` file
    int32_t layer_start = 0;   // first layer held
    int32_t layer_end   = 0;   // one past the last layer held; <= 0 means n_layer
    int32_t n_gpu_layers = -1; // llama.cpp default: all layers on the accelerator if there is one
    bool use_mmap = true;
    // llama.cpp's "only load metadata and simulate memory allocations": nothing is read or
    // allocated; a context made from it reports what it would allocate (memory_use())
    bool no_alloc = false;
};

class ShardModel {
public:
    // Loads the model; on failure returns nullptr and sets *error (llama.cpp logs the reason).
    static std::unique_ptr<ShardModel> load(const ShardModelOptions & opts, std::string * error);

    ~ShardModel();
    ShardModel(const ShardModel &) = delete;
    ShardModel & operator=(const ShardModel &) = delete;

    llama_model * get() const { return model_; }
    const llama_vocab * vocab() const { return llama_model_get_vocab(model_); }

    // authoritative range and roles, as loaded
    int32_t layer_start() const { return llama_model_layer_start(model_); }
    int32_t layer_end()   const { return llama_model_layer_end(model_); }
    bool is_head() const { return llama_model_is_head(model_); }
    bool is_tail() const { return llama_model_is_tail(model_); }

    int32_t n_layer() const { return llama_model_n_layer(model_); }
    int32_t n_embd()  const { return llama_model_n_embd(model_); }
    int32_t n_vocab() const { return llama_vocab_n_tokens(vocab()); }

    // Token ids of `text` (head side); empty vector on failure.
    std::vector<llama_token> tokenize(const std::string & text, bool add_special) const;

private:
    explicit ShardModel(llama_model * model) : model_(model) {}
    llama_model * model_ = nullptr;
};

struct ShardContextOptions {
    uint32_t n_ctx     = 2048;
    uint32_t n_batch   = 512;
    uint32_t n_ubatch  = 512;
    uint32_t n_seq_max = 1;
    bool     kv_unified = false;  // one KV cell pool shared by all sequences
    int32_t  n_threads = 0;  // 0: llama.cpp default
    // most rows one decode call asks output for (0: n_batch, llama.cpp's default). The compute
    // and output buffers are sized for it: the output matrix of a 128k vocabulary over 512 rows
    // is 250 MiB that a worker asking one row per session never touches
    uint32_t n_outputs_max = 0;
};

// One decode call: either token ids (head) or boundary rows n_tokens x n_embd f32 (non-head),
// one position and one sequence id per row; `logits[i]` asks the tail for row i's logits.
struct ShardBatch {
    std::vector<llama_token>  tokens;
    std::vector<float>        embd;
    std::vector<llama_pos>    pos;
    std::vector<llama_seq_id> seq;
    std::vector<int8_t>       logits;

    int32_t n_tokens() const { return (int32_t) pos.size(); }

    // Appends rows for one sequence starting at position pos0.
    void add_tokens(const llama_token * ids, int32_t n, llama_pos pos0, llama_seq_id seq_id, bool logits_last);
    void add_rows(const float * rows, int32_t n, int32_t n_embd, llama_pos pos0, llama_seq_id seq_id, bool logits_last);
    void clear();
};

// Bytes a context and its model hold (llama.cpp's memory breakdown, summed over buffer types):
// the weights of the held range, the KV cache, and the compute scratch.
struct MemoryUse {
    uint64_t weights = 0;
    uint64_t kv = 0;
    uint64_t scratch = 0;
    // of the above: weights held in a host buffer type other than the CPU's default one (a
    // repacked copy, e.g. CPU_REPACK, made from the mapped file), and bytes on an accelerator
    uint64_t weights_copied = 0;
    uint64_t device = 0;
    uint64_t device_weights = 0, device_kv = 0, device_compute = 0;
};

// What one accelerator holds of a context's memory (its own buffers, not host buffers of its backend).
struct DeviceMemoryUse {
    uint64_t weights = 0, kv = 0, compute = 0;
};

class ShardContext {
public:
    static std::unique_ptr<ShardContext> create(const ShardModel & model, const ShardContextOptions & opts,
                                                std::string * error);

    ~ShardContext();
    ShardContext(const ShardContext &) = delete;
    ShardContext & operator=(const ShardContext &) = delete;

    llama_context * get() const { return ctx_; }
    const ShardModel & model() const { return model_; }

    // Decodes one batch. A non-tail shard fills boundary_output() with every row of the batch.
    // On a failure `*error` (if given) says why.
    DecodeStatus decode(const ShardBatch & batch, std::string * error = nullptr);

    // Non-tail: the unnormalized residual after the last owned layer, n_tokens x n_embd f32
    // rows in batch order, for the last decode. nullptr for a tail.
    const float * boundary_output() const;
    int32_t boundary_rows() const { return last_n_tokens_; }

    // Tail: logits of batch row i (a row that asked for logits); nullptr otherwise.
    const float * logits_ith(int32_t i) const;

    // Drops positions [p0, p1) of a sequence (p1 < 0: to the end); the whole sequence by default.
    bool seq_rm(llama_seq_id seq, llama_pos p0 = -1, llama_pos p1 = -1);
    void clear();

    MemoryUse memory_use() const;
    // llama.cpp's breakdown for the device `dev` alone
    DeviceMemoryUse memory_on(ggml_backend_dev_t dev) const;

private:
    ShardContext(const ShardModel & model, llama_context * ctx) : model_(model), ctx_(ctx) {}
    const ShardModel & model_;
    llama_context * ctx_ = nullptr;
    int32_t last_n_tokens_ = 0;
};

}  // namespace dgr
