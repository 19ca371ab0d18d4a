#include "worker/fake_backend.h"

#include "common/checksum.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <thread>

namespace dgr::worker {

FakeBackend::FakeBackend(const FakeModelOptions & o) : delay_ms_(o.decode_delay_ms), row_delay_us_(o.row_delay_us) {
    info_.architecture = "fake";
    info_.n_layer = o.n_layer;
    info_.layer_start = o.layer_start;
    info_.layer_end = o.layer_end ? o.layer_end : o.n_layer;
    info_.head = info_.layer_start == 0;
    info_.tail = info_.layer_end == o.n_layer;
    info_.n_embd = o.n_embd;
    info_.n_vocab = o.n_vocab;
    info_.kv_cells = o.kv_cells;
    info_.max_batch_tokens = o.max_batch_tokens;
    info_.n_seq_max = o.n_seq_max;
    info_.kv_bytes = (uint64_t) o.kv_cells * 4 * o.n_embd * (info_.layer_end - info_.layer_start);  // see serve.cpp
    uint64_t h = kFnv1aOffset;
    for (uint64_t v : {(uint64_t) o.n_layer, (uint64_t) o.n_embd, (uint64_t) o.n_vocab}) {
        const unsigned char le[8] = {(unsigned char) v,         (unsigned char) (v >> 8),  (unsigned char) (v >> 16),
                                     (unsigned char) (v >> 24), (unsigned char) (v >> 32), (unsigned char) (v >> 40),
                                     (unsigned char) (v >> 48), (unsigned char) (v >> 56)};
        h = fnv1a64(le, sizeof le, h);
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long) h);
    info_.artifact_id = std::string("fake-artifact-") + buf;
    // The fingerprint covers what must match along a route: the model, not the range.
    info_.fingerprint = std::string("fake-") + buf;
    std::snprintf(buf, sizeof buf, "%u", o.n_layer);
    info_.recipe_json = std::string("{\"architecture\":\"fake\",\"n_layer\":") + buf + "}";
    cum_.assign(o.n_seq_max, std::vector<std::vector<float>>(info_.layer_end - info_.layer_start));
    held_.assign(o.n_seq_max, 0);
}

BackendStatus FakeBackend::decode(const DecodeBatch & b, std::string * error) {
    const int32_t n = b.n_rows();
    const uint32_t E = info_.n_embd;
    const uint32_t L = info_.layer_end - info_.layer_start;
    if (n <= 0 || (uint32_t) n > info_.max_batch_tokens) {
        if (error) *error = "batch size out of range";
        return BackendStatus::invalid_argument;
    }
    if (cells_used_ + (uint64_t) n > info_.kv_cells) {
        if (error) *error = "no KV cells for the batch";
        return BackendStatus::resource_exhausted;
    }
    // validate positions: each row must continue its sequence
    std::vector<uint32_t> next = held_;
    for (int32_t i = 0; i < n; ++i) {
        const int32_t s = b.seq[i];
        if (s < 0 || (uint32_t) s >= info_.n_seq_max || b.pos[i] != (int32_t) next[s]) {
            if (error) *error = "row position does not continue its sequence";
            return BackendStatus::invalid_argument;
        }
        next[s]++;
    }
    if (delay_ms_ || row_delay_us_) {
        std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_) +
                                    std::chrono::microseconds((uint64_t) row_delay_us_ * (uint64_t) b.n_rows()));
    }
    std::vector<float> h((size_t) n * E);
    for (int32_t i = 0; i < n; ++i) {
        if (info_.head) {
            const uint64_t t = (uint32_t) b.tokens[i];
            for (uint32_t j = 0; j < E; ++j) {
                h[(size_t) i * E + j] = (float) ((t * 2654435761ULL + j * 40503ULL) % 1000) / 1000.0f - 0.5f;
            }
        } else {
            for (uint32_t j = 0; j < E; ++j) h[(size_t) i * E + j] = b.embd[(size_t) i * E + j];
        }
    }
    for (uint32_t l = 0; l < L; ++l) {
        for (int32_t i = 0; i < n; ++i) {
            auto & cum = cum_[b.seq[i]][l];
            const uint32_t p = (uint32_t) b.pos[i];
            cum.resize((size_t) (p + 1) * E);
            float * row = &h[(size_t) i * E];
            for (uint32_t j = 0; j < E; ++j) {
                cum[(size_t) p * E + j] = row[j] + (p ? cum[(size_t) (p - 1) * E + j] : 0.0f);
            }
            std::vector<float> add(E);
            for (uint32_t j = 0; j < E; ++j) {
                const float mean = cum[(size_t) p * E + (j + 1) % E] / (float) (p + 1);
                add[j] = 0.5f * std::tanh(mean + 0.1f * (float) (info_.layer_start + l + 1));
            }
            for (uint32_t j = 0; j < E; ++j) row[j] += add[j];
        }
    }
    for (int32_t i = 0; i < n; ++i) {
        held_[b.seq[i]] = (uint32_t) b.pos[i] + 1;
    }
    cells_used_ += (uint64_t) n;
    if (info_.tail) {
        out_width_ = info_.n_vocab;
        out_.assign((size_t) n * out_width_, 0.0f);
        for (int32_t i = 0; i < n; ++i) {
            if (!b.output[i]) continue;
            for (uint32_t v = 0; v < info_.n_vocab; ++v) {
                float acc = 0.0f;
                for (uint32_t j = 0; j < E; ++j) {
                    acc += std::sin(h[(size_t) i * E + j] * (37.0f + 11.0f * (float) j) + (float) v * (0.7f + 0.13f * (float) j));
                }
                out_[(size_t) i * out_width_ + v] = 4.0f * acc;
            }
        }
    } else {
        out_width_ = E;
        out_ = h;
    }
    return BackendStatus::ok;
}

const float * FakeBackend::output_row(int32_t i) {
    return out_.data() + (size_t) i * out_width_;
}

void FakeBackend::seq_rm(int32_t seq, int32_t p0, int32_t p1) {
    if (seq < 0 || (uint32_t) seq >= info_.n_seq_max) return;
    const uint32_t held = held_[seq];
    const uint32_t from = p0 < 0 ? 0 : std::min<uint32_t>((uint32_t) p0, held);
    if (p1 >= 0 && (uint32_t) p1 < held) return;  // only suffix removal is meaningful here
    for (auto & cum : cum_[seq]) cum.resize((size_t) from * info_.n_embd);
    cells_used_ -= held - from;
    held_[seq] = from;
}

bool FakeBackend::tokenize(const std::string & text, bool add_special, bool /*parse_special*/,
                           std::vector<int32_t> * out, std::string * /*error*/) {
    out->clear();
    if (add_special) out->push_back(kBos);
    for (unsigned char c : text) out->push_back(c);
    return true;
}

std::string FakeBackend::piece(int32_t t, bool unparse_special) {
    if (t >= 0 && t < 256) return std::string(1, (char) t);
    if (!unparse_special) return "";
    return "<|t" + std::to_string(t) + "|>";
}

std::string FakeBackend::detokenize(const std::vector<int32_t> & tokens, bool remove_special,
                                    bool unparse_special) {
    std::string s;
    for (int32_t t : tokens) {
        if (remove_special && (t == kBos || t == kEog)) continue;
        s += piece(t, unparse_special);
    }
    return s;
}

}  // namespace dgr::worker
