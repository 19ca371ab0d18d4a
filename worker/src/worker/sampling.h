// The tail's sampling contract (dgr.shard.v1.SamplingParams): logit_bias, the penalties over the
// recent tokens, the grammar's mask, then greedy, or top_k -> top_p -> min_p -> temperature and a
// draw from a generator seeded once per (session, epoch). Log-probabilities are those of the raw
// logits, before any of it.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
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
    // penalties (llama.cpp's penalties sampler); repeat_penalty 1 = none
    float repeat_penalty = 1.0f;
    float frequency_penalty = 0.0f;
    float presence_penalty = 0.0f;
    uint32_t penalty_last_n = 0;
    std::vector<int32_t> penalty_prompt;  // the prompt's last tokens, oldest first
    bool penalties() const {
        return penalty_last_n > 0 && (repeat_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f);
    }
};

// The last n tokens a session's penalties count, and how often each occurs among them.
class TokenWindow {
public:
    void reset(uint32_t n, const std::vector<int32_t> & oldest_first);
    void push(int32_t token);
    const std::unordered_map<int32_t, int> & counts() const { return counts_; }
    size_t size() const { return q_.size(); }
private:
    uint32_t n_ = 0;
    std::deque<int32_t> q_;
    std::unordered_map<int32_t, int> counts_;
};

// A constraint on the tokens that may be chosen (the grammar of SamplingParams.grammar /
// json_schema, grammar.h).
class TokenConstraint {
public:
    virtual ~TokenConstraint() = default;
    // Sets the logit of every token the constraint does not allow next to -inf.
    virtual void mask(float * logits, int32_t n_vocab) = 0;
    // The chosen token (one the mask allowed) moves the constraint on.
    virtual void accept(int32_t token) = 0;
    // The end-of-generation token that ends an answer the constraint allows nothing for.
    virtual int32_t end_token() const = 0;
};

// What a session's sampling keeps from token to token besides its generator.
struct SamplerState {
    TokenWindow recent;                          // with SamplingConfig::penalties()
    std::unique_ptr<TokenConstraint> constraint; // with a grammar
    std::vector<float> scratch;                  // the logits the token is chosen from
    std::string key;                             // the SamplingParams it was set from (serialized)
    // A new contract (SamplingParams) from this step on: the window restarts from its prompt tokens.
    void reset(const SamplingConfig & c, std::unique_ptr<TokenConstraint> constraint_for_c);
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
    bool constraint_ended = false;  // the constraint allowed no token: `token` is its end token
};

// Chooses the next token from one row of logits. With `state`: the penalties count its window and
// its constraint masks the choice; the chosen token then enters both.
SampleResult sample_logits(const float * logits, int32_t n_vocab, const SamplingConfig & c, SamplingRng & rng,
                           SamplerState * state = nullptr);

// llama.cpp's penalties on `sel` (in place) for the tokens counted in `counts`.
void apply_penalties(float * sel, int32_t n_vocab, const SamplingConfig & c,
                     const std::unordered_map<int32_t, int> & counts);

}  // namespace dgr::worker
