// The tail's sampling (worker/sampling.h, worker/grammar.h) without a model: the penalties equal
// llama.cpp's own penalties sampler on the same logits and history; the window slides; a
// constraint's mask decides every choice, greedy or drawn, and the chosen token moves it on; a
// constraint that allows nothing ends the answer with its end token; a schema converts with
// llama.cpp's converter, and what cannot compile or nests too deep is refused with the field.
#include <cmath>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "check.h"
#include "llama.h"
#include "worker/grammar.h"
#include "worker/sampling.h"

using namespace dgr::worker;

namespace {

std::vector<float> random_logits(int32_t n, uint32_t seed) {
    std::mt19937 g(seed);
    std::normal_distribution<float> d(0.0f, 3.0f);
    std::vector<float> v((size_t) n);
    for (auto & x : v) x = d(g);
    return v;
}

// llama.cpp's penalties sampler over `history` (oldest first) applied to `logits`.
std::vector<float> llama_penalized(const std::vector<float> & logits, const std::vector<int32_t> & history,
                                   int32_t last_n, float repeat, float freq, float present) {
    llama_sampler * s = llama_sampler_init_penalties((int32_t) logits.size(), last_n, repeat, freq, present);
    for (int32_t t : history) llama_sampler_accept(s, t);
    std::vector<llama_token_data> cur;
    for (int32_t v = 0; v < (int32_t) logits.size(); ++v) cur.push_back({v, logits[(size_t) v], 0.0f});
    llama_token_data_array arr{cur.data(), cur.size(), -1, false};
    llama_sampler_apply(s, &arr);
    std::vector<float> out(logits.size());
    for (size_t i = 0; i < arr.size; ++i) out[(size_t) arr.data[i].id] = arr.data[i].logit;
    llama_sampler_free(s);
    return out;
}

// Allows the tokens in `allowed` only; records what it was told.
class SetConstraint : public TokenConstraint {
public:
    explicit SetConstraint(std::set<int32_t> allowed) : allowed_(std::move(allowed)) {}
    void mask(float * logits, int32_t n) override {
        ++masks;
        for (int32_t v = 0; v < n; ++v) {
            if (!allowed_.count(v)) logits[v] = -INFINITY;
        }
    }
    void accept(int32_t token) override { accepted.push_back(token); }
    int32_t end_token() const override { return 2; }
    int masks = 0;
    std::vector<int32_t> accepted;
private:
    std::set<int32_t> allowed_;
};

void test_penalties_equal_llama_cpp() {
    const int32_t n = 512;
    const std::vector<float> logits = random_logits(n, 7);
    // history with repeats, positive and negative logits among the counted tokens
    std::vector<int32_t> history;
    std::mt19937 g(11);
    for (int i = 0; i < 40; ++i) history.push_back((int32_t) (g() % 24));
    struct Case { uint32_t last_n; float repeat, freq, present; };
    for (const Case c : {Case{64, 1.3f, 0.0f, 0.0f}, Case{16, 1.0f, 0.7f, 0.0f}, Case{8, 1.0f, 0.0f, -1.5f},
                         Case{32, 0.8f, -0.5f, 2.0f}, Case{1, 2.0f, 2.0f, 2.0f}}) {
        SamplingConfig cfg;
        cfg.repeat_penalty = c.repeat;
        cfg.frequency_penalty = c.freq;
        cfg.presence_penalty = c.present;
        cfg.penalty_last_n = c.last_n;
        cfg.penalty_prompt = history;  // more than the window: the oldest fall out
        SamplerState st;
        st.reset(cfg, nullptr);
        CHECK(st.recent.size() == std::min<size_t>(c.last_n, history.size()), "window %zu", st.recent.size());
        std::vector<float> ours = logits;
        apply_penalties(ours.data(), n, cfg, st.recent.counts());
        const std::vector<float> ref = llama_penalized(logits, history, (int32_t) c.last_n, c.repeat, c.freq, c.present);
        int differ = 0;
        for (int32_t v = 0; v < n; ++v) differ += ours[(size_t) v] != ref[(size_t) v];
        CHECK(differ == 0, "last_n %u: %d logits differ from llama.cpp's penalties", c.last_n, differ);
    }
}

void test_window_slides_with_sampled_tokens() {
    SamplingConfig cfg;
    cfg.repeat_penalty = 1.5f;
    cfg.penalty_last_n = 3;
    cfg.penalty_prompt = {5, 5, 6};
    SamplerState st;
    st.reset(cfg, nullptr);
    CHECK(st.recent.counts().at(5) == 2 && st.recent.counts().at(6) == 1, "prompt counted");
    // greedy over logits where token 5 wins unpenalized, and 7 wins once 5 is penalized
    std::vector<float> logits(10, 0.0f);
    logits[5] = 3.0f;
    logits[7] = 2.5f;
    SamplingRng rng;
    SampleResult r = sample_logits(logits.data(), 10, cfg, rng, &st);
    CHECK(r.token == 7, "5 is penalized (3 / 1.5 = 2 < 2.5): got %d", r.token);
    // the window is now {5, 6, 7}: one 5 left, still penalized; 7 counted too
    CHECK(st.recent.counts().at(5) == 1 && st.recent.counts().at(7) == 1, "window slid");
    r = sample_logits(logits.data(), 10, cfg, rng, &st);  // 5 -> 2.0, 7 -> 2.5/1.5
    CHECK(r.token == 5, "7 now penalized more than 5: got %d", r.token);
    // without state (or with penalties off) the raw argmax
    SamplingRng rng2;
    CHECK(sample_logits(logits.data(), 10, cfg, rng2).token == 5, "no state: no penalties");
    SamplingConfig off = cfg;
    off.penalty_last_n = 0;
    SamplerState st2;
    st2.reset(off, nullptr);
    CHECK(st2.recent.size() == 0, "penalties off: nothing counted");
    CHECK(sample_logits(logits.data(), 10, off, rng2, &st2).token == 5, "penalties off");
}

void test_constraint_decides_every_choice() {
    const int32_t n = 300;
    for (bool stochastic : {false, true}) {
        SamplingConfig cfg;
        cfg.stochastic = stochastic;
        cfg.temperature = 2.0f;
        cfg.top_logprobs = stochastic ? 3 : 0;
        for (uint32_t seed = 1; seed <= 50; ++seed) {
            const std::vector<float> logits = random_logits(n, seed);
            SamplerState st;
            auto * k = new SetConstraint({3, 100, 299});
            st.reset(cfg, std::unique_ptr<TokenConstraint>(k));
            SamplingRng rng;
            rng.seed(seed);
            const SampleResult r = sample_logits(logits.data(), n, cfg, rng, &st);
            CHECK(r.token == 3 || r.token == 100 || r.token == 299, "stochastic %d seed %u: token %d not allowed",
                  (int) stochastic, seed, r.token);
            CHECK(k->masks == 1 && k->accepted.size() == 1 && k->accepted[0] == r.token, "accepted the choice");
            CHECK(!r.constraint_ended, "allowed tokens exist");
            if (!stochastic) {
                int32_t best = 3;
                for (int32_t t : {100, 299}) if (logits[(size_t) t] > logits[(size_t) best]) best = t;
                CHECK(r.token == best, "greedy: the best allowed token %d, got %d", best, r.token);
            } else {
                // logprobs stay those of the raw logits: the top alternative is the raw argmax
                int32_t arg = 0;
                for (int32_t v = 1; v < n; ++v) if (logits[(size_t) v] > logits[(size_t) arg]) arg = v;
                CHECK(!r.top.empty() && r.top[0].first == arg, "raw logprobs");
            }
        }
    }
    // nothing allowed: the answer ends with the constraint's end token, which is not accepted
    SamplingConfig cfg;
    SamplerState st;
    auto * k = new SetConstraint({});
    st.reset(cfg, std::unique_ptr<TokenConstraint>(k));
    SamplingRng rng;
    const std::vector<float> logits = random_logits(n, 3);
    const SampleResult r = sample_logits(logits.data(), n, cfg, rng, &st);
    CHECK(r.constraint_ended && r.token == 2, "ended with the end token: %d", r.token);
    CHECK(k->accepted.empty(), "the end token is not accepted");
}

void test_schema_conversion_and_refusals() {
    std::string err;
    const std::string g = Grammar::from_json_schema(R"({"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]})", &err);
    CHECK(err.empty() && g.find("root ::=") != std::string::npos, "converted: %s", err.c_str());
    err.clear();
    CHECK(Grammar::from_json_schema("{not json", &err).empty() && !err.empty(), "bad JSON refused");
    // no vocabulary (the fake model): refused naming the field
    std::string field;
    err.clear();
    CHECK(constraint_for(nullptr, "", R"({"type":"object"})", &err, &field) == nullptr && !err.empty(),
          "no vocabulary: refused");
    CHECK(field == "sampling.json_schema", "field %s", field.c_str());
    err.clear();
    CHECK(constraint_for(nullptr, "root ::= \"a\"", "", &err, &field) == nullptr && field == "sampling.grammar",
          "grammar field");
    // nothing asked: no constraint, no error
    err.clear();
    field.clear();
    CHECK(constraint_for(nullptr, "", "", &err, &field) == nullptr && err.empty(), "none asked");
    // too deep: refused before any parser runs (a string's brackets do not count)
    std::string deep;
    for (int i = 0; i < 65; ++i) deep += "{\"a\":";
    deep += "1";
    for (int i = 0; i < 65; ++i) deep += "}";
    err.clear();
    CHECK(constraint_for(nullptr, "", deep, &err, &field) == nullptr && err.find("65 levels") != std::string::npos,
          "deep schema: %s", err.c_str());
    std::string quoted = "{\"a\":\"" + std::string(200, '{') + "\"}";
    err.clear();
    constraint_for(nullptr, "", quoted, &err, &field);
    CHECK(err.find("levels") == std::string::npos, "brackets in a string are text: %s", err.c_str());
    std::string deep_g = "root ::= " + std::string(65, '(') + "\"a\"" + std::string(65, ')');
    err.clear();
    CHECK(constraint_for(nullptr, deep_g, "", &err, &field) == nullptr && err.find("65 levels") != std::string::npos,
          "deep grammar: %s", err.c_str());
}

}  // namespace

int main() {
    test_penalties_equal_llama_cpp();
    test_window_slides_with_sampled_tokens();
    test_constraint_decides_every_choice();
    test_schema_conversion_and_refusals();
    if (g_failures) std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    else std::printf("sampling_test: ok\n");
    return g_failures ? 1 : 0;
}
