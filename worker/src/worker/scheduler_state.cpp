// What the scheduler thread's handlers share (scheduler_state.h).
#include "worker/scheduler_state.h"

#include "worker/pipeline.h"

namespace dgr::worker {

SchedulerState::SchedulerState(ModelBackend & b, Metrics & m, const SchedulerOptions & o, LinkEvents events)
    : backend(b), metrics(m), opts(fit_options(o, b.info())), info(b.info()), cap(capability_of(info, opts)),
      intake(cap, opts.max_session_positions), generation(info.n_vocab, opts.max_session_positions),
      runner(b, opts.max_fragment_bytes), chain(info, o.chain), table(opts.max_sessions, opts.tombstones),
      pacer(table, opts.pipeline_groups),
      reaper(table, queue, b, m, SessionReaper::Limits{opts.kv_cells, opts.evict_idle_s, opts.session_ttl_s}),
      link_events(std::move(events)) {}

void SchedulerState::answer_error(StreamSink & sink, const pb::ResponseHeader & hdr, pb::ShardError err,
                                  Clock::time_point t0, pb::CacheResult cache, bool internal) {
    pb::SessionResponse r;
    *r.mutable_header() = hdr;
    r.mutable_header()->set_cache_result(cache);
    *r.mutable_error() = std::move(err);
    metrics.step_errors++;
    metrics.step_latency.observe(std::chrono::duration<double>(Clock::now() - t0).count());
    sink.deliver(std::move(r), false, grpc::Status::OK, !internal);
}

void SchedulerState::answer_frame_error(FrameEvent & ev, const pb::ResponseHeader & hdr, pb::ShardError err,
                                        pb::CacheResult cache) {
    ev.ticket.release();
    answer_error(*ev.sink, hdr, std::move(err), ev.t0, cache);
}

bool SchedulerState::has_unanswered_frame(const Session & s) const {
    if (!s.busy()) return false;
    if (s.step == StepState::downstream) return !s.chain.pending_internal;
    return queue.has_client_step(s.id);  // (a split step's last piece)
}

uint64_t SchedulerState::drop_session(const std::string & id, EndKind kind) {
    const uint64_t freed = reaper.end(id, kind);
    publish_gauges();
    return freed;
}

bool SchedulerState::make_room(uint64_t cells, bool need_session, const std::string & requester) {
    const bool room = reaper.make_room(cells, need_session, requester, Clock::now());
    publish_gauges();
    return room;
}

void SchedulerState::sweep_ttl(Clock::time_point now) {
    if (reaper.sweep(now) > 0) publish_gauges();
}

void SchedulerState::publish_gauges() {
    active = (uint32_t) table.size();
    kv_used_pub = table.kv_used();
}

void SchedulerState::queue_prefill(Session & s, WorkPtr w) {
    const uint32_t piece = prefill_piece_rows(w->n, pacer.prefill_groups(s));
    if (piece < w->n) metrics.prefill_pieces += (w->n + piece - 1) / piece;
    queue.push_prefill_pieces(std::move(w), piece, info.n_embd);
}

void SchedulerState::open_chain(Session & s, const pb::StepFrame & sf) {
    const std::string sid = s.id;
    const uint64_t gen = s.generation;
    chain.open(
        s, sf, [this, sid, gen](pb::SessionResponse r) { link_events.reply(sid, gen, std::move(r)); },
        [this, sid, gen](const grpc::Status & st) { link_events.end(sid, gen, st); });
}

}  // namespace dgr::worker
