// Step completion, and server-side generation (StepFrame.generate): each sampled token is fed
// back as the session's next DECODE row (an internal step, batched with everything else) until
// max_tokens answers or a finish reason; budgets apply to every internal step.
#include "worker/errors.h"
#include "worker/scheduler.h"

namespace dgr::worker {

void Scheduler::complete_step(Session & s, pb::SessionResponse r, const pb::ResponseHeader & hdr,
                              Clock::time_point t0, bool internal, int32_t sampled, bool finished) {
    s.stored = r;
    s.has_stored = true;
    metrics_.steps++;
    metrics_.step_latency.observe(std::chrono::duration<double>(Clock::now() - t0).count());
    if (s.sink) {
        if (holds_answer(s, internal, finished)) {
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

bool Scheduler::holds_answer(const Session & s, bool internal, bool finished) {
    // a generated token (not the frame's own first one) that more tokens will follow
    return internal && s.gen.active && s.gen.per_answer > 1 && s.gen.left > 1 && !finished;
}

void Scheduler::continue_generation(Session & s, const pb::ResponseHeader & last, int32_t token, bool finished) {
    GenerationState & g = s.gen;
    if (!g.active) return;
    if (g.left > 0) g.left--;
    if (g.left == 0 || (finished && !g.continue_after_finish)) {
        g.active = false;
        return;
    }
    pb::ResponseHeader hdr;
    hdr.set_schema_version(pb::SCHEMA_VERSION_V1);
    hdr.set_request_id(last.request_id());
    hdr.set_session_id(s.id);
    hdr.set_route_epoch(s.epoch);
    hdr.set_step(last.step() + 1);
    hdr.set_phase(pb::PHASE_DECODE);
    hdr.mutable_positions()->set_start(s.positions);
    hdr.mutable_positions()->set_end(s.positions + 1);
    hdr.set_compression(pb::COMPRESSION_NONE);
    hdr.set_cache_result(pb::CACHE_RESULT_HIT);
    *hdr.mutable_computed_range() = last.computed_range();
    auto stop = [&](pb::ShardError e) {
        g.active = false;
        if (s.sink) answer_error(*s.sink, hdr, std::move(e), Clock::now(), pb::CACHE_RESULT_UNSPECIFIED, true);
    };
    if (token < 0 || (uint32_t) token >= info_.n_vocab) {
        return stop(make_error(pb::ERROR_REASON_TOKEN_OUT_OF_VOCAB, "generation got token id " + std::to_string(token)));
    }
    if ((uint64_t) s.positions + 1 > opts_.max_session_positions) {
        pb::ShardError e = make_error(pb::ERROR_REASON_OVER_BUDGET, "generation reached max_session_positions");
        e.set_limit(opts_.max_session_positions);
        metrics_.rejected_kv++;
        return stop(e);
    }
    if (!make_room(1, false, s.id)) {
        pb::ShardError e = make_error(pb::ERROR_REASON_OVER_BUDGET, "KV cells budget exhausted while generating");
        e.set_limit(opts_.kv_cells);
        metrics_.rejected_kv++;
        return stop(e);
    }
    auto w = std::make_unique<Work>();
    w->session_id = s.id;
    w->generation = s.generation;
    w->decode = true;
    w->tokens.push_back(token);
    w->pos0 = s.positions;
    w->n = 1;
    w->sample = true;
    w->internal = true;
    w->header = hdr;
    w->t0 = Clock::now();
    w->t_ready = w->t0;
    move_step(s, StepState::queued);
    table_.reserve(s, 1);
    metrics_.generated_tokens++;
    note_decode_arrival(s);
    queue_.push_decode(std::move(w));
}

}  // namespace dgr::worker
