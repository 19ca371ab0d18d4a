// --fake-model: a deterministic arithmetic "model" with the shape of a dense transformer, so
// the service, sessions, batching, limits and failures are testable in seconds without GGUF.
//
// Rows: embedding e(t)[j] = frac((t*2654435761 + j*40503) mod 1000)/1000 - 0.5 (head).
// Layer l keeps, per sequence, the prefix sums of the rows it has seen (its "KV"), and adds
// 0.5*tanh(mean_{p'<=p} h[p'][(j+1) mod E] + 0.1*(l+1)) to h[p][j]. The tail's logits are
// 4*sum_j sin(h[j]*(37 + 11j) + v*(0.7 + 0.13j)) (high frequency, so tokens vary). A token therefore depends on every earlier token
// of its own sequence only, batched or not, and a range split gives the whole model's numbers.
// Vocabulary: ids 0..255 are bytes, 256 = BOS, 257 = EOG, the rest are "<|tN|>" specials.
#pragma once

#include "worker/backend.h"
#include "worker/option_table.h"

#include <vector>

namespace dgr::worker {

struct FakeModelOptions {
    uint32_t n_layer = default_u32(Opt::kNLayer);
    uint32_t layer_start = 0;
    uint32_t layer_end = 0;  // 0: n_layer
    uint32_t n_embd = default_u32(Opt::kNEmbd);
    uint32_t n_vocab = default_u32(Opt::kNVocab);
    uint32_t kv_cells = 4096;
    uint32_t n_seq_max = default_u32(Opt::kMaxSessions);
    uint32_t max_batch_tokens = default_u32(Opt::kMaxBatchTokens);
    // sleep per decode call (tests of queues, drain, crashes)
    uint32_t decode_delay_ms = default_u32(Opt::kFakeDelayMs);
    // and per row (a compute cost that grows with the batch: pipelining)
    uint32_t row_delay_us = default_u32(Opt::kFakeRowDelayUs);
};

class FakeBackend : public ModelBackend {
public:
    explicit FakeBackend(const FakeModelOptions & opts);
    const BackendInfo & info() const override { return info_; }
    BackendStatus decode(const DecodeBatch & batch, std::string * error) override;
    const float * output_row(int32_t i) override;
    void seq_rm(int32_t seq, int32_t p0, int32_t p1) override;
    bool tokenize(const std::string & text, bool add_special, bool parse_special,
                  std::vector<int32_t> * out, std::string * error) override;
    std::string piece(int32_t token, bool unparse_special) override;
    std::string detokenize(const std::vector<int32_t> & tokens, bool remove_special,
                           bool unparse_special) override;
    bool is_eog(int32_t token) const override { return token == kEog; }
    std::string chat_template() const override { return "chatml"; }  // llama.cpp built-in

    static constexpr int32_t kBos = 256;
    static constexpr int32_t kEog = 257;

protected:
    BackendInfo & mutable_info() override { return info_; }

private:
    BackendInfo info_;
    uint32_t delay_ms_ = 0;
    uint32_t row_delay_us_ = 0;
    // cum_[seq][layer - start] holds prefix sums, one n_embd row per cached position
    std::vector<std::vector<std::vector<float>>> cum_;
    std::vector<uint32_t> held_;  // positions held per sequence
    std::vector<float> out_;      // output rows of the last decode
    uint32_t out_width_ = 0;
    uint64_t cells_used_ = 0;
};

}  // namespace dgr::worker
