// The scheduler's thread (scheduler.h): posting events, the loop that routes them, the gather
// before a batch, and the session ends handled here (release, cancel, a closed stream, stop).
#include "worker/scheduler.h"

#include "worker/errors.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace dgr::worker {

namespace {

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

Scheduler::Scheduler(ModelBackend & backend, Metrics & metrics, const SchedulerOptions & opts)
    : st_(backend, metrics, opts,
          LinkEvents{[this](const std::string & id, uint64_t gen, pb::SessionResponse r) { post_downstream(id, gen, std::move(r)); },
                     [this](const std::string & id, uint64_t gen, const grpc::Status & status) {
                         post_downstream_end(id, gen, status);
                     }}) {
    last_sweep_ = Clock::now();
}

Scheduler::~Scheduler() {
    if (thread_.joinable()) stop(grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker stopping"));
}

void Scheduler::start() {
    started_ = true;
    if (st_.opts.keep_warm_s > 0.0) {
        st_.warm = std::make_unique<KeepWarm>(std::max(1u, st_.opts.keep_warm_threads), st_.opts.keep_warm_s);
    }
    thread_ = std::thread([this] { loop(); });
}

void Scheduler::stop(grpc::Status status) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        inbox_.push_back(StopEvent{std::move(status)});
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
    st_.warm.reset();
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
    FrameTicket ticket = FrameTicket::take(st_.queued, st_.opts.queue_limit);
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

void Scheduler::set_draining() { st_.draining = true; }

void Scheduler::on(ClosedEvent & ev) {
    const std::string & id = ev.sink->bound_session;
    const Session * s = id.empty() ? nullptr : st_.table.find(id);
    if (s && s->sink == ev.sink) st_.drop_session(id, ev.cancelled ? EndKind::cancelled : EndKind::released);
    ev.sink->finish(ev.cancelled ? grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled") : grpc::Status::OK);
}

void Scheduler::on(ReleaseEvent & ev) {
    pb::ReleaseSessionResponse resp;
    Session * s = st_.table.find(ev.session_id);
    if (s && (ev.route_epoch == 0 || ev.route_epoch == s->epoch)) {
        auto sink = s->sink;
        const bool had_work = s->busy();
        const bool unanswered = st_.has_unanswered_frame(*s);
        const pb::ResponseHeader hdr = session_header(ev.session_id, s->epoch);
        resp.set_freed_kv_cells(st_.drop_session(ev.session_id, EndKind::released));
        resp.set_released(true);
        if (had_work && sink) {
            // the queued frame is answered, so its stream can go on reading; server-side
            // generation is told why it stopped (the frame's ticket went back with its step)
            st_.answer_error(*sink, hdr,
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
    Session * s = st_.table.find(ev.session_id);
    if (s && (ev.route_epoch == 0 || ev.route_epoch == s->epoch)) {
        auto sink = s->sink;
        const pb::ResponseHeader hdr = session_header(ev.session_id, s->epoch);
        st_.drop_session(ev.session_id, EndKind::cancelled);
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
    for (const auto & id : st_.table.ids()) {
        const Session & s = *st_.table.find(id);
        auto sink = s.sink;
        const pb::ResponseHeader hdr = session_header(id, s.epoch);
        st_.drop_session(id, EndKind::released);
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
    st_.publish_gauges();
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
            if (inbox_.empty() && st_.queue.empty()) {
                cv_.wait_for(lk, std::chrono::milliseconds(500));
            }
            evs.swap(inbox_);
        }
        if (!dispatch(evs)) return;
#ifndef NDEBUG
        if (const std::string drift = st_.table.check(); !drift.empty()) {
            std::fprintf(stderr, "dgr-worker: internal error: %s\n", drift.c_str());
            std::abort();
        }
#endif
        if (st_.pacer.gathers(st_.queue) && !gather()) return;
        const auto now = Clock::now();
        if (std::chrono::duration<double>(now - last_sweep_).count() >= 1.0) {
            st_.sweep_ttl(now);
            last_sweep_ = now;
        }
        if (!st_.queue.empty()) flow_.run_batch();
        st_.publish_gauges();
    }
}

bool Scheduler::gather() {
    const Pacer::Gather g = st_.pacer.gather_from(Clock::now());
    while (const auto until = st_.pacer.wait_until(g, st_.queue, Clock::now())) {
        std::deque<Event> more;
        {
            std::unique_lock<std::mutex> lk(mu_);
            cv_.wait_until(lk, *until, [this] { return !inbox_.empty(); });
            more.swap(inbox_);
        }
        if (!dispatch(more)) return false;
    }
    st_.metrics.gather_wait_seconds =
        st_.metrics.gather_wait_seconds.load() + std::chrono::duration<double>(Clock::now() - g.start).count();
    return true;
}

Gauges Scheduler::gauges() const {
    Gauges g;
    g.active_sessions = st_.active.load();
    g.queued_steps = st_.queued.load();
    g.kv_cells_used = st_.kv_used_pub.load();
    g.kv_cells_total = st_.opts.kv_cells;
    g.max_sessions = st_.opts.max_sessions;
    g.weight_bytes = st_.info.weight_bytes;
    g.kv_bytes = st_.info.kv_bytes;
    g.scratch_bytes = st_.info.scratch_bytes;
    g.memory_budget_bytes = st_.opts.memory_budget_bytes;
    g.predicted_weight_bytes = st_.info.predicted_weight_bytes;
    g.predicted_kv_bytes = st_.info.predicted_kv_bytes;
    g.predicted_compute_bytes = st_.info.predicted_compute_bytes;
    g.predicted_runtime_bytes = st_.info.predicted_runtime_bytes;
    g.device_class = st_.info.device.device_class;
    g.device_memory_total_bytes = st_.info.device.memory_total;
    g.device_memory_free_bytes = st_.info.device.memory_free;
    g.device_memory_predicted_bytes = st_.info.device.memory_predicted;
    return g;
}

std::string Scheduler::audit() const {
    std::string out = st_.table.check();
    if (thread_.joinable()) return out;
    auto add = [&out](const std::string & what) { out += (out.empty() ? "" : "; ") + what; };
    bool stopped;
    {
        std::lock_guard<std::mutex> lk(mu_);
        stopped = stopped_;
    }
    if (stopped) {
        if (st_.queued.load() != 0) add(std::to_string(st_.queued.load()) + " frame ticket(s) still out");
        if (st_.table.size() != 0) add(std::to_string(st_.table.size()) + " session(s) left");
        if (!st_.queue.empty()) add("steps left in the queues");
    }
    return out;
}

}  // namespace dgr::worker
