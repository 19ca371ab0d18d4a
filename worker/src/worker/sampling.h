// The tail's sampling contract (dgr.shard.v1.SamplingParams): logit_bias, then greedy, or
// top_k -> top_p -> min_p -> temperature and a draw from a generator seeded once per (session,
// epoch). Log-probabilities are those of the raw logits, before any of it.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dgr::worker {

// Built from a SamplingParams that bundle::check_sampling accepted (the one validator).
struct SamplingConfig {
    bool stochastic = false;
    float temperature = 1.0f;
    uint32_t top_k = 0;
    float top_p = 0.0f;
    float min_p = 0.0f;
    uint64_t seed = 0;
    uint32_t top_logprobs = 0;
    bool ignore_eog = false;
    std::vector<int32_t> stop_token_ids;
    std::vector<std::pair<int32_t, float>> logit_bias;  // added to the logits the token is chosen from
};

// splitmix64-based generator: portable, so a seed gives the same tokens on every platform.
class SamplingRng {
public:
    void seed(uint64_t s) { state_ = s; }
    double uniform();  // [0, 1)
private:
    uint64_t state_ = 0;
};

struct SampleResult {
    int32_t token = -1;
    float logprob = 0.0f;
    std::vector<std::pair<int32_t, float>> top;  // most likely first
};

SampleResult sample_logits(const float * logits, int32_t n_vocab, const SamplingConfig & c, SamplingRng & rng);

}  // namespace dgr::worker
