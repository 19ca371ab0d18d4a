#include "worker/scheduler.h"

#include "worker/errors.h"
#include "worker/pipeline.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace dgr::worker {

namespace {

// The options as the backend allows them: the KV budget and session count within what the
// context was created for, and the chunk limit such that the oldest prefill chunk always fits
// next to one decode row per session.
SchedulerOptions fit(SchedulerOptions o, const BackendInfo & in) {
    if (o.kv_cells == 0 || o.kv_cells > in.kv_cells) o.kv_cells = in.kv_cells;
    o.max_sessions = std::min(o.max_sessions, in.n_seq_max);
    o.max_batch_tokens = std::min(o.max_batch_tokens, in.max_batch_tokens);
    if (o.max_prefill_chunk_tokens + o.max_sessions > o.max_batch_tokens) {
        o.max_prefill_chunk_tokens = o.max_batch_tokens > o.max_sessions ? o.max_batch_tokens - o.max_sessions : 1;
    }
    o.max_session_positions = (uint32_t) std::min<uint64_t>(o.max_session_positions, o.kv_cells);
    return o;
}

pb::ResponseHeader session_header(const std::string & id, uint64_t epoch) {
    pb::ResponseHeader h;
    h.set_schema_version(pb::SCHEMA_VERSION_V1);
    h.set_session_id(id);
    h.set_route_epoch(epoch);
    return h;
}

// A terminal answer: the ShardError in the frame, and the stream's status carrying it too.
void end_stream(StreamSink & sink, const pb::ResponseHeader & hdr, const pb::ShardError & e, grpc::Status st) {
    pb::SessionResponse r;
    *r.mutable_header() = hdr;
    *r.mutable_error() = e;
    sink.deliver(std::move(r), true, status_with(st.error_code(), st.error_message(), e));
}

}  // namespace

pb::GetCapabilityResponse capability_of(const BackendInfo & in, const SchedulerOptions & o) {
    pb::GetCapabilityResponse resp;
    resp.set_schema_version(pb::SCHEMA_VERSION_V1);
    resp.set_min_schema_version(pb::SCHEMA_VERSION_V1);
    auto * id = resp.mutable_identity();
    id->set_artifact_id(in.artifact_id);
    id->set_recipe_json(in.recipe_json);
    id->set_compatibility_fingerprint(in.fingerprint);
    id->mutable_range()->set_start(in.layer_start);
    id->mutable_range()->set_end(in.layer_end);
    id->set_n_layer(in.n_layer);
    id->set_head(in.head);
    id->set_tail(in.tail);
    id->set_n_embd(in.n_embd);
    id->set_n_vocab(in.n_vocab);
    id->set_architecture(in.architecture);
    auto * c = resp.mutable_capacity();
    c->set_max_sessions(o.max_sessions);
    c->set_kv_cells(o.kv_cells);
    c->set_max_session_positions(o.max_session_positions);
    c->set_max_batch_tokens(o.max_batch_tokens);
    c->set_max_prefill_chunk_tokens(o.max_prefill_chunk_tokens);
    c->set_max_message_bytes(o.max_message_bytes);
    c->set_max_fragment_bytes(o.max_fragment_bytes);
    c->add_compressions(pb::COMPRESSION_NONE);
    c->set_server_generation(true);
    c->set_chain_forwarding(true);
    c->set_weight_bytes(in.weight_bytes);
    c->set_kv_bytes(in.kv_bytes);
    c->set_scratch_bytes(in.scratch_bytes);
    c->set_memory_budget_bytes(o.memory_budget_bytes);
    c->set_predicted_memory_bytes(in.predicted_total());
    return resp;
}

Scheduler::Scheduler(ModelBackend & backend, Metrics & metrics, const SchedulerOptions & opts)
    : backend_(backend), metrics_(metrics), opts_(fit(opts, backend.info())), info_(backend.info()),
      cap_(capability_of(info_, opts_)), peers_(opts.chain), table_(opts_.max_sessions, opts_.tombstones) {
    last_sweep_ = Clock::now();
}

Scheduler::~Scheduler() {
    if (thread_.joinable()) stop(grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker stopping"));
}

void Scheduler::start() {
    started_ = true;
    if (opts_.keep_warm_s > 0.0) warm_ = std::make_unique<KeepWarm>(std::max(1u, opts_.keep_warm_threads), opts_.keep_warm_s);
    thread_ = std::thread([this] { loop(); });
}

void Scheduler::stop(grpc::Status status) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        inbox_.push_back(StopEvent{std::move(status)});
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
    warm_.reset();
}

bool Scheduler::post(Event ev) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (stopped_) return false;
        inbox_.push_back(std::move(ev));
    }
    cv_.notify_one();
    return true;
}

bool Scheduler::post_frame(std::shared_ptr<StreamSink> sink, std::unique_ptr<pb::SessionRequest> req,
                           Clock::time_point t0) {
    FrameTicket ticket = FrameTicket::take(queued_, opts_.queue_limit);
    if (!ticket.held()) return false;
    StreamSink * raw = sink.get();
    if (!post(FrameEvent{std::move(sink), std::move(req), t0, std::move(ticket)})) {  // (the ticket went with it)
        pb::ResponseHeader hdr;
        hdr.set_schema_version(pb::SCHEMA_VERSION_V1);
        end_stream(*raw, hdr, make_error(pb::ERROR_REASON_UNAVAILABLE, "the worker is shutting down", true),
                   grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker shut down"));
    }
    return true;
}

void Scheduler::post_stream_closed(std::shared_ptr<StreamSink> sink, bool cancelled) {
    StreamSink * raw = sink.get();
    if (!post(ClosedEvent{std::move(sink), cancelled})) {
        raw->finish(cancelled ? grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled") : grpc::Status::OK);
    }
}

void Scheduler::post_release(const pb::ReleaseSessionRequest & req, std::function<void(pb::ReleaseSessionResponse)> done) {
    auto shared = std::make_shared<std::function<void(pb::ReleaseSessionResponse)>>(std::move(done));
    if (!post(ReleaseEvent{req.session_id(), req.route_epoch(), [shared](pb::ReleaseSessionResponse r) { (*shared)(std::move(r)); }})) {
        (*shared)(pb::ReleaseSessionResponse());
    }
}

void Scheduler::post_cancel(const pb::CancelSessionRequest & req, std::function<void(pb::CancelSessionResponse)> done) {
    auto shared = std::make_shared<std::function<void(pb::CancelSessionResponse)>>(std::move(done));
    if (!post(CancelEvent{req.session_id(), req.route_epoch(), [shared](pb::CancelSessionResponse r) { (*shared)(std::move(r)); }})) {
        (*shared)(pb::CancelSessionResponse());
    }
}

// downstream events after stop() are dropped
void Scheduler::post_downstream(const std::string & session_id, uint64_t generation, pb::SessionResponse resp) {
    post(DownReplyEvent{session_id, generation, std::move(resp)});
}

void Scheduler::post_downstream_end(const std::string & session_id, uint64_t generation, const grpc::Status & status) {
    post(DownEndEvent{session_id, generation, status});
}

void Scheduler::set_draining() { draining_ = true; }

void Scheduler::answer_error(StreamSink & sink, const pb::ResponseHeader & hdr, pb::ShardError err,
                             Clock::time_point t0, pb::CacheResult cache, bool internal) {
    pb::SessionResponse r;
    *r.mutable_header() = hdr;
    r.mutable_header()->set_cache_result(cache);
    *r.mutable_error() = std::move(err);
    metrics_.step_errors++;
    metrics_.step_latency.observe(std::chrono::duration<double>(Clock::now() - t0).count());
    sink.deliver(std::move(r), false, grpc::Status::OK, !internal);
}

void Scheduler::answer_frame_error(FrameEvent & ev, const pb::ResponseHeader & hdr, pb::ShardError err,
                                   pb::CacheResult cache) {
    ev.ticket.release();
    answer_error(*ev.sink, hdr, std::move(err), ev.t0, cache);
}

bool Scheduler::has_unanswered_frame(const Session & s) const {
    if (!s.busy()) return false;
    if (s.step == StepState::downstream) return !s.chain.pending_internal;
    return queue_.has_client_step(s.id);  // (a split step's last piece)
}

void Scheduler::on(ClosedEvent & ev) {
    const std::string & id = ev.sink->bound_session;
    const Session * s = id.empty() ? nullptr : table_.find(id);
    if (s && s->sink == ev.sink) drop_session(id, ev.cancelled ? EndKind::cancelled : EndKind::released);
    ev.sink->finish(ev.cancelled ? grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled") : grpc::Status::OK);
}

void Scheduler::on(ReleaseEvent & ev) {
    pb::ReleaseSessionResponse resp;
    Session * s = table_.find(ev.session_id);
    if (s && (ev.route_epoch == 0 || ev.route_epoch == s->epoch)) {
        auto sink = s->sink;
        const bool had_work = s->busy();
        const bool unanswered = has_unanswered_frame(*s);
        const pb::ResponseHeader hdr = session_header(ev.session_id, s->epoch);
        resp.set_freed_kv_cells(drop_session(ev.session_id, EndKind::released));
        resp.set_released(true);
        if (had_work && sink) {
            // the queued frame is answered, so its stream can go on reading; server-side
            // generation is told why it stopped (the frame's ticket went back with its step)
            answer_error(*sink, hdr,
                         make_error(pb::ERROR_REASON_SESSION_RELEASED,
                                    unanswered ? "the session was released while this step was queued"
                                               : "the session was released while generating"),
                         Clock::now(), pb::CACHE_RESULT_UNSPECIFIED, !unanswered);
        }
    }
    ev.done(resp);
}

void Scheduler::on(CancelEvent & ev) {
    pb::CancelSessionResponse resp;
    Session * s = table_.find(ev.session_id);
    if (s && (ev.route_epoch == 0 || ev.route_epoch == s->epoch)) {
        auto sink = s->sink;
        const pb::ResponseHeader hdr = session_header(ev.session_id, s->epoch);
        drop_session(ev.session_id, EndKind::cancelled);
        resp.set_cancelled(true);
        if (sink) {
            end_stream(*sink, hdr, make_error(pb::ERROR_REASON_CANCELLED, "the session was cancelled", true),
                       grpc::Status(grpc::StatusCode::CANCELLED, "session cancelled"));
        }
    }
    ev.done(resp);
}

void Scheduler::stop_now(const StopEvent & ev, std::deque<Event> & evs, size_t next) {
    const grpc::Status & st = ev.status;
    std::deque<Event> late;
    {
        std::lock_guard<std::mutex> lk(mu_);
        stopped_ = true;
        late.swap(inbox_);
    }
    for (const auto & id : table_.ids()) {
        const Session & s = *table_.find(id);
        auto sink = s.sink;
        const pb::ResponseHeader hdr = session_header(id, s.epoch);
        drop_session(id, EndKind::released);
        if (sink) {
            end_stream(*sink, hdr,
                       make_error(pb::ERROR_REASON_UNAVAILABLE,
                                  "the worker is shutting down; restart the session elsewhere", true),
                       st);
        }
    }
    // events behind the stop (and in this drain) are answered like late ones
    const pb::ShardError down = make_error(pb::ERROR_REASON_UNAVAILABLE, "the worker is shutting down", true);
    auto answer_late = [&](Event & e) {
        if (auto * f = std::get_if<FrameEvent>(&e)) {
            f->ticket.release();
            pb::ResponseHeader hdr;
            hdr.set_schema_version(pb::SCHEMA_VERSION_V1);
            end_stream(*f->sink, hdr, down, st);
        } else if (auto * c = std::get_if<ClosedEvent>(&e)) {
            c->sink->finish(grpc::Status::OK);
        } else if (auto * r = std::get_if<ReleaseEvent>(&e)) {
            r->done(pb::ReleaseSessionResponse());
        } else if (auto * k = std::get_if<CancelEvent>(&e)) {
            k->done(pb::CancelSessionResponse());
        }
    };
    for (size_t k = next; k < evs.size(); ++k) answer_late(evs[k]);
    for (auto & e : late) answer_late(e);
    publish_gauges();
}

bool Scheduler::dispatch(std::deque<Event> & evs) {
    for (size_t ei = 0; ei < evs.size(); ++ei) {
        Event & ev = evs[ei];
        if (auto * stop = std::get_if<StopEvent>(&ev)) {
            stop_now(*stop, evs, ei + 1);
            return false;
        }
        std::visit(
            [this](auto & e) {
                if constexpr (!std::is_same_v<std::decay_t<decltype(e)>, StopEvent>) on(e);
            },
            ev);
    }
    return true;
}

void Scheduler::loop() {
    for (;;) {
        std::deque<Event> evs;
        {
            std::unique_lock<std::mutex> lk(mu_);
            if (inbox_.empty() && queue_.empty()) {
                cv_.wait_for(lk, std::chrono::milliseconds(500));
            }
            evs.swap(inbox_);
        }
        if (!dispatch(evs)) return;
#ifndef NDEBUG
        if (const std::string drift = table_.check(); !drift.empty()) {
            std::fprintf(stderr, "dgr-worker: internal error: %s\n", drift.c_str());
            std::abort();
        }
#endif
        // Gather: sessions that just got a decode answer usually send their next step within
        // a client round trip; waiting a little (<= 25% of the last decode call, <= 5 ms) for
        // them turns staggered arrivals into one batch instead of several small ones. A session
        // is waited for only when its next row is predicted to arrive before the deadline (its
        // usual answer-to-next-row gap, pipeline.h): on a pipelined route the other group's rows
        // come a whole stage compute later, and waiting for them would idle this Shard.
        // Only sessions of a pipelined route are judged so (paced_by_pipeline): a route driver
        // stepping each Shard in turn answers every session a stage later too, and there the
        // short wait is what gathers its sessions into one batch (measured: 4 sessions over
        // SmolLM2 0:15|15:30 on 2 cores, 1.98 rows per batch with the wait, 1.41 and 45% fewer
        // tokens/s without). A pipelined head stops gathering once a group's worth of chained
        // rows is queued.
        // Chained sessions generating over a route on this same host are waited for longer (up
        // to 3 decode calls, <= 250 ms): their next row comes back after the other shards have
        // computed, and if this shard ran the ones already back in the meantime, two groups of
        // sessions would alternate between the shards and both processes would compute at the
        // same time on shared cores (measured: SmolLM2 0:15|15:30, 4 sessions, 2 cores, 2 rows
        // per batch and ~3x slower). Routes across hosts form pipeline groups instead (below
        // and docs/worker.md, Pipelined routes): there the shards computing different groups at
        // once is the pipeline working.
        if (queue_.has_decode() && !queue_.has_prefill() && last_decode_s_ > 0.0) {
            const auto t_gather = Clock::now();
            auto after = [&](double s) {
                return t_gather + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
            };
            const auto short_deadline = after(std::min(0.005, 0.25 * last_decode_s_));
            const auto long_deadline = after(std::min(0.25, 3.0 * last_decode_s_ + 0.005));
            const uint32_t group = chain_group_rows();
            // a group's members that are downstream and due within one decode call join it, so
            // that a group split by uneven prompts merges once and then travels together
            const auto fill_deadline = after(std::min(0.05, last_decode_s_));
            for (;;) {
                if (queue_.has_prefill()) break;
                if (group > 0) {  // a full group (block of sequence ids, batch_runner.cpp) is queued
                    int64_t block = -1;
                    const uint32_t chained = queue_.first_block_rows(block_of(group), &block);
                    if (chained >= group) break;
                    if (chained > 0 && Clock::now() < fill_deadline && block_due_by(block, group, fill_deadline) > 0) {
                        std::deque<Event> more;
                        {
                            std::unique_lock<std::mutex> lk(mu_);
                            cv_.wait_until(lk, fill_deadline, [this] { return !inbox_.empty(); });
                            more.swap(inbox_);
                        }
                        if (!dispatch(more)) return;
                        continue;
                    }
                }
                const Expected e = expected_decoders(short_deadline);
                // rows forwarded together by a pipelining Shard (StepFrame.batch) are waited for
                // until all are here, within the same short deadline
                if (e.plain == 0 && e.colocated_chain == 0 && !queue_.upstream_batch_incomplete()) break;
                const auto deadline = e.colocated_chain > 0 ? long_deadline : short_deadline;
                if (Clock::now() >= deadline) break;
                std::deque<Event> more;
                {
                    std::unique_lock<std::mutex> lk(mu_);
                    cv_.wait_until(lk, deadline, [this] { return !inbox_.empty(); });
                    more.swap(inbox_);
                }
                if (!dispatch(more)) return;
            }
            metrics_.gather_wait_seconds =
                metrics_.gather_wait_seconds.load() + std::chrono::duration<double>(Clock::now() - t_gather).count();
        }
        const auto now = Clock::now();
        if (std::chrono::duration<double>(now - last_sweep_).count() >= 1.0) {
            sweep_ttl(now);
            last_sweep_ = now;
        }
        if (!queue_.empty()) run_batch();
        publish_gauges();
    }
}

Scheduler::Expected Scheduler::expected_decoders(Clock::time_point deadline) const {
    Expected n;
    table_.for_each([&](const Session & s) {
        if (s.step == StepState::downstream && s.gen.active) {
            // chained heads that generate get their next row when the route answers
            if (s.chain.colocated) {
                n.colocated_chain++;
            } else if (!paced_by_pipeline(s) || worth_waiting(s.answered_at, s.gap_s, deadline)) {
                n.plain++;
            }
        } else if (s.decoding && !s.busy() &&
                   (!paced_by_pipeline(s) || worth_waiting(s.answered_at, s.gap_s, deadline))) {
            n.plain++;
        }
    });
    return n;
}

bool Scheduler::paced_by_pipeline(const Session & s) const {
    return s.pipelined ||
           (s.chain.down && pipeline_groups(opts_.pipeline_groups, s.chain.stages, s.chain.colocated) > 1);
}

uint32_t Scheduler::block_due_by(int64_t block, uint32_t group, Clock::time_point deadline) const {
    uint32_t n = 0;
    table_.for_each([&](const Session & s) {
        if (s.chain.down && s.step == StepState::downstream && s.gen.active && pipeline_block(s.seq, group) == block &&
            worth_waiting(s.answered_at, s.gap_s, deadline)) {
            n++;
        }
    });
    return n;
}

WorkQueue::BlockOf Scheduler::block_of(uint32_t group) const {
    return [this, group](const Work & w) -> int64_t {
        const Session * s = table_.find(w.session_id);
        return s && s->chain.down ? pipeline_block(s->seq, group) : -1;
    };
}

uint32_t Scheduler::chain_group_rows() const {
    uint32_t active = 0, groups = 1;
    table_.for_each([&](const Session & s) {
        if (!s.chain.down || !(s.gen.active || s.decoding)) return;
        active++;
        groups = std::max(groups, pipeline_groups(opts_.pipeline_groups, s.chain.stages, s.chain.colocated));
    });
    return pipeline_group_rows(active, groups);
}

void Scheduler::note_decode_arrival(Session & s) {
    // decode -> decode only: the gap after a prompt includes the rest of the route's prefill
    if (s.decoding && s.answered_at != Clock::time_point{}) {
        s.gap_s = next_gap(s.gap_s, std::chrono::duration<double>(Clock::now() - s.answered_at).count());
    }
}

}  // namespace dgr::worker
