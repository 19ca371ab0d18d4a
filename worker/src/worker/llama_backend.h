// The llama.cpp backend over the patched llama.cpp (common/shard_model.h): a model loaded by
// layer range (a full GGUF with --layers, or a slice) and one context holding one llama
// sequence per session (n_seq_max = max sessions, n_ctx = the KV cells budget), by default each
// in its own KV stream (see LlamaBackendOptions::kv_unified). Heads take token ids, other shards
// boundary rows; tails return logits, other shards the residual leaving their last layer. The
// range and roles are read back from the loaded model.
#pragma once

#include "common/shard_model.h"
#include "worker/backend.h"
#include "worker/option_table.h"

#include "llama.h"

#include <memory>
#include <string>

namespace dgr::worker {

struct LlamaBackendOptions {
    std::string path;
    uint32_t layer_start = 0;
    uint32_t layer_end = 0;  // 0: n_layer
    int32_t threads = default_i32(Opt::kThreads);  // 0: llama.cpp default (serve and probe resolve 0 first)
    uint32_t kv_cells = 4096;
    uint32_t n_seq_max = default_u32(Opt::kMaxSessions);
    uint32_t max_batch_tokens = default_u32(Opt::kMaxBatchTokens);
    int32_t n_gpu_layers = default_i32(Opt::kNGpuLayers);
    // false (default): one KV stream per sequence (llama kv_unified = false): a session's cells
    // never interleave with another's, so batched results equal unbatched ones bit for bit and
    // each session holds kv_cells / n_seq_max cells. true: one shared cell pool.
    bool kv_unified = false;
    std::string artifact_id;  // override (serve computes the real one first, common/identity.h; empty: unverified-…)
    std::string fingerprint;  // override
};

class LlamaBackend : public ModelBackend {
public:
    static std::unique_ptr<LlamaBackend> create(const LlamaBackendOptions & opts, std::string * error);
    ~LlamaBackend() override;

    const BackendInfo & info() const override { return info_; }
    BackendStatus decode(const DecodeBatch & batch, std::string * error) override;
    const float * output_row(int32_t i) override;
    void seq_rm(int32_t seq, int32_t p0, int32_t p1) override;
    bool tokenize(const std::string & text, bool add_special, bool parse_special,
                  std::vector<int32_t> * out, std::string * error) override;
    std::string piece(int32_t token, bool unparse_special) override;
    std::string detokenize(const std::vector<int32_t> & tokens, bool remove_special,
                           bool unparse_special) override;
    bool is_eog(int32_t token) const override;
    const llama_vocab * vocab() const override { return vocab_; }
    std::string chat_template() const override;  // chat_template.cpp

    // bytes one KV cell takes (K + V, f16, every owned layer): sizes --kv-budget-mb
    static uint64_t kv_bytes_per_cell(const llama_model * model);

protected:
    BackendInfo & mutable_info() override { return info_; }

private:
    LlamaBackend() = default;
    BackendInfo info_;
    std::unique_ptr<dgr::ShardModel> model_;
    std::unique_ptr<dgr::ShardContext> ctx_;  // destroyed before model_
    const llama_vocab * vocab_ = nullptr;
    dgr::ShardBatch batch_;
};

// Output rows a decode call may ask for: the tail samples the last row of each session's step,
// at most one per sequence; non-tail shards ask for none (their output is the boundary rows).
uint32_t llama_outputs_max(uint32_t n_seq_max);

// Bytes one KV cell of the given range takes (loads the model briefly); 0 + *error on failure.
uint64_t llama_kv_bytes_per_cell(const std::string & path, uint32_t layer_start, uint32_t layer_end,
                                 std::string * error);

}  // namespace dgr::worker
