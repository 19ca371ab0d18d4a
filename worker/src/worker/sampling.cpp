#include "worker/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace dgr::worker {

double SamplingRng::uniform() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (double) (z >> 11) * (1.0 / 9007199254740992.0);
}

void TokenWindow::reset(uint32_t n, const std::vector<int32_t> & oldest_first) {
    n_ = n;
    q_.clear();
    counts_.clear();
    for (int32_t t : oldest_first) push(t);
}

void TokenWindow::push(int32_t token) {
    if (n_ == 0) return;
    q_.push_back(token);
    counts_[token]++;
    while (q_.size() > n_) {
        auto it = counts_.find(q_.front());
        if (--it->second == 0) counts_.erase(it);
        q_.pop_front();
    }
}

void SamplerState::reset(const SamplingConfig & c, std::unique_ptr<TokenConstraint> constraint_for_c) {
    recent.reset(c.penalties() ? c.penalty_last_n : 0, c.penalty_prompt);
    constraint = std::move(constraint_for_c);
}

void apply_penalties(float * sel, int32_t n_vocab, const SamplingConfig & c,
                     const std::unordered_map<int32_t, int> & counts) {
    // as llama.cpp's llama_sampler_penalties (src/llama-sampler.cpp), on every token counted
    for (const auto & [id, count] : counts) {
        if (id < 0 || id >= n_vocab || count <= 0) continue;
        float & l = sel[id];
        if (l <= 0) {
            l *= c.repeat_penalty;
        } else {
            l /= c.repeat_penalty;
        }
        l -= float(count) * c.frequency_penalty + float(count > 0) * c.presence_penalty;
    }
}

SampleResult sample_logits(const float * logits, int32_t n_vocab, const SamplingConfig & c, SamplingRng & rng,
                           SamplerState * state) {
    SampleResult r;
    const bool penalize = state && c.penalties() && state->recent.size() > 0;
    TokenConstraint * constraint = state ? state->constraint.get() : nullptr;
    // the token is chosen from `sel`: the raw logits, or a copy with logit_bias added, the
    // penalties applied and the constraint's mask set
    const float * raw = logits;
    std::vector<float> local;
    std::vector<float> & buf = state ? state->scratch : local;
    const float * sel = logits;
    if (!c.logit_bias.empty() || penalize || constraint) {
        buf.assign(logits, logits + n_vocab);
        for (const auto & [id, b] : c.logit_bias) {
            if (id >= 0 && id < n_vocab) buf[id] += b;  // (checked at intake; kept safe here)
        }
        if (penalize) apply_penalties(buf.data(), n_vocab, c, state->recent.counts());
        if (constraint) constraint->mask(buf.data(), n_vocab);
        sel = buf.data();
    }
    auto chosen = [&](SampleResult & res) -> SampleResult & {
        if (!state) return res;
        if (constraint && !res.constraint_ended) constraint->accept(res.token);
        state->recent.push(res.token);
        return res;
    };
    float mx = -INFINITY;
    int32_t arg = 0;
    bool any = false;
    for (int32_t v = 0; v < n_vocab; ++v) {
        if (sel[v] > mx) { mx = sel[v]; arg = v; any = true; }
    }
    if (constraint && !any) {
        // nothing is allowed (a grammar this vocabulary cannot complete): the answer ends here
        r.token = constraint->end_token();
        r.constraint_ended = true;
    }
    if (!r.constraint_ended && !c.stochastic && c.top_logprobs == 0) {
        r.token = arg;  // plain greedy: no softmax needed (logprob is only reported with top_logprobs)
        return chosen(r);
    }
    // log-softmax of the raw logits (for logprobs)
    float raw_mx = -INFINITY;
    for (int32_t v = 0; v < n_vocab; ++v) raw_mx = std::max(raw_mx, raw[v]);
    double z = 0.0;
    for (int32_t v = 0; v < n_vocab; ++v) z += std::exp((double) raw[v] - raw_mx);
    const double lse = raw_mx + std::log(z);

    if (r.constraint_ended) {
        // (token set above)
    } else if (!c.stochastic) {
        r.token = arg;
    } else {
        std::vector<int32_t> idx(n_vocab);
        std::iota(idx.begin(), idx.end(), 0);
        // ties broken by the lower id, so the order is total and deterministic
        auto better = [&](int32_t a, int32_t b) { return sel[a] > sel[b] || (sel[a] == sel[b] && a < b); };
        size_t keep = (size_t) n_vocab;
        if (c.top_k > 0 && c.top_k < keep) keep = c.top_k;
        std::partial_sort(idx.begin(), idx.begin() + keep, idx.end(), better);
        idx.resize(keep);
        // a token masked out (-inf) is never drawn, not even by rounding at the end of the draw
        while (keep > 1 && !(sel[idx[keep - 1]] > -INFINITY)) --keep;
        std::vector<double> p(keep);
        double s = 0.0;
        for (size_t i = 0; i < keep; ++i) { p[i] = std::exp((double) sel[idx[i]] - mx); s += p[i]; }
        for (auto & x : p) x /= s;
        if (c.top_p > 0.0f && c.top_p < 1.0f) {
            double cum = 0.0;
            size_t k = 0;
            while (k < keep) { cum += p[k++]; if (cum >= c.top_p) break; }
            keep = std::max<size_t>(k, 1);
        }
        if (c.min_p > 0.0f) {
            size_t k = 1;
            while (k < keep && p[k] >= c.min_p * p[0]) ++k;
            keep = k;
        }
        // temperature on the kept logits
        std::vector<double> w(keep);
        double ws = 0.0;
        for (size_t i = 0; i < keep; ++i) {
            w[i] = std::exp(((double) sel[idx[i]] - mx) / c.temperature);
            ws += w[i];
        }
        double u = rng.uniform() * ws;
        size_t pick = keep - 1;
        for (size_t i = 0; i < keep; ++i) {
            if (u < w[i]) { pick = i; break; }
            u -= w[i];
        }
        r.token = idx[pick];
    }
    r.logprob = (float) (logits[r.token] - lse);
    if (c.top_logprobs > 0) {
        const size_t k = std::min<size_t>(c.top_logprobs, (size_t) n_vocab);
        std::vector<int32_t> idx(n_vocab);
        std::iota(idx.begin(), idx.end(), 0);
        std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
            return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
        });
        for (size_t i = 0; i < k; ++i) r.top.emplace_back(idx[i], (float) (logits[idx[i]] - lse));
    }
    return chosen(r);
}

}  // namespace dgr::worker
