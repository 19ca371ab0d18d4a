// A batch's compute and completion (docs/worker.md, Continuous batching): the queue's policy
// picks the steps (work_queue.h); one decode call; then each step's answer (sampled token or
// boundary rows), forwarded downstream on a chained session, and server-side generation's next
// row.
#include "worker/errors.h"
#include "worker/pipeline.h"
#include "worker/scheduler.h"

#include <algorithm>
#include <cstdio>
#include <map>

namespace dgr::worker {

namespace {
double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}
}  // namespace

void Scheduler::run_batch() {
    // one batch by the queue's policy (work_queue.h); on a pipelined route the chained DECODE
    // rows of one group, the group being a block of consecutive sequence ids (pipeline_block) so
    // that llama.cpp computes it as one ubatch (with one KV stream per sequence it splits a batch
    // at every gap in the ids)
    const uint32_t group = chain_group_rows();
    WorkQueue::Batch taken = queue_.take(opts_.max_batch_tokens, opts_.max_prefill_chunk_tokens, group, block_of(group));
    metrics_.pipeline_held_rows += taken.held_rows;
    std::vector<std::unique_ptr<Work>> items = std::move(taken.items);
    if (items.empty()) return;
    // rows ordered by sequence id: with one KV stream per sequence llama.cpp puts only
    // consecutive increasing sequence ids into one ubatch (split_equal, sequential)
    std::vector<Session *> sess(items.size());
    for (size_t k = 0; k < items.size(); ++k) sess[k] = table_.find(items[k]->session_id);
    {
        std::vector<size_t> order(items.size());
        for (size_t k = 0; k < order.size(); ++k) order[k] = k;
        std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return sess[a]->seq < sess[b]->seq; });
        std::vector<std::unique_ptr<Work>> sorted_items(items.size());
        std::vector<Session *> sorted_sess(items.size());
        for (size_t k = 0; k < order.size(); ++k) {
            sorted_items[k] = std::move(items[order[k]]);
            sorted_sess[k] = sess[order[k]];
        }
        items.swap(sorted_items);
        sess.swap(sorted_sess);
    }
    DecodeBatch batch;
    std::vector<int32_t> last_row(items.size());
    std::vector<int32_t> first_row(items.size());
    const uint32_t E = info_.n_embd;
    uint64_t n_prefill = 0, n_decode = 0;
    const auto now = Clock::now();
    for (size_t k = 0; k < items.size(); ++k) {
        Work & w = *items[k];
        Session * s = sess[k];
        first_row[k] = batch.n_rows();
        metrics_.queue_wait.observe(std::chrono::duration<double>(now - w.t_ready).count());
        for (uint32_t i = 0; i < w.n; ++i) {
            if (info_.head) {
                batch.tokens.push_back(w.tokens[i]);
            } else {
                batch.embd.insert(batch.embd.end(), w.rows.begin() + (size_t) i * E, w.rows.begin() + (size_t) (i + 1) * E);
            }
            batch.pos.push_back((int32_t) (w.pos0 + i));
            batch.seq.push_back(s->seq);
            // a non-tail shard's output is every row's boundary row (llama_get_embeddings_layer_inp,
            // which does not depend on these flags): it asks for no logits rows, else llama.cpp
            // sizes (and clears) its output buffer for n_vocab logits per row of the batch -- 250
            // MiB per 512 rows at a 128k vocabulary, never read (docs/memory.md)
            batch.output.push_back(info_.tail ? (i + 1 == w.n && w.sample) : 0);
        }
        last_row[k] = batch.n_rows() - 1;
        (w.decode ? n_decode : n_prefill) += w.n;
    }
    std::string err;
    const auto t_dec = Clock::now();
    const BackendStatus st = backend_.decode(batch, &err);
    const double took = seconds_since(t_dec);
    if (warm_) warm_->touch();  // the core stays awake for the next row (keep_warm.h)
    metrics_.busy_seconds = metrics_.busy_seconds.load() + took;
    if (n_prefill == 0) last_decode_s_ = last_decode_s_ > 0.0 ? 0.8 * last_decode_s_ + 0.2 * took : took;
    if (st != BackendStatus::ok) {
        std::fprintf(stderr, "dgr-worker: decode of %d rows failed: %s\n", batch.n_rows(), err.c_str());
        return fail_batch(items, sess, st, err);
    }
    metrics_.batches++;
    metrics_.batch_rows += (uint64_t) batch.n_rows();
    if (n_prefill == 0) {
        metrics_.decode_only_busy_seconds = metrics_.decode_only_busy_seconds.load() + took;
        metrics_.decode_only_batches++;
        metrics_.decode_only_rows += n_decode;
    }
    metrics_.batch_occupancy.observe((double) items.size());
    metrics_.prefill_tokens += n_prefill;
    metrics_.decode_tokens += n_decode;
    // pipelined route: the chained DECODE rows of this batch go down one per session stream; each
    // says how many went to the same next Shard (StepFrame.batch), so that Shard can compute them
    // as one batch too instead of starting on the first to arrive
    std::map<std::string, uint32_t> fwd_rows;
    for (size_t k = 0; k < items.size(); ++k) {
        if (sess[k]->chain.down && items[k]->decode && paced_by_pipeline(*sess[k])) {
            fwd_rows[sess[k]->chain.hop.endpoint()]++;
        }
    }
    if (!fwd_rows.empty()) fwd_batch_seq_++;
    for (size_t k = 0; k < items.size(); ++k) {
        Work & w = *items[k];
        Session & s = *sess[k];
        table_.commit(s, w.n, w.piece_more ? w.n : s.reserved);  // a piece frees its rows only
        s.decoding = w.decode;
        s.last_step = (int64_t) w.header.step();
        s.last_used = Clock::now();
        s.answered_at = s.last_used;
        // the step's next piece can be computed from now on (its queue wait starts here)
        if (w.piece_more) queue_.piece_ready(w.session_id, s.last_used);
        int32_t sampled = -1;
        bool finished = false;
        pb::SessionResponse r = answer_of(w, s, first_row[k], last_row[k], &sampled, &finished);
        if (s.chain.down) {  // chained route: the answer comes from downstream
            const auto it = w.decode && paced_by_pipeline(s) ? fwd_rows.find(s.chain.hop.endpoint()) : fwd_rows.end();
            forward(s, w, r, it == fwd_rows.end() ? 0 : it->second);
            continue;
        }
        move_step(s, StepState::idle);  // (a chained session's step moves on in forward())
        w.ticket.release();
        complete_step(s, std::move(r), w.header, w.t0, w.internal, sampled, finished);
    }
}

pb::SessionResponse Scheduler::answer_of(Work & w, Session & s, int32_t first_row, int32_t last_row, int32_t * sampled,
                                         bool * finished) {
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
        *r.mutable_boundary() = bundle::boundary_bundle(out.data(), w.n, E, opts_.max_fragment_bytes);
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
    SampleResult sr = sample_logits(logits, (int32_t) info_.n_vocab, s.sampling, s.rng);
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
    if (!s.sampling.ignore_eog && backend_.is_eog(sr.token)) {
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

void Scheduler::fail_batch(std::vector<std::unique_ptr<Work>> & items, std::vector<Session *> & sess, BackendStatus st,
                           const std::string & err) {
    for (size_t k = 0; k < items.size(); ++k) {
        Work & w = *items[k];
        Session & s = *sess[k];
        auto sink = s.sink;
        queue_.absorb_pieces(w);
        if (st == BackendStatus::resource_exhausted && !w.piece) {  // a piece: the route is ahead; drop
            move_step(s, StepState::idle);
            s.gen.active = false;
            table_.unreserve(s);
            backend_.seq_rm(s.seq, (int32_t) s.positions, -1);
            pb::ShardError e = make_error(pb::ERROR_REASON_OVER_BUDGET, "no KV slot for the batch: " + err);
            e.set_limit(opts_.kv_cells);
            w.ticket.release();
            if (sink) answer_error(*sink, w.header, e, w.t0, pb::CACHE_RESULT_UNSPECIFIED, w.internal);
        } else {
            drop_session(w.session_id, EndKind::released);
            w.ticket.release();  // this popped step (drop_session purges only queued ones)
            if (sink) {
                pb::SessionResponse r;
                *r.mutable_header() = w.header;
                const pb::ShardError e = make_error(pb::ERROR_REASON_INTERNAL, "decode failed: " + err, true);
                *r.mutable_error() = e;
                sink->deliver(std::move(r), true, status_with(grpc::StatusCode::INTERNAL, "decode failed", e));
            }
        }
    }
}

}  // namespace dgr::worker
