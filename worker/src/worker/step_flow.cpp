// Steps after admission, on the scheduler thread (step_flow.h): batches computed and
// completed, steps forwarded down a chained route and answered from there, server-side
// generation's next rows.
#include "worker/step_flow.h"

#include "worker/errors.h"

#include <cstdio>
#include <map>

namespace dgr::worker {

void StepFlow::run_batch() {
    // one batch by the queue's policy (work_queue.h); on a pipelined route the chained DECODE
    // rows of one group, the group being a block of consecutive sequence ids (pipeline_block) so
    // that llama.cpp computes it as one ubatch (with one KV stream per sequence it splits a batch
    // at every gap in the ids)
    const uint32_t group = st_.pacer.group_rows();
    WorkQueue::Batch taken = st_.queue.take(st_.opts.max_batch_tokens, st_.opts.max_prefill_chunk_tokens, group, st_.pacer.block_of(group));
    st_.metrics.pipeline_held_rows += taken.held_rows;
    if (taken.items.empty()) return;
    const auto now = Clock::now();
    for (const WorkPtr & w : taken.items) {
        st_.metrics.queue_wait.observe(std::chrono::duration<double>(now - w->t_ready).count());
    }
    BatchRunner::Ran ran = st_.runner.run(std::move(taken.items), [this](const std::string & id) { return st_.table.find(id); });
    const double took = ran.seconds;
    const uint64_t n_prefill = ran.prefill_rows, n_decode = ran.decode_rows;
    if (st_.warm) st_.warm->touch();  // the core stays awake for the next row (keep_warm.h)
    st_.metrics.busy_seconds = st_.metrics.busy_seconds.load() + took;
    st_.pacer.observe_batch(took, n_prefill == 0);
    if (ran.status != BackendStatus::ok) {
        std::fprintf(stderr, "dgr-worker: decode of %d rows failed: %s\n", ran.rows, ran.error.c_str());
        return fail_batch(ran.steps, ran.status, ran.error);
    }
    st_.metrics.batches++;
    st_.metrics.batch_rows += (uint64_t) ran.rows;
    if (n_prefill == 0) {
        st_.metrics.decode_only_busy_seconds = st_.metrics.decode_only_busy_seconds.load() + took;
        st_.metrics.decode_only_batches++;
        st_.metrics.decode_only_rows += n_decode;
    }
    st_.metrics.batch_occupancy.observe((double) ran.steps.size());
    st_.metrics.prefill_tokens += n_prefill;
    st_.metrics.decode_tokens += n_decode;
    // pipelined route: the chained DECODE rows of this batch go down one per session stream; each
    // says how many went to the same next Shard (StepFrame.batch), so that Shard can compute them
    // as one batch too instead of starting on the first to arrive
    std::map<std::string, uint32_t> fwd_rows;
    for (const BatchRunner::Step & st : ran.steps) {
        if (st.session->chain.down && st.work->decode && st_.pacer.paced_by_pipeline(*st.session)) {
            fwd_rows[st.session->chain.hop.endpoint()]++;
        }
    }
    if (!fwd_rows.empty()) st_.fwd_batch_seq++;
    for (BatchRunner::Step & st : ran.steps) {
        Work & w = *st.work;
        Session & s = *st.session;
        st_.table.commit(s, w.n, w.more_pieces() ? w.n : s.reserved);  // a piece frees its rows only
        s.decoding = w.decode;
        s.last_step = (int64_t) w.header.step();
        s.last_used = Clock::now();
        s.answered_at = s.last_used;
        // the step's next piece can be computed from now on (its queue wait starts here)
        if (w.more_pieces()) st_.queue.piece_ready(w.session_id, s.last_used);
        int32_t sampled = -1;
        bool finished = false;
        pb::SessionResponse r = st_.runner.answer(st, &sampled, &finished);
        if (s.chain.down) {  // chained route: the answer comes from downstream
            const auto it = w.decode && st_.pacer.paced_by_pipeline(s) ? fwd_rows.find(s.chain.hop.endpoint()) : fwd_rows.end();
            forward(s, w, r, it == fwd_rows.end() ? 0 : it->second);
            continue;
        }
        move_step(s, StepState::idle);  // (a chained session's step moves on in forward())
        w.release_ticket();
        complete_step(s, std::move(r), w.header, w.t0, w.internal(), sampled, finished);
    }
}

void StepFlow::fail_batch(std::vector<BatchRunner::Step> & steps, BackendStatus st, const std::string & err) {
    for (BatchRunner::Step & step : steps) {
        Work & w = *step.work;
        Session & s = *step.session;
        auto sink = s.sink;
        st_.queue.absorb_pieces(w);
        if (st == BackendStatus::resource_exhausted && !w.piece()) {  // a piece: the route is ahead; drop
            move_step(s, StepState::idle);
            s.gen.active = false;
            st_.table.unreserve(s);
            st_.backend.seq_rm(s.seq, (int32_t) s.positions, -1);
            pb::ShardError e = make_error(pb::ERROR_REASON_OVER_BUDGET, "no KV slot for the batch: " + err);
            e.set_limit(st_.opts.kv_cells);
            w.release_ticket();
            if (sink) st_.answer_error(*sink, w.header, e, w.t0, pb::CACHE_RESULT_UNSPECIFIED, w.internal());
        } else {
            st_.drop_session(w.session_id, EndKind::released);
            w.release_ticket();  // this popped step (drop_session purges only queued ones)
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

void StepFlow::forward(Session & s, Work & w, pb::SessionResponse & r, uint32_t hint_rows) {
    ChainState & c = s.chain;
    if (w.more_pieces()) {
        move_step(s, StepState::queued);  // later pieces wait here
        // an early piece of a split PREFILL step: its answer is only checked (pieces_in_flight)
        c.pieces_in_flight++;
        c.piece_header = r.header();
    } else {
        move_step(s, StepState::downstream);
        c.pending_header = r.header();
        c.pending_internal = w.internal();
        c.pending_t0 = w.t0;
        w.release_ticket();  // in flight downstream, no longer queued here
    }
    if (c.link == ChainLink::broken) {  // the answer is the link's error; the session ends with it
        DownReplyEvent ev{s.id, s.generation, {}};
        *ev.resp.mutable_error() = make_error(c.failed_reason, c.failed, true);
        return on(ev);
    }
    const bool opening = c.link == ChainLink::linked;
    pb::SessionRequest fr = ChainForwarder::frame_for(c, s, w, r, st_.pacer.paced_by_pipeline(s), hint_rows, st_.fwd_batch_seq);
    c.step++;
    if (opening) move_link(s, ChainLink::forwarding);
    c.sent_t0 = Clock::now();
    c.sent_decode = w.decode;
    const size_t bytes = c.down->send(std::move(fr));
    (w.decode ? st_.metrics.chain_frames_decode : st_.metrics.chain_frames_prefill)++;
    (w.decode ? st_.metrics.chain_bytes_decode : st_.metrics.chain_bytes_prefill) += bytes;
}

void StepFlow::on(DownReplyEvent & ev) {
    Session * sp = st_.table.find(ev.session_id);
    if (!sp || sp->generation != ev.generation ||
        !(sp->step == StepState::downstream || sp->chain.pieces_in_flight > 0)) {
        return;
    }
    Session & s = *sp;
    const pb::SessionResponse & d = ev.resp;
    s.last_used = Clock::now();
    // answers come in order: an early piece's before the step's last one
    const bool early_piece = s.chain.pieces_in_flight > 0;
    if (early_piece) {
        s.chain.pieces_in_flight--;
        if (d.result_case() == pb::SessionResponse::kTail) return;  // computed downstream; the step goes on
    } else {
        move_step(s, StepState::idle);
    }
    // an early piece that failed answers the client's frame (still queued or in flight here)
    const bool internal = early_piece ? !st_.has_unanswered_frame(s) : s.chain.pending_internal;
    const pb::ResponseHeader hdr = early_piece ? s.chain.piece_header : s.chain.pending_header;
    const Clock::time_point t0 = early_piece ? Clock::now() : s.chain.pending_t0;
    auto sink = s.sink;
    if (d.result_case() != pb::SessionResponse::kTail) {
        pb::ShardError e = d.has_error() ? d.error()
                                         : make_error(pb::ERROR_REASON_INTERNAL, "answered without a TailOutput");
        ChainForwarder::blame(s, e);
        e.set_session_terminated(true);
        s.gen.active = false;
        st_.drop_session(ev.session_id, EndKind::released);  // also ends the downstream stream
        if (sink) {  // the session is gone: the stream ends with the error's status
            pb::SessionResponse r;
            *r.mutable_header() = hdr;
            st_.metrics.step_errors++;
            st_.metrics.step_latency.observe(std::chrono::duration<double>(Clock::now() - t0).count());
            const grpc::Status st = status_with((grpc::StatusCode) e.grpc_code(), e.message(), e);
            *r.mutable_error() = std::move(e);
            sink->deliver(std::move(r), true, st);
        }
        return;
    }
    st_.metrics.observe_chain_hop(s.chain.sent_decode,
                               std::chrono::duration<double>(Clock::now() - s.chain.sent_t0).count());
    pb::SessionResponse r;
    *r.mutable_header() = hdr;
    *r.mutable_header()->mutable_payload_checksum() = d.header().payload_checksum();
    *r.mutable_tail() = d.tail();
    const bool has_token = d.tail().tokens_size() > 0;
    const int32_t sampled = has_token ? d.tail().tokens(0).token_id() : -1;
    const bool finished = has_token && d.tail().tokens(0).finish_reason() != pb::FINISH_REASON_UNSPECIFIED;
    complete_step(s, std::move(r), hdr, t0, internal, sampled, finished);
}

void StepFlow::on(DownEndEvent & ev) {
    Session * s = st_.table.find(ev.session_id);
    if (!s || s->generation != ev.generation || !s->chain.down) return;
    const std::string why = ChainForwarder::end_message(ev.status);
    const pb::ErrorReason reason = ChainForwarder::end_reason(ev.status);
    if (s->step == StepState::downstream || s->chain.pieces_in_flight > 0) {
        DownReplyEvent rep{ev.session_id, ev.generation, {}};
        *rep.resp.mutable_error() = make_error(reason, why, true);  // blamed on the hop there
        return on(rep);
    }
    if (s->chain.link == ChainLink::broken) return;  // (reported once)
    move_link(*s, ChainLink::broken);
    s->chain.failed = why;
    s->chain.failed_reason = reason;
}

void StepFlow::complete_step(Session & s, pb::SessionResponse r, const pb::ResponseHeader & hdr,
                              Clock::time_point t0, bool internal, int32_t sampled, bool finished) {
    s.stored = r;
    s.has_stored = true;
    st_.metrics.steps++;
    st_.metrics.step_latency.observe(std::chrono::duration<double>(Clock::now() - t0).count());
    if (s.sink) {
        if (Generation::holds_answer(s.gen, internal, finished)) {
            s.sink->hold(std::move(r), s.gen.per_answer);
        } else {
            s.sink->deliver(std::move(r), false, grpc::Status::OK, !internal);
        }
    }
    if (!s.gen.active) return;
    if (sampled >= 0) {
        continue_generation(s, hdr, sampled, finished);
    } else {
        s.gen.active = false;
    }
}

void StepFlow::continue_generation(Session & s, const pb::ResponseHeader & last, int32_t token, bool finished) {
    GenerationStep next = st_.generation.after_token(s, last, token, finished);
    if (std::holds_alternative<StopGenerating>(next)) return;
    auto refuse = [&](const pb::ResponseHeader & hdr, pb::ShardError e, bool counted_kv) {
        s.gen.active = false;
        if (counted_kv) st_.metrics.rejected_kv++;
        if (s.sink) st_.answer_error(*s.sink, hdr, std::move(e), Clock::now(), pb::CACHE_RESULT_UNSPECIFIED, true);
    };
    if (auto * r = std::get_if<GenerationRefused>(&next)) {
        return refuse(r->header, std::move(r->error), r->counted_kv);
    }
    NextRow & row = std::get<NextRow>(next);
    if (!st_.make_room(1, false, s.id)) {
        pb::ShardError e = make_error(pb::ERROR_REASON_OVER_BUDGET, "KV cells budget exhausted while generating");
        e.set_limit(st_.opts.kv_cells);
        return refuse(row.header, e, true);
    }
    auto w = std::make_unique<Work>();
    w->session_id = s.id;
    w->generation = s.generation;
    w->decode = true;
    w->tokens.push_back(row.token);
    w->pos0 = s.positions;
    w->n = 1;
    w->sample = true;
    w->origin = GeneratedStep{};
    w->header = std::move(row.header);
    w->t0 = Clock::now();
    w->t_ready = w->t0;
    move_step(s, StepState::queued);
    st_.table.reserve(s, 1);
    st_.metrics.generated_tokens++;
    Pacer::note_decode_arrival(s, Clock::now());
    st_.queue.push_decode(std::move(w));
}

}  // namespace dgr::worker
