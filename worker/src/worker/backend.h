// The model a Shard worker executes, seen by the scheduler through one small interface, so that
// the same service, session table, batching and admission run over a deterministic fake model
// (tests) and over llama.cpp (production).
#pragma once

#include "worker/device_class.h"

#include <cstdint>
#include <string>
#include <vector>

struct llama_vocab;

namespace dgr::worker {

// What the range measured it costs on this host (capability_probe.h), as GetCapability reports it.
struct MeasuredCost {
    bool present = false;
    bool from_cache = false;
    struct Batch { uint32_t rows = 0; double step_s = 0.0, step_no_output_s = 0.0; };
    std::vector<Batch> decode;
    double prompt_s_per_token = 0.0, prompt_no_output_s_per_token = 0.0;
    double duty = 1.0;
    uint32_t threads = 0;
    double probe_seconds = 0.0;
};

// What the loaded model is; served by GetCapability and checked against every frame.
struct BackendInfo {
    std::string architecture;
    std::string artifact_id;
    std::string recipe_json;
    std::string fingerprint;
    uint32_t n_layer = 0;
    uint32_t layer_start = 0;  // [layer_start, layer_end)
    uint32_t layer_end = 0;
    bool head = false;
    bool tail = false;
    uint32_t n_embd = 0;
    uint32_t n_vocab = 0;
    uint32_t kv_cells = 0;        // cells of the context shared by all sequences
    uint32_t max_batch_tokens = 0;
    uint32_t n_seq_max = 0;       // sequences the context was created for
    // memory held (llama.cpp's breakdown): weights of the range, KV cache, compute scratch
    uint64_t weight_bytes = 0;
    uint64_t kv_bytes = 0;
    uint64_t scratch_bytes = 0;
    // host memory predicted before loading (worker/memory_plan.h; 0: no prediction, fake model)
    uint64_t predicted_weight_bytes = 0, predicted_kv_bytes = 0, predicted_compute_bytes = 0,
             predicted_runtime_bytes = 0;
    uint64_t predicted_total() const {
        return predicted_weight_bytes + predicted_kv_bytes + predicted_compute_bytes + predicted_runtime_bytes;
    }
    MeasuredCost measured;  // --probe-budget-s (not present: no probe)
    ComputeDevice device;   // where the range computes (device_info.h; the fake's: --fake-device-*)
};

// One decode call: one row per (sequence, position); head rows carry token ids, other rows
// n_embd floats of boundary input. `output[i]` asks for row i's output (tail: logits;
// non-tail shards return every row's boundary output regardless).
struct DecodeBatch {
    std::vector<int32_t> tokens;
    std::vector<float> embd;
    std::vector<int32_t> pos;
    std::vector<int32_t> seq;
    std::vector<int8_t> output;
    int32_t n_rows() const { return (int32_t) pos.size(); }
    void clear() { tokens.clear(); embd.clear(); pos.clear(); seq.clear(); output.clear(); }
};

// llama_decode results, mapped to the protocol's status codes (docs/worker.md).
enum class BackendStatus { ok, resource_exhausted, aborted, invalid_argument, internal };

class ModelBackend {
public:
    virtual ~ModelBackend() = default;
    virtual const BackendInfo & info() const = 0;
    // Identity computed outside (dgr.recipe via `dgr worker serve`): non-empty values replace
    // the backend's own.
    void set_identity(const std::string & fingerprint, const std::string & artifact_id, const std::string & recipe_json) {
        BackendInfo & in = mutable_info();
        if (!fingerprint.empty()) in.fingerprint = fingerprint;
        if (!artifact_id.empty()) in.artifact_id = artifact_id;
        if (!recipe_json.empty()) in.recipe_json = recipe_json;
    }
    void set_predicted_memory(uint64_t weights, uint64_t kv, uint64_t compute, uint64_t runtime) {
        BackendInfo & in = mutable_info();
        in.predicted_weight_bytes = weights;
        in.predicted_kv_bytes = kv;
        in.predicted_compute_bytes = compute;
        in.predicted_runtime_bytes = runtime;
    }
    void set_measured(const MeasuredCost & m) { mutable_info().measured = m; }
    void set_device(const ComputeDevice & d) { mutable_info().device = d; }
    // Runs one batch; on failure `*error` says why and nothing of the batch is kept.
    virtual BackendStatus decode(const DecodeBatch & batch, std::string * error) = 0;
    // After a successful decode: tail -> logits of row i (n_vocab floats; only rows that asked);
    // non-tail -> boundary output of row i (n_embd floats, the residual leaving the shard).
    virtual const float * output_row(int32_t i) = 0;
    // Drops positions [p0, p1) of a sequence (p1 < 0: to the end).
    virtual void seq_rm(int32_t seq, int32_t p0, int32_t p1) = 0;
    virtual bool tokenize(const std::string & text, bool add_special, bool parse_special,
                          std::vector<int32_t> * out, std::string * error) = 0;
    virtual std::string piece(int32_t token, bool unparse_special) = 0;
    virtual std::string detokenize(const std::vector<int32_t> & tokens, bool remove_special,
                                   bool unparse_special) = 0;
    virtual bool is_eog(int32_t token) const = 0;
    // The model's vocabulary (a grammar constrains tokens over it); nullptr: none (the fake model).
    virtual const llama_vocab * vocab() const { return nullptr; }
    // The chat template (GGUF tokenizer.chat_template or a built-in name); empty: none.
    virtual std::string chat_template() const { return {}; }

protected:
    virtual BackendInfo & mutable_info() = 0;
};

}  // namespace dgr::worker
