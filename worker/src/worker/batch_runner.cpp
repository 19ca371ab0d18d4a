// One batch's compute (batch_runner.h).
#include "worker/batch_runner.h"

#include "common/bundle.h"

#include <algorithm>

namespace dgr::worker {

BatchRunner::Ran BatchRunner::run(std::vector<WorkPtr> items, const FindSession & find) {
    Ran ran;
    ran.steps.resize(items.size());
    for (size_t k = 0; k < items.size(); ++k) {
        ran.steps[k].session = find(items[k]->session_id);
        ran.steps[k].work = std::move(items[k]);
    }
    std::stable_sort(ran.steps.begin(), ran.steps.end(),
                     [](const Step & a, const Step & b) { return a.session->seq < b.session->seq; });
    DecodeBatch batch;
    const uint32_t E = info_.n_embd;
    for (Step & st : ran.steps) {
        const Work & w = *st.work;
        st.first_row = batch.n_rows();
        for (uint32_t i = 0; i < w.n; ++i) {
            if (info_.head) {
                batch.tokens.push_back(w.tokens[i]);
            } else {
                batch.embd.insert(batch.embd.end(), w.rows.begin() + (size_t) i * E, w.rows.begin() + (size_t) (i + 1) * E);
            }
            batch.pos.push_back((int32_t) (w.pos0 + i));
            batch.seq.push_back(st.session->seq);
            // a non-tail shard's output is every row's boundary row (llama_get_embeddings_layer_inp,
            // which does not depend on these flags): it asks for no logits rows, else llama.cpp
            // sizes (and clears) its output buffer for n_vocab logits per row of the batch -- 250
            // MiB per 512 rows at a 128k vocabulary, never read (docs/memory.md)
            batch.output.push_back(info_.tail ? (i + 1 == w.n && w.sample) : 0);
        }
        st.last_row = batch.n_rows() - 1;
        (w.decode ? ran.decode_rows : ran.prefill_rows) += w.n;
    }
    ran.rows = batch.n_rows();
    const auto t0 = Clock::now();
    ran.status = backend_.decode(batch, &ran.error);
    ran.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    return ran;
}

pb::SessionResponse BatchRunner::answer(const Step & step, int32_t * sampled, bool * finished) {
    const Work & w = *step.work;
    Session & s = *step.session;
    const int32_t first_row = step.first_row, last_row = step.last_row;
    *sampled = -1;
    *finished = false;

    pb::SessionResponse r;
    *r.mutable_header() = w.header;
    r.mutable_header()->set_cached_positions(s.positions);
    auto * ck = r.mutable_header()->mutable_payload_checksum();
    ck->set_algorithm(pb::CHECKSUM_ALGORITHM_CRC32);
    if (!info_.tail) {
        const uint32_t E = info_.n_embd;
        std::vector<float> out((size_t) w.n * E);
        for (uint32_t i = 0; i < w.n; ++i) {
            const float * row = backend_.output_row(first_row + (int32_t) i);
            std::copy(row, row + E, out.begin() + (size_t) i * E);
        }
        *r.mutable_boundary() = bundle::boundary_bundle(out.data(), w.n, E, max_fragment_bytes_);
        // one tensor: the payload (its fragments in order) is the tensor's bytes
        ck->set_value(r.boundary().tensors(0).checksum().value());
        return r;
    }
    auto * tail = r.mutable_tail();
    if (!w.sample) {
        ck->set_value(0);
        return r;
    }
    const float * logits = backend_.output_row(last_row);
    SampleResult sr = sample_logits(logits, (int32_t) info_.n_vocab, s.sampling, s.rng, &s.sampler);
    auto * t = tail->add_tokens();
    t->set_token_id(sr.token);
    t->set_position(w.pos0 + w.n);
    if (s.sampling.top_logprobs > 0) {
        t->set_logprob(sr.logprob);
        for (auto & p : sr.top) {
            auto * tl = t->add_top_logprobs();
            tl->set_token_id(p.first);
            tl->set_logprob(p.second);
        }
    }
    // ignore_eog: EOG tokens are ordinary tokens; explicit stop tokens still finish
    if (sr.constraint_ended || (!s.sampling.ignore_eog && backend_.is_eog(sr.token))) {
        t->set_finish_reason(pb::FINISH_REASON_EOG);
    } else if (std::find(s.sampling.stop_token_ids.begin(), s.sampling.stop_token_ids.end(), sr.token) !=
               s.sampling.stop_token_ids.end()) {
        t->set_finish_reason(pb::FINISH_REASON_STOP_TOKEN);
    }
    ck->set_value(bundle::tokens_crc(&sr.token, 1));
    *sampled = sr.token;
    *finished = t->finish_reason() != pb::FINISH_REASON_UNSPECIFIED;
    return r;
}

}  // namespace dgr::worker
