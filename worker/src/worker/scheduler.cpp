#include "worker/scheduler.h"

#include "worker/boundary_io.h"
#include "worker/errors.h"

#include <algorithm>
#include <functional>
#include <cstdio>

namespace dgr::worker {

struct Scheduler::Partial {
    uint64_t step = 0;
    ResidualAssembly asm_;
    Partial(uint64_t s, uint32_t rows, uint32_t n_embd, uint64_t max_bytes, uint32_t max_frag)
        : step(s), asm_(rows, n_embd, max_bytes, max_frag) {}
};

namespace {
constexpr int kReleased = 0, kEvicted = 1, kCancelled = 2;

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

SamplingConfig to_config(const pb::SamplingParams & p) {
    SamplingConfig c;
    c.stochastic = p.mode() == pb::SAMPLING_MODE_STOCHASTIC;
    c.temperature = p.temperature();
    c.top_k = p.top_k();
    c.top_p = p.top_p();
    c.min_p = p.min_p();
    c.seed = p.seed();
    c.top_logprobs = p.top_logprobs();
    c.ignore_eog = p.ignore_eog();
    c.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
    return c;
}
}  // namespace

Scheduler::Scheduler(ModelBackend & backend, Metrics & metrics, const SchedulerOptions & opts)
    : backend_(backend), metrics_(metrics), opts_(opts), info_(backend.info()), peers_(opts.chain) {
    if (opts_.kv_cells == 0 || opts_.kv_cells > info_.kv_cells) opts_.kv_cells = info_.kv_cells;
    opts_.max_sessions = std::min(opts_.max_sessions, info_.n_seq_max);
    opts_.max_batch_tokens = std::min(opts_.max_batch_tokens, info_.max_batch_tokens);
    // the oldest prefill chunk always fits next to one decode row per session
    if (opts_.max_prefill_chunk_tokens + opts_.max_sessions > opts_.max_batch_tokens) {
        opts_.max_prefill_chunk_tokens =
            opts_.max_batch_tokens > opts_.max_sessions ? opts_.max_batch_tokens - opts_.max_sessions : 1;
    }
    opts_.max_session_positions = (uint32_t) std::min<uint64_t>(opts_.max_session_positions, opts_.kv_cells);
    for (int32_t s = (int32_t) opts_.max_sessions - 1; s >= 0; --s) free_seqs_.push_back(s);
    last_sweep_ = Clock::now();
}

Scheduler::~Scheduler() {
    if (thread_.joinable()) stop(grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker stopping"));
}

void Scheduler::start() {
    started_ = true;
    thread_ = std::thread([this] { loop(); });
}

void Scheduler::stop(grpc::Status status) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        Event ev;
        ev.kind = Event::stop;
        ev.session_id = status.error_message();
        ev.epoch = (uint64_t) status.error_code();
        inbox_.push_back(std::move(ev));
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
}

bool Scheduler::post_frame(std::shared_ptr<StreamSink> sink, std::unique_ptr<pb::SessionRequest> req,
                           Clock::time_point t0) {
    if (queued_.load() >= opts_.queue_limit) return false;
    queued_++;
    {
        std::unique_lock<std::mutex> lk(mu_);
        if (stopped_) {
            lk.unlock();
            queued_--;
            pb::SessionResponse r;
            r.mutable_header()->set_schema_version(pb::SCHEMA_VERSION_V1);
            *r.mutable_error() = make_error(pb::ERROR_REASON_UNAVAILABLE, "the worker is shutting down", true);
            sink->deliver(std::move(r), true, grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker shut down"));
            return true;
        }
        Event ev;
        ev.kind = Event::frame;
        ev.sink = std::move(sink);
        ev.req = std::move(req);
        ev.t0 = t0;
        inbox_.push_back(std::move(ev));
    }
    cv_.notify_one();
    return true;
}

void Scheduler::post_stream_closed(std::shared_ptr<StreamSink> sink, bool cancelled) {
    {
        std::unique_lock<std::mutex> lk(mu_);
        if (stopped_) {
            lk.unlock();
            sink->finish(cancelled ? grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled") : grpc::Status::OK);
            return;
        }
        Event ev;
        ev.kind = Event::closed;
        ev.sink = std::move(sink);
        ev.cancelled = cancelled;
        inbox_.push_back(std::move(ev));
    }
    cv_.notify_one();
}

void Scheduler::post_release(const pb::ReleaseSessionRequest & req, std::function<void(pb::ReleaseSessionResponse)> done) {
    {
        std::unique_lock<std::mutex> lk(mu_);
        if (stopped_) {
            lk.unlock();
            done(pb::ReleaseSessionResponse());
            return;
        }
        Event ev;
        ev.kind = Event::release;
        ev.session_id = req.session_id();
        ev.epoch = req.route_epoch();
        ev.release_done = std::move(done);
        inbox_.push_back(std::move(ev));
    }
    cv_.notify_one();
}

void Scheduler::post_cancel(const pb::CancelSessionRequest & req, std::function<void(pb::CancelSessionResponse)> done) {
    {
        std::unique_lock<std::mutex> lk(mu_);
        if (stopped_) {
            lk.unlock();
            done(pb::CancelSessionResponse());
            return;
        }
        Event ev;
        ev.kind = Event::cancel;
        ev.session_id = req.session_id();
        ev.epoch = req.route_epoch();
        ev.cancel_done = std::move(done);
        inbox_.push_back(std::move(ev));
    }
    cv_.notify_one();
}

void Scheduler::post_downstream(const std::string & session_id, uint64_t generation, pb::SessionResponse resp) {
    Event ev;
    ev.kind = Event::down_reply;
    ev.session_id = session_id;
    ev.epoch = generation;  // the session's generation: a reply for an older one is dropped
    ev.resp = std::make_unique<pb::SessionResponse>(std::move(resp));
    post_unless_stopped(std::move(ev));
}

void Scheduler::post_downstream_end(const std::string & session_id, uint64_t generation, const grpc::Status & status) {
    Event ev;
    ev.kind = Event::down_end;
    ev.session_id = session_id;
    ev.epoch = generation;
    ev.status = status;
    post_unless_stopped(std::move(ev));
}

void Scheduler::post_unless_stopped(Event ev) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (stopped_) return;
        inbox_.push_back(std::move(ev));
    }
    cv_.notify_one();
}

void Scheduler::set_draining() { draining_ = true; }

Gauges Scheduler::gauges() const {
    Gauges g;
    g.active_sessions = active_.load();
    g.queued_steps = queued_.load();
    g.kv_cells_used = kv_used_pub_.load();
    g.kv_cells_total = opts_.kv_cells;
    g.max_sessions = opts_.max_sessions;
    g.weight_bytes = info_.weight_bytes;
    g.kv_bytes = info_.kv_bytes;
    g.scratch_bytes = info_.scratch_bytes;
    g.memory_budget_bytes = opts_.memory_budget_bytes;
    return g;
}

void Scheduler::publish_gauges() {
    active_ = (uint32_t) sessions_.size();
    kv_used_pub_ = kv_used_;
}

void Scheduler::remember(const std::string & id, uint64_t epoch, int kind) {
    if (tombstones_.find(id) == tombstones_.end()) tomb_order_.push_back(id);
    tombstones_[id] = Tombstone{epoch, kind};
    while (tomb_order_.size() > opts_.tombstones) {
        tombstones_.erase(tomb_order_.front());
        tomb_order_.pop_front();
    }
}

uint64_t Scheduler::drop_session(const std::string & id, int tomb_kind) {
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return 0;
    Session & s = *it->second;
    auto purge = [&](std::deque<std::unique_ptr<Work>> & q) {
        for (auto w = q.begin(); w != q.end();) {
            if ((*w)->session_id == id) {
                if (!(*w)->internal) queued_--;
                w = q.erase(w);
            } else {
                ++w;
            }
        }
    };
    purge(decode_q_);
    purge(prefill_q_);
    if (s.down) s.down->close();  // the downstream Shard drops its part of the session
    const uint64_t freed = s.positions;
    backend_.seq_rm(s.seq, -1, -1);
    kv_used_ -= s.positions;
    kv_reserved_ -= s.reserved;
    free_seqs_.push_back(s.seq);
    // lowest id first (back of a descending list): active sessions stay on consecutive ids
    std::sort(free_seqs_.begin(), free_seqs_.end(), std::greater<int32_t>());
    remember(id, s.epoch, tomb_kind);
    sessions_.erase(it);
    if (tomb_kind == kReleased) metrics_.sessions_released++;
    if (tomb_kind == kEvicted) metrics_.sessions_evicted++;
    if (tomb_kind == kCancelled) metrics_.sessions_cancelled++;
    publish_gauges();
    return freed;
}

bool Scheduler::make_room(uint64_t cells, bool need_session, const std::string & requester) {
    const auto now = Clock::now();
    for (;;) {
        const bool sessions_full = need_session && sessions_.size() >= opts_.max_sessions;
        const bool kv_full = kv_used_ + kv_reserved_ + cells > opts_.kv_cells;
        if (!sessions_full && !kv_full) return true;
        Session * lru = nullptr;
        for (auto & kv : sessions_) {
            Session & s = *kv.second;
            if (s.busy || s.id == requester) continue;
            if (std::chrono::duration<double>(now - s.last_used).count() < opts_.evict_idle_s) continue;
            if (!lru || s.last_used < lru->last_used) lru = &s;
        }
        if (!lru) return false;
        std::fprintf(stderr, "dgr-worker: evicting idle session (LRU) to admit new work\n");
        drop_session(lru->id, kEvicted);
    }
}

void Scheduler::sweep_ttl(Clock::time_point now) {
    std::vector<std::string> expired;
    for (auto & kv : sessions_) {
        const Session & s = *kv.second;
        if (!s.busy && std::chrono::duration<double>(now - s.last_used).count() >= opts_.session_ttl_s) {
            expired.push_back(kv.first);
        }
    }
    for (const auto & id : expired) drop_session(id, kEvicted);
}

void Scheduler::answer_error(StreamSink & sink, const pb::ResponseHeader & hdr, pb::ShardError err,
                             Clock::time_point t0, pb::CacheResult cache, bool internal) {
    pb::SessionResponse r;
    *r.mutable_header() = hdr;
    r.mutable_header()->set_cache_result(cache);
    *r.mutable_error() = std::move(err);
    metrics_.step_errors++;
    metrics_.step_latency.observe(seconds_since(t0));
    if (!internal) queued_--;
    sink.deliver(std::move(r), false, grpc::Status::OK, !internal);
}

bool Scheduler::has_unanswered_frame(const Session & s) const {
    if (!s.busy) return false;
    if (s.awaiting) return !s.pending_internal;
    for (const auto * q : {&decode_q_, &prefill_q_}) {
        for (const auto & w : *q) {
            if (w->session_id == s.id) return !w->internal;
        }
    }
    return false;
}

bool Scheduler::dispatch(std::deque<Event> & evs) {
    for (size_t ei = 0; ei < evs.size(); ++ei) {
        Event & ev = evs[ei];
        switch (ev.kind) {
            case Event::frame: handle_frame(ev); break;
            case Event::closed: handle_closed(ev); break;
            case Event::down_reply: handle_down_reply(ev); break;
            case Event::down_end: handle_down_end(ev); break;
            case Event::release: {
                pb::ReleaseSessionResponse resp;
                auto it = sessions_.find(ev.session_id);
                if (it != sessions_.end() && (ev.epoch == 0 || ev.epoch == it->second->epoch)) {
                    auto sink = it->second->sink;
                    const bool had_work = it->second->busy;
                    const bool unanswered = has_unanswered_frame(*it->second);
                    pb::ResponseHeader hdr;
                    hdr.set_schema_version(pb::SCHEMA_VERSION_V1);
                    hdr.set_session_id(ev.session_id);
                    hdr.set_route_epoch(it->second->epoch);
                    resp.set_freed_kv_cells(drop_session(ev.session_id, kReleased));
                    resp.set_released(true);
                    if (had_work && sink) {
                        // the queued frame is answered, so its stream can go on reading;
                        // server-side generation is told why it stopped
                        if (unanswered) queued_++;
                        answer_error(*sink, hdr, make_error(pb::ERROR_REASON_SESSION_RELEASED,
                                                           unanswered ? "the session was released while this step was queued"
                                                                      : "the session was released while generating"),
                                     Clock::now(), pb::CACHE_RESULT_UNSPECIFIED, !unanswered);
                    }
                }
                ev.release_done(resp);
                break;
            }
            case Event::cancel: {
                pb::CancelSessionResponse resp;
                auto it = sessions_.find(ev.session_id);
                if (it != sessions_.end() && (ev.epoch == 0 || ev.epoch == it->second->epoch)) {
                    auto sink = it->second->sink;
                    pb::ResponseHeader hdr;
                    hdr.set_schema_version(pb::SCHEMA_VERSION_V1);
                    hdr.set_session_id(ev.session_id);
                    hdr.set_route_epoch(it->second->epoch);
                    drop_session(ev.session_id, kCancelled);
                    resp.set_cancelled(true);
                    if (sink) {
                        pb::SessionResponse r;
                        *r.mutable_header() = hdr;
                        *r.mutable_error() = make_error(pb::ERROR_REASON_CANCELLED, "the session was cancelled", true);
                        sink->deliver(std::move(r), true, grpc::Status(grpc::StatusCode::CANCELLED, "session cancelled"));
                    }
                }
                ev.cancel_done(resp);
                break;
            }
            case Event::stop: {
                const grpc::Status st((grpc::StatusCode) ev.epoch, ev.session_id);
                std::deque<Event> late;
                {
                    std::lock_guard<std::mutex> lk(mu_);
                    stopped_ = true;
                    late.swap(inbox_);
                }
                std::vector<std::string> ids;
                for (auto & kv : sessions_) ids.push_back(kv.first);
                for (const auto & id : ids) {
                    auto sink = sessions_[id]->sink;
                    pb::ResponseHeader hdr;
                    hdr.set_schema_version(pb::SCHEMA_VERSION_V1);
                    hdr.set_session_id(id);
                    hdr.set_route_epoch(sessions_[id]->epoch);
                    drop_session(id, kReleased);
                    if (sink) {
                        pb::SessionResponse r;
                        *r.mutable_header() = hdr;
                        *r.mutable_error() = make_error(pb::ERROR_REASON_UNAVAILABLE,
                                                        "the worker is shutting down; restart the session elsewhere", true);
                        sink->deliver(std::move(r), true, st);
                    }
                }
                // events behind the stop (and in this drain) are answered like late ones
                for (size_t qi = 0; qi < 2; ++qi) {
                    std::deque<Event> & q = qi == 0 ? evs : late;
                    for (size_t k = qi == 0 ? ei + 1 : 0; k < q.size(); ++k) {
                        Event & e = q[k];
                        if (e.kind == Event::frame) {
                            queued_--;
                            pb::SessionResponse r;
                            r.mutable_header()->set_schema_version(pb::SCHEMA_VERSION_V1);
                            *r.mutable_error() = make_error(pb::ERROR_REASON_UNAVAILABLE, "the worker is shutting down", true);
                            e.sink->deliver(std::move(r), true, st);
                        } else if (e.kind == Event::closed) {
                            e.sink->finish(grpc::Status::OK);
                        } else if (e.kind == Event::release) {
                            e.release_done(pb::ReleaseSessionResponse());
                        } else if (e.kind == Event::cancel) {
                            e.cancel_done(pb::CancelSessionResponse());
                        }
                    }
                }
                publish_gauges();
                return false;
            }
        }
    }
    return true;
}

void Scheduler::loop() {
    for (;;) {
        std::deque<Event> evs;
        {
            std::unique_lock<std::mutex> lk(mu_);
            if (inbox_.empty() && decode_q_.empty() && prefill_q_.empty()) {
                cv_.wait_for(lk, std::chrono::milliseconds(500));
            }
            evs.swap(inbox_);
        }
        if (!dispatch(evs)) return;
        // Gather: sessions that just got a decode answer usually send their next step within
        // a client round trip; waiting a little (<= 25% of the last decode call, <= 5 ms) for
        // them turns staggered arrivals into one batch instead of several small ones.
        // Chained sessions generating over a route on this same host are waited for longer (up
        // to 3 decode calls, <= 250 ms): their next row comes back after the other shards have
        // computed, and if this shard ran the ones already back in the meantime, two groups of
        // sessions would alternate between the shards and both processes would compute at the
        // same time on shared cores (measured: SmolLM2 0:15|15:30, 4 sessions, 2 cores, 2 rows
        // per batch and ~3x slower). Routes across hosts keep the short wait: there the shards
        // computing different groups at once is the pipeline working.
        if (!decode_q_.empty() && prefill_q_.empty() && last_decode_s_ > 0.0) {
            const auto t_gather = Clock::now();
            auto after = [&](double s) {
                return t_gather + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
            };
            const auto short_deadline = after(std::min(0.005, 0.25 * last_decode_s_));
            const auto long_deadline = after(std::min(0.25, 3.0 * last_decode_s_ + 0.005));
            for (;;) {
                const Expected e = expected_decoders();
                if (!prefill_q_.empty() || (e.plain == 0 && e.colocated_chain == 0)) break;
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
        }
        const auto now = Clock::now();
        if (std::chrono::duration<double>(now - last_sweep_).count() >= 1.0) {
            sweep_ttl(now);
            last_sweep_ = now;
        }
        if (!decode_q_.empty() || !prefill_q_.empty()) run_batch();
        publish_gauges();
    }
}

Scheduler::Expected Scheduler::expected_decoders() const {
    Expected n;
    for (const auto & kv : sessions_) {
        const Session & s = *kv.second;
        if (s.awaiting && s.generating) {
            // chained heads that generate get their next row when the route answers
            (s.down_colocated ? n.colocated_chain : n.plain)++;
        } else if (s.decoding && !s.busy) {
            n.plain++;
        }
    }
    return n;
}

void Scheduler::handle_closed(Event & ev) {
    const std::string & id = ev.sink->bound_session;
    auto it = sessions_.find(id);
    if (!id.empty() && it != sessions_.end() && it->second->sink == ev.sink) {
        drop_session(id, ev.cancelled ? kCancelled : kReleased);
    }
    ev.sink->finish(ev.cancelled ? grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled") : grpc::Status::OK);
}

void Scheduler::handle_frame(Event & ev) {
    StreamSink & sink = *ev.sink;
    const pb::SessionRequest & req = *ev.req;
    const bool fast = req.has_fast_decode();
    pb::ResponseHeader hdr;
    hdr.set_schema_version(pb::SCHEMA_VERSION_V1);
    auto fail = [&](pb::ErrorReason r, const std::string & msg, pb::CacheResult cache = pb::CACHE_RESULT_UNSPECIFIED) {
        answer_error(sink, hdr, make_error(r, msg), ev.t0, cache);
    };
    if (!fast && !req.has_step()) return fail(pb::ERROR_REASON_BAD_REQUEST, "empty SessionRequest");

    std::string sid;
    uint64_t epoch = 0, step = 0;
    pb::Phase phase;
    uint32_t p0 = 0, p1 = 0;
    pb::CacheExpectationKind expect = pb::CACHE_EXPECTATION_KIND_UNSPECIFIED;
    uint32_t expect_pos = 0;
    uint32_t eff = info_.layer_start;
    const pb::StepFrame * sf = fast ? nullptr : &req.step();
    if (fast) {
        const auto & f = req.fast_decode();
        sid = f.session_id();
        epoch = f.route_epoch();
        step = f.step();
        phase = pb::PHASE_DECODE;
        p0 = f.position();
        p1 = p0 + 1;
        expect = pb::CACHE_EXPECTATION_KIND_POSITION;
        expect_pos = p0;
        hdr.set_request_id(f.request_id());
    } else {
        const auto & h = sf->header();
        sid = h.session_id();
        epoch = h.route_epoch();
        step = h.step();
        phase = h.phase();
        p0 = h.positions().start();
        p1 = h.positions().end();
        expect = h.cache_expectation().kind();
        expect_pos = h.cache_expectation().position();
        hdr.set_request_id(h.request_id());
    }
    hdr.set_session_id(sid);
    hdr.set_route_epoch(epoch);
    hdr.set_step(step);
    hdr.set_phase(phase);
    hdr.mutable_positions()->set_start(p0);
    hdr.mutable_positions()->set_end(p1);
    hdr.set_compression(pb::COMPRESSION_NONE);

    if (!fast) {
        const auto & h = sf->header();
        if (h.schema_version() != pb::SCHEMA_VERSION_V1) {
            return fail(pb::ERROR_REASON_SCHEMA_UNSUPPORTED, "schema_version must be SCHEMA_VERSION_V1 (1)");
        }
        if (h.compatibility_fingerprint() != info_.fingerprint) {
            return fail(pb::ERROR_REASON_FINGERPRINT_MISMATCH,
                        "compatibility fingerprint differs from this worker's (" + info_.fingerprint + ")");
        }
        if (h.shard_range().start() != info_.layer_start || h.shard_range().end() != info_.layer_end) {
            return fail(pb::ERROR_REASON_RANGE_MISMATCH, "this worker serves layers [" + std::to_string(info_.layer_start) +
                                                             ", " + std::to_string(info_.layer_end) + ")");
        }
        eff = std::max<uint32_t>(h.effective_start(), info_.layer_start);
        if (eff >= info_.layer_end) return fail(pb::ERROR_REASON_RANGE_MISMATCH, "effective_start outside the served range");
        if (eff != info_.layer_start) {
            return fail(pb::ERROR_REASON_RANGE_MISMATCH,
                        "this worker runs its whole range: effective_start must be unset or the shard start");
        }
        if (h.compression() != pb::COMPRESSION_UNSPECIFIED && h.compression() != pb::COMPRESSION_NONE) {
            return fail(pb::ERROR_REASON_UNSUPPORTED_COMPRESSION, "this worker accepts COMPRESSION_NONE only");
        }
        if (phase < pb::PHASE_PREFILL || phase > pb::PHASE_RELEASE) return fail(pb::ERROR_REASON_BAD_REQUEST, "phase must be set");
    }
    if (sid.empty() || sid.size() > 128) return fail(pb::ERROR_REASON_BAD_REQUEST, "session_id must be 1..128 bytes");
    if (epoch == 0) return fail(pb::ERROR_REASON_BAD_REQUEST, "route_epoch starts at 1");
    if (sink.bound_session.empty()) {
        sink.bound_session = sid;
    } else if (sink.bound_session != sid) {
        return fail(pb::ERROR_REASON_BAD_REQUEST, "one stream serves one session id");
    }

    // ---- session state: epoch, existence, idempotency, cache expectation ----
    auto it = sessions_.find(sid);
    Session * s = it == sessions_.end() ? nullptr : it->second.get();
    bool opening = false;
    if (s && epoch < s->epoch) {
        pb::ShardError e = make_error(pb::ERROR_REASON_STALE_EPOCH, "a newer epoch of this session exists");
        e.set_current_epoch(s->epoch);
        return answer_error(sink, hdr, e, ev.t0, pb::CACHE_RESULT_STALE);
    }
    if (!s) {
        auto t = tombstones_.find(sid);
        const bool tomb = t != tombstones_.end();
        if (tomb && epoch < t->second.epoch) {
            pb::ShardError e = make_error(pb::ERROR_REASON_STALE_EPOCH, "a newer epoch of this session existed");
            e.set_current_epoch(t->second.epoch);
            return answer_error(sink, hdr, e, ev.t0, pb::CACHE_RESULT_STALE);
        }
        if (tomb && epoch == t->second.epoch) {
            if (t->second.kind == kEvicted) {
                return fail(pb::ERROR_REASON_CACHE_MISS, "the session's state was evicted (TTL/LRU); restart with a new epoch",
                            pb::CACHE_RESULT_MISS);
            }
            return fail(pb::ERROR_REASON_SESSION_RELEASED, "this epoch of the session was released; open a new epoch");
        }
        if (expect != pb::CACHE_EXPECTATION_KIND_EMPTY) {
            if (expect == pb::CACHE_EXPECTATION_KIND_POSITION && !fast) {
                return fail(pb::ERROR_REASON_CACHE_MISS, "no state for this session and epoch", pb::CACHE_RESULT_MISS);
            }
            return fail(pb::ERROR_REASON_UNKNOWN_SESSION,
                        "no state for this session id; open it with CACHE_EXPECTATION_KIND_EMPTY");
        }
        opening = true;
    } else if (epoch > s->epoch) {
        if (expect != pb::CACHE_EXPECTATION_KIND_EMPTY) {
            return fail(pb::ERROR_REASON_CACHE_MISS, "a new epoch must open with CACHE_EXPECTATION_KIND_EMPTY",
                        pb::CACHE_RESULT_MISS);
        }
        opening = true;
    } else {
        if (s->sink != ev.sink && s->sink) {
            // the same (session, epoch) on a second stream: only replays make sense there
        }
        if (!s->down_failed.empty()) {
            const std::string why = down_label(*s) + ": " + s->down_failed;
            drop_session(sid, kReleased);
            pb::SessionResponse r;
            *r.mutable_header() = hdr;
            *r.mutable_error() = make_error(pb::ERROR_REASON_UNAVAILABLE, why, true);
            metrics_.step_errors++;
            queued_--;
            return sink.deliver(std::move(r), true, grpc::Status(grpc::StatusCode::UNAVAILABLE, why));
        }
        if (s->generating) {
            return fail(pb::ERROR_REASON_BAD_REQUEST,
                        "the session is generating (StepFrame.generate): wait for its last token, or cancel it");
        }
        if (s->busy) return fail(pb::ERROR_REASON_BAD_REQUEST, "a step of this session is already queued");
        const bool partial_of_step = s->partial && s->partial->step == step;
        if ((int64_t) step == s->last_step && s->has_stored && !partial_of_step) {
            pb::SessionResponse r = s->stored;
            r.mutable_header()->set_replayed(true);
            metrics_.replayed_steps++;
            metrics_.step_latency.observe(seconds_since(ev.t0));
            queued_--;
            s->last_used = Clock::now();
            return sink.deliver(std::move(r));
        }
        if ((int64_t) step != s->last_step + 1) {
            pb::ShardError e = make_error(pb::ERROR_REASON_STEP_OUT_OF_ORDER,
                                          "step must be last_step + 1 (or a replay of last_step)");
            e.set_last_step(s->last_step < 0 ? 0 : (uint64_t) s->last_step);
            return answer_error(sink, hdr, e, ev.t0);
        }
        if (expect == pb::CACHE_EXPECTATION_KIND_EMPTY) {
            pb::ShardError e = make_error(pb::ERROR_REASON_CACHE_MISS, "the session is already open for this epoch");
            e.set_cached_positions(s->positions);
            return answer_error(sink, hdr, e, ev.t0, pb::CACHE_RESULT_STALE);
        }
        if (expect == pb::CACHE_EXPECTATION_KIND_POSITION && expect_pos != s->positions) {
            pb::ShardError e = make_error(pb::ERROR_REASON_CACHE_MISS, "the worker holds a different number of positions");
            e.set_cached_positions(s->positions);
            return answer_error(sink, hdr, e, ev.t0, pb::CACHE_RESULT_STALE);
        }
        if (!fast && eff != s->effective_start) {
            return fail(pb::ERROR_REASON_RANGE_MISMATCH, "effective_start must stay the same for the life of the session");
        }
    }
    if (opening) {
        if (step != 0) {
            pb::ShardError e = make_error(pb::ERROR_REASON_STEP_OUT_OF_ORDER, "the first step of an epoch is 0");
            return answer_error(sink, hdr, e, ev.t0);
        }
        if (draining_) return fail(pb::ERROR_REASON_UNAVAILABLE, "the worker is draining; open the session elsewhere");
        if (fast) return fail(pb::ERROR_REASON_BAD_REQUEST, "a session opens with a full StepFrame");
    }
    const uint32_t held = opening ? 0 : s->positions;
    if (phase == pb::PHASE_PREFILL || phase == pb::PHASE_DECODE) {
        if (p0 != held && !(opening && p0 == 0)) {
            pb::ShardError e = make_error(pb::ERROR_REASON_POSITION_GAP, "positions.start must equal the positions held");
            e.set_cached_positions(held);
            return answer_error(sink, hdr, e, ev.t0, pb::CACHE_RESULT_STALE);
        }
    }
    hdr.set_cache_result(pb::CACHE_RESULT_HIT);

    // ---- phases without input ----
    if (phase == pb::PHASE_RELEASE || phase == pb::PHASE_TRUNCATE) {
        if (opening) return fail(pb::ERROR_REASON_BAD_REQUEST, "nothing to release or truncate in a new epoch");
        if (phase == pb::PHASE_TRUNCATE && s->down) {
            return fail(pb::ERROR_REASON_BAD_REQUEST, "TRUNCATE is not supported on a chained session; open a new epoch");
        }
        pb::SessionResponse r;
        if (phase == pb::PHASE_RELEASE) {
            drop_session(sid, kReleased);
            hdr.set_cached_positions(0);
        } else {
            if (p0 > s->positions) return fail(pb::ERROR_REASON_BAD_REQUEST, "truncation point beyond the positions held");
            backend_.seq_rm(s->seq, (int32_t) p0, -1);
            kv_used_ -= s->positions - p0;
            s->positions = p0;
            s->last_step = (int64_t) step;
            hdr.set_cached_positions(p0);
        }
        hdr.mutable_payload_checksum()->set_algorithm(pb::CHECKSUM_ALGORITHM_CRC32);
        hdr.mutable_payload_checksum()->set_value(0);
        *r.mutable_header() = hdr;
        if (phase == pb::PHASE_TRUNCATE) {
            s->stored = r;
            s->has_stored = true;
            s->last_used = Clock::now();
        }
        metrics_.steps++;
        metrics_.step_latency.observe(seconds_since(ev.t0));
        queued_--;
        return sink.deliver(std::move(r));
    }

    // ---- PREFILL / DECODE ----
    if (p1 <= p0) return fail(pb::ERROR_REASON_BAD_REQUEST, "positions must be a non-empty range");
    const uint32_t n = p1 - p0;
    if (phase == pb::PHASE_DECODE && n != 1) {
        pb::ShardError e = make_error(pb::ERROR_REASON_CHUNK_TOO_LARGE, "a DECODE step carries exactly one row");
        e.set_limit(1);
        return answer_error(sink, hdr, e, ev.t0);
    }
    if (n > opts_.max_prefill_chunk_tokens) {
        pb::ShardError e = make_error(pb::ERROR_REASON_CHUNK_TOO_LARGE, "PREFILL chunk above max_prefill_chunk_tokens");
        e.set_limit(opts_.max_prefill_chunk_tokens);
        return answer_error(sink, hdr, e, ev.t0);
    }
    if ((uint64_t) held + n > opts_.max_session_positions) {
        pb::ShardError e = make_error(pb::ERROR_REASON_OVER_BUDGET, "the session would exceed max_session_positions");
        e.set_limit(opts_.max_session_positions);
        metrics_.rejected_kv++;
        return answer_error(sink, hdr, e, ev.t0);
    }
    SamplingConfig sampling;
    bool new_sampling = false;
    if (!fast && sf->has_sampling() && (info_.tail || sf->downstream_size() > 0 || (s && s->down))) {
        sampling = to_config(sf->sampling());
        const std::string bad = validate_sampling(sampling);
        if (!bad.empty()) return fail(pb::ERROR_REASON_BAD_REQUEST, "sampling: " + bad);
        new_sampling = true;
    }
    auto w = std::make_unique<Work>();
    w->session_id = sid;
    w->decode = phase == pb::PHASE_DECODE;
    w->pos0 = p0;
    w->n = n;
    w->sample = fast ? true : sf->sample();
    w->t0 = ev.t0;
    if (info_.head) {
        const bool has_tokens = fast ? req.fast_decode().input_case() == pb::FastDecodeFrame::kTokenId : sf->has_tokens();
        const bool has_bundle = fast ? req.fast_decode().has_bundle() : sf->has_bundle();
        if (!has_tokens) {
            return fail(has_bundle ? pb::ERROR_REASON_ROLE_MISMATCH : pb::ERROR_REASON_BAD_REQUEST,
                        has_bundle ? "this shard is a head: it takes token ids, not a bundle" : "the step carries no tokens");
        }
        if (fast) {
            w->tokens.push_back(req.fast_decode().token_id());
        } else {
            w->tokens.assign(sf->tokens().token_ids().begin(), sf->tokens().token_ids().end());
        }
        if (w->tokens.size() != n) return fail(pb::ERROR_REASON_BAD_REQUEST, "token count != positions.end - positions.start");
        for (int32_t t : w->tokens) {
            if (t < 0 || (uint32_t) t >= info_.n_vocab) {
                return fail(pb::ERROR_REASON_TOKEN_OUT_OF_VOCAB,
                            "token id " + std::to_string(t) + " outside [0, " + std::to_string(info_.n_vocab) + ")");
            }
        }
        if (!fast && sf->header().payload_checksum().algorithm() == pb::CHECKSUM_ALGORITHM_CRC32 &&
            crc32_tokens(w->tokens.data(), w->tokens.size()) != sf->header().payload_checksum().value()) {
            return fail(pb::ERROR_REASON_BAD_BUNDLE, "payload checksum mismatch over the token ids");
        }
    } else {
        const bool has_bundle = fast ? req.fast_decode().has_bundle() : sf->has_bundle();
        const bool has_tokens = fast ? req.fast_decode().input_case() == pb::FastDecodeFrame::kTokenId : sf->has_tokens();
        if (!has_bundle) {
            return fail(has_tokens ? pb::ERROR_REASON_ROLE_MISMATCH : pb::ERROR_REASON_BAD_REQUEST,
                        has_tokens ? "this shard is not a head: it takes a boundary bundle, not token ids"
                                   : "the step carries no bundle");
        }
        const pb::TensorBundle & b = fast ? req.fast_decode().bundle() : sf->bundle();
        if (!fast && sf->header().payload_checksum().algorithm() == pb::CHECKSUM_ALGORITHM_CRC32) {
            uint32_t c = 0;
            for (const auto & t : b.tensors()) {
                for (const auto & f : t.fragments()) c = crc32(f.data().data(), f.data().size(), c);
            }
            if (c != sf->header().payload_checksum().value()) {
                return fail(pb::ERROR_REASON_BAD_BUNDLE, "payload checksum mismatch over the frame's fragments");
            }
        }
        std::unique_ptr<Partial> local;
        Partial * part = nullptr;
        if (s && !opening && s->partial && s->partial->step == step) {
            part = s->partial.get();
        } else {
            local = std::make_unique<Partial>(step, n, info_.n_embd, opts_.max_message_bytes, opts_.max_fragment_bytes);
            part = local.get();
        }
        BundleIssue is = part->asm_.add(b);
        if (!is.ok()) {
            if (s && !local) s->partial.reset();
            pb::ShardError e = make_error(is.reason, is.message);
            e.set_limit(is.limit);
            return answer_error(sink, hdr, e, ev.t0);
        }
        if (!part->asm_.complete()) {
            if (opening) {
                return fail(pb::ERROR_REASON_BAD_REQUEST, "the opening step's bundle must arrive in one frame");
            }
            if (local) s->partial = std::move(local);
            queued_--;
            return sink.resume();
        }
        is = part->asm_.finish(&w->rows);
        if (s && !local) s->partial.reset();
        if (!is.ok()) return answer_error(sink, hdr, make_error(is.reason, is.message), ev.t0);
    }

    // ---- chained route and server-side generation ----
    const bool chain_req = !fast && opening && sf->downstream_size() > 0;
    if (chain_req) {
        if (info_.tail) return fail(pb::ERROR_REASON_BAD_REQUEST, "this shard is the route's tail: it has no downstream");
        uint32_t at = info_.layer_end;
        for (int i = 0; i < sf->downstream_size(); ++i) {
            const pb::ChainHop & h = sf->downstream(i);
            const std::string where = "downstream[" + std::to_string(i) + "] (" + h.endpoint() + ")";
            if (h.range().start() != at || h.range().end() <= h.range().start()) {
                return fail(pb::ERROR_REASON_RANGE_MISMATCH, where + " covers [" + std::to_string(h.range().start()) + ", " +
                                                                 std::to_string(h.range().end()) + "); expected a range starting at layer " +
                                                                 std::to_string(at));
            }
            if (h.compatibility_fingerprint() != info_.fingerprint) {
                return fail(pb::ERROR_REASON_FINGERPRINT_MISMATCH, where + " has another compatibility fingerprint than this worker");
            }
            if (!peer_allowed(peers_.options(), h.endpoint())) {
                return fail(pb::ERROR_REASON_BAD_REQUEST,
                            where + " is not an allowed peer of this worker (dgr-worker --chain-peers; default: loopback)");
            }
            at = h.range().end();
        }
        if (at != info_.n_layer) {
            return fail(pb::ERROR_REASON_RANGE_MISMATCH, "the downstream hops end at layer " + std::to_string(at) +
                                                             "; the model has " + std::to_string(info_.n_layer));
        }
    }
    const bool gen_req = !fast && sf->has_generate();
    if (gen_req) {
        if (!info_.head) return fail(pb::ERROR_REASON_BAD_REQUEST, "StepFrame.generate is for head Shards");
        if (!w->sample) return fail(pb::ERROR_REASON_BAD_REQUEST, "StepFrame.generate needs sample = true");
        const bool chained = chain_req || (s && !opening && s->down);
        if (!info_.tail && !chained) {
            return fail(pb::ERROR_REASON_BAD_REQUEST,
                        "StepFrame.generate needs the route's tail: this worker is not the tail and the session has no downstream");
        }
    }

    // ---- admission: session slot and KV cells ----
    if (!make_room(n, opening, sid)) {
        const bool sessions_full = opening && sessions_.size() >= opts_.max_sessions;
        pb::ShardError e = make_error(pb::ERROR_REASON_OVER_BUDGET,
                                      sessions_full ? "max sessions reached; retry later or elsewhere"
                                                    : "KV cells budget exhausted; retry later or elsewhere");
        e.set_limit(sessions_full ? opts_.max_sessions : opts_.kv_cells);
        (sessions_full ? metrics_.rejected_sessions : metrics_.rejected_kv)++;
        return answer_error(sink, hdr, e, ev.t0);
    }
    if (opening) {
        if (s) {
            // a newer epoch supersedes the older one: its stream (if another) ends
            auto old_sink = s->sink;
            pb::ResponseHeader oh;
            oh.set_schema_version(pb::SCHEMA_VERSION_V1);
            oh.set_session_id(sid);
            oh.set_route_epoch(s->epoch);
            drop_session(sid, kReleased);
            if (old_sink && old_sink != ev.sink) {
                pb::SessionResponse r;
                *r.mutable_header() = oh;
                pb::ShardError e = make_error(pb::ERROR_REASON_STALE_EPOCH, "superseded by a newer epoch", true);
                e.set_current_epoch(epoch);
                *r.mutable_error() = e;
                old_sink->deliver(std::move(r), true, grpc::Status(grpc::StatusCode::ABORTED, "superseded by a newer epoch"));
            }
        }
        auto ns = std::make_unique<Session>();
        ns->id = sid;
        ns->epoch = epoch;
        ns->seq = free_seqs_.back();
        free_seqs_.pop_back();
        ns->effective_start = eff;
        ns->sink = ev.sink;
        ns->generation = next_generation_++;
        s = ns.get();
        sessions_[sid] = std::move(ns);
        metrics_.sessions_opened++;
        publish_gauges();
    }
    s->sink = ev.sink;
    if (chain_req) {
        const pb::ChainHop & hop = sf->downstream(0);
        s->down_hop = hop;
        s->down_rest.assign(sf->downstream().begin() + 1, sf->downstream().end());
        s->down_colocated = std::all_of(sf->downstream().begin(), sf->downstream().end(), [](const pb::ChainHop & h) {
            return is_loopback_host(endpoint_host(h.endpoint()));
        });
        const uint64_t gen = s->generation;
        s->down = DownstreamLink::open(
            peers_.stub(hop.endpoint()), hop.endpoint(),
            [this, sid, gen](pb::SessionResponse r) { post_downstream(sid, gen, std::move(r)); },
            [this, sid, gen](const grpc::Status & st) { post_downstream_end(sid, gen, st); });
    }
    if (new_sampling && info_.tail) {
        if (opening || sampling.seed != s->sampling.seed) s->rng.seed(sampling.seed);
        s->sampling = sampling;
    } else if (opening) {
        s->rng.seed(0);
    }
    if (new_sampling && s->down) s->fwd_sampling = std::make_unique<pb::SamplingParams>(sf->sampling());
    if (gen_req) {
        s->generating = true;
        s->gen_left = std::max<uint32_t>(1, sf->generate().max_tokens());
        s->gen_continue = sf->generate().continue_after_finish();
        s->gen_per_answer = std::max<uint32_t>(1, sf->generate().tokens_per_answer());
    }
    s->busy = true;
    s->reserved = n;
    s->last_used = Clock::now();
    kv_reserved_ += n;
    w->generation = s->generation;
    w->header = hdr;
    w->header.mutable_computed_range()->set_start(s->effective_start);
    w->header.mutable_computed_range()->set_end(info_.layer_end);
    w->t_ready = Clock::now();
    (w->decode ? decode_q_ : prefill_q_).push_back(std::move(w));
}

void Scheduler::run_batch() {
    const uint32_t B = opts_.max_batch_tokens;
    const uint32_t decode_cap = prefill_q_.empty() ? B : B - opts_.max_prefill_chunk_tokens;
    std::vector<std::unique_ptr<Work>> items;
    uint32_t rows = 0;
    while (!decode_q_.empty() && rows + 1 <= decode_cap) {
        items.push_back(std::move(decode_q_.front()));
        decode_q_.pop_front();
        rows += 1;
    }
    while (!prefill_q_.empty() && rows + prefill_q_.front()->n <= B) {
        rows += prefill_q_.front()->n;
        items.push_back(std::move(prefill_q_.front()));
        prefill_q_.pop_front();
    }
    if (items.empty()) return;
    // rows ordered by sequence id: with one KV stream per sequence llama.cpp puts only
    // consecutive increasing sequence ids into one ubatch (split_equal, sequential)
    std::stable_sort(items.begin(), items.end(), [this](const std::unique_ptr<Work> & a, const std::unique_ptr<Work> & b) {
        return sessions_.at(a->session_id)->seq < sessions_.at(b->session_id)->seq;
    });
    DecodeBatch batch;
    std::vector<int32_t> last_row(items.size());
    std::vector<int32_t> first_row(items.size());
    std::vector<Session *> sess(items.size());
    const uint32_t E = info_.n_embd;
    uint64_t n_prefill = 0, n_decode = 0;
    const auto now = Clock::now();
    for (size_t k = 0; k < items.size(); ++k) {
        Work & w = *items[k];
        Session * s = sessions_.at(w.session_id).get();
        sess[k] = s;
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
            batch.output.push_back(info_.tail ? (i + 1 == w.n && w.sample) : 1);
        }
        last_row[k] = batch.n_rows() - 1;
        (w.decode ? n_decode : n_prefill) += w.n;
    }
    std::string err;
    const auto t_dec = Clock::now();
    const BackendStatus st = backend_.decode(batch, &err);
    const double took = seconds_since(t_dec);
    metrics_.busy_seconds = metrics_.busy_seconds.load() + took;
    if (n_prefill == 0) last_decode_s_ = last_decode_s_ > 0.0 ? 0.8 * last_decode_s_ + 0.2 * took : took;
    if (st != BackendStatus::ok) {
        std::fprintf(stderr, "dgr-worker: decode of %d rows failed: %s\n", batch.n_rows(), err.c_str());
        for (size_t k = 0; k < items.size(); ++k) {
            Work & w = *items[k];
            Session & s = *sess[k];
            auto sink = s.sink;
            if (st == BackendStatus::resource_exhausted) {
                s.busy = false;
                s.generating = false;
                kv_reserved_ -= s.reserved;
                s.reserved = 0;
                backend_.seq_rm(s.seq, (int32_t) s.positions, -1);
                pb::ShardError e = make_error(pb::ERROR_REASON_OVER_BUDGET, "no KV slot for the batch: " + err);
                e.set_limit(opts_.kv_cells);
                if (sink) {
                    answer_error(*sink, w.header, e, w.t0, pb::CACHE_RESULT_UNSPECIFIED, w.internal);
                } else if (!w.internal) {
                    queued_--;
                }
            } else {
                drop_session(w.session_id, kReleased);
                if (!w.internal) queued_--;  // this popped item (drop_session counts only queued ones)
                if (sink) {
                    pb::SessionResponse r;
                    *r.mutable_header() = w.header;
                    *r.mutable_error() = make_error(pb::ERROR_REASON_INTERNAL, "decode failed: " + err, true);
                    sink->deliver(std::move(r), true, grpc::Status(grpc::StatusCode::INTERNAL, "decode failed"));
                }
            }
        }
        return;
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
    for (size_t k = 0; k < items.size(); ++k) {
        Work & w = *items[k];
        Session & s = *sess[k];
        s.positions += w.n;
        kv_used_ += w.n;
        kv_reserved_ -= s.reserved;
        s.reserved = 0;
        s.busy = false;
        s.decoding = w.decode;
        s.last_step = (int64_t) w.header.step();
        s.last_used = Clock::now();
        pb::SessionResponse r;
        *r.mutable_header() = w.header;
        r.mutable_header()->set_cached_positions(s.positions);
        auto * ck = r.mutable_header()->mutable_payload_checksum();
        ck->set_algorithm(pb::CHECKSUM_ALGORITHM_CRC32);
        int32_t sampled = -1;
        bool finished = false;
        if (info_.tail) {
            auto * tail = r.mutable_tail();
            if (w.sample) {
                const float * logits = backend_.output_row(last_row[k]);
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
                ck->set_value(crc32_tokens(&sr.token, 1));
                sampled = sr.token;
                finished = t->finish_reason() != pb::FINISH_REASON_UNSPECIFIED;
            } else {
                ck->set_value(0);
            }
        } else {
            std::vector<float> out((size_t) w.n * E);
            for (uint32_t i = 0; i < w.n; ++i) {
                const float * row = backend_.output_row(first_row[k] + (int32_t) i);
                std::copy(row, row + E, out.begin() + (size_t) i * E);
            }
            uint32_t crc = 0;
            *r.mutable_boundary() = make_residual_bundle(out.data(), w.n, E, opts_.max_fragment_bytes, &crc);
            ck->set_value(crc);
        }
        if (s.down) {  // chained route: the answer comes from downstream
            forward(s, w, r);
            continue;
        }
        s.stored = r;
        s.has_stored = true;
        metrics_.steps++;
        metrics_.step_latency.observe(seconds_since(w.t0));
        if (!w.internal) queued_--;
        if (s.sink) {
            if (holds_answer(s, w.internal, finished)) {
                s.sink->hold(std::move(r), s.gen_per_answer);
            } else {
                s.sink->deliver(std::move(r), false, grpc::Status::OK, !w.internal);
            }
        }
        if (s.generating) {
            if (sampled >= 0) {
                continue_generation(s, w.header, sampled, finished);
            } else {
                s.generating = false;
            }
        }
    }
}

std::string Scheduler::down_label(const Session & s) {
    return "downstream " + s.down_hop.endpoint() + " [" + std::to_string(s.down_hop.range().start()) + ", " +
           std::to_string(s.down_hop.range().end()) + ")";
}

namespace {
std::string code_name(grpc::StatusCode c) {
    switch (c) {
        case grpc::StatusCode::OK: return "OK";
        case grpc::StatusCode::CANCELLED: return "CANCELLED";
        case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
        case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
        case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
        case grpc::StatusCode::ABORTED: return "ABORTED";
        case grpc::StatusCode::INTERNAL: return "INTERNAL";
        case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
        case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
        default: return "status " + std::to_string((int) c);
    }
}
}  // namespace

void Scheduler::forward(Session & s, const Work & w, pb::SessionResponse & r) {
    s.busy = true;
    s.awaiting = true;
    s.pending_header = r.header();
    s.pending_internal = w.internal;
    s.pending_t0 = w.t0;
    if (!w.internal) queued_--;  // in flight downstream, no longer queued here
    if (!s.down_failed.empty()) {
        pb::SessionResponse d;
        *d.mutable_error() = make_error(pb::ERROR_REASON_UNAVAILABLE, s.down_failed, true);
        Event ev;
        ev.session_id = s.id;
        ev.epoch = s.generation;
        ev.resp = std::make_unique<pb::SessionResponse>(std::move(d));
        s.down_failed.clear();  // the message is in the answer already
        return handle_down_reply(ev);
    }
    pb::SessionRequest fr;
    const uint32_t crc = r.header().payload_checksum().value();
    const bool full = !s.down_opened || !w.decode || !w.sample || s.fwd_sampling;
    if (full) {
        auto * f = fr.mutable_step();
        auto * h = f->mutable_header();
        h->set_schema_version(pb::SCHEMA_VERSION_V1);
        h->set_request_id(w.header.request_id());
        h->set_session_id(s.id);
        h->set_route_epoch(s.epoch);
        h->set_compatibility_fingerprint(s.down_hop.compatibility_fingerprint());
        *h->mutable_shard_range() = s.down_hop.range();
        h->set_effective_start(s.down_hop.range().start());
        h->set_phase(w.decode ? pb::PHASE_DECODE : pb::PHASE_PREFILL);
        h->mutable_positions()->set_start(w.pos0);
        h->mutable_positions()->set_end(w.pos0 + w.n);
        h->set_step(s.down_step);
        if (!s.down_opened) {
            h->mutable_cache_expectation()->set_kind(pb::CACHE_EXPECTATION_KIND_EMPTY);
        } else {
            h->mutable_cache_expectation()->set_kind(pb::CACHE_EXPECTATION_KIND_POSITION);
            h->mutable_cache_expectation()->set_position(w.pos0);
        }
        h->set_compression(pb::COMPRESSION_NONE);
        h->mutable_payload_checksum()->set_algorithm(pb::CHECKSUM_ALGORITHM_CRC32);
        h->mutable_payload_checksum()->set_value(crc);
        *f->mutable_bundle() = std::move(*r.mutable_boundary());
        if (s.fwd_sampling) {
            *f->mutable_sampling() = *s.fwd_sampling;
            s.fwd_sampling.reset();
        }
        f->set_sample(w.sample);
        if (!s.down_opened) {
            for (const auto & hop : s.down_rest) *f->add_downstream() = hop;
        }
    } else {
        auto * f = fr.mutable_fast_decode();
        f->set_session_id(s.id);
        f->set_route_epoch(s.epoch);
        f->set_step(s.down_step);
        f->set_position(w.pos0);
        *f->mutable_bundle() = std::move(*r.mutable_boundary());
        f->set_request_id(w.header.request_id());
    }
    s.down_step++;
    s.down_opened = true;
    s.down_sent_t0 = Clock::now();
    s.down_sent_decode = w.decode;
    const size_t bytes = s.down->send(std::move(fr));
    (w.decode ? metrics_.chain_frames_decode : metrics_.chain_frames_prefill)++;
    (w.decode ? metrics_.chain_bytes_decode : metrics_.chain_bytes_prefill) += bytes;
}

void Scheduler::handle_down_reply(Event & ev) {
    auto it = sessions_.find(ev.session_id);
    if (it == sessions_.end() || it->second->generation != ev.epoch || !it->second->awaiting) return;
    Session & s = *it->second;
    s.awaiting = false;
    s.busy = false;
    s.last_used = Clock::now();
    const pb::SessionResponse & d = *ev.resp;
    const bool internal = s.pending_internal;
    const pb::ResponseHeader hdr = s.pending_header;
    auto sink = s.sink;
    if (d.result_case() != pb::SessionResponse::kTail) {
        pb::ShardError e = d.has_error() ? d.error()
                                         : make_error(pb::ERROR_REASON_INTERNAL, "answered without a TailOutput");
        e.set_message(down_label(s) + ": " + e.message());
        e.set_session_terminated(true);
        const Clock::time_point t0 = s.pending_t0;
        s.generating = false;
        drop_session(ev.session_id, kReleased);  // also ends the downstream stream
        if (sink) {  // the session is gone: the stream ends with the error's status
            pb::SessionResponse r;
            *r.mutable_header() = hdr;
            metrics_.step_errors++;
            metrics_.step_latency.observe(seconds_since(t0));
            const grpc::Status st((grpc::StatusCode) e.grpc_code(), e.message());
            *r.mutable_error() = std::move(e);
            sink->deliver(std::move(r), true, st);
        }
        return;
    }
    metrics_.observe_chain_hop(s.down_sent_decode, seconds_since(s.down_sent_t0));
    pb::SessionResponse r;
    *r.mutable_header() = hdr;
    *r.mutable_header()->mutable_payload_checksum() = d.header().payload_checksum();
    *r.mutable_tail() = d.tail();
    s.stored = r;
    s.has_stored = true;
    metrics_.steps++;
    metrics_.step_latency.observe(seconds_since(s.pending_t0));
    const bool finished = d.tail().tokens_size() > 0 &&
                          d.tail().tokens(0).finish_reason() != pb::FINISH_REASON_UNSPECIFIED;
    if (sink) {
        if (holds_answer(s, internal, finished)) {
            sink->hold(std::move(r), s.gen_per_answer);
        } else {
            sink->deliver(std::move(r), false, grpc::Status::OK, !internal);
        }
    }
    if (s.generating) {
        if (d.tail().tokens_size() > 0) {
            const auto & t = d.tail().tokens(0);
            continue_generation(s, hdr, t.token_id(), t.finish_reason() != pb::FINISH_REASON_UNSPECIFIED);
        } else {
            s.generating = false;
        }
    }
}

void Scheduler::handle_down_end(Event & ev) {
    auto it = sessions_.find(ev.session_id);
    if (it == sessions_.end() || it->second->generation != ev.epoch || !it->second->down) return;
    Session & s = *it->second;
    std::string why = "ended the session stream: " + code_name(ev.status.error_code());
    if (!ev.status.error_message().empty()) why += ": " + ev.status.error_message();
    if (s.awaiting) {
        pb::SessionResponse d;
        *d.mutable_error() = make_error(pb::ERROR_REASON_UNAVAILABLE, why, true);  // the endpoint is prefixed there
        Event rep;
        rep.session_id = ev.session_id;
        rep.epoch = ev.epoch;
        rep.resp = std::make_unique<pb::SessionResponse>(std::move(d));
        return handle_down_reply(rep);
    }
    s.down_failed = why;
}

bool Scheduler::holds_answer(const Session & s, bool internal, bool finished) {
    // a generated token (not the frame's own first one) that more tokens will follow
    return internal && s.generating && s.gen_per_answer > 1 && s.gen_left > 1 && !finished;
}

void Scheduler::continue_generation(Session & s, const pb::ResponseHeader & last, int32_t token, bool finished) {
    if (!s.generating) return;
    if (s.gen_left > 0) s.gen_left--;
    if (s.gen_left == 0 || (finished && !s.gen_continue)) {
        s.generating = false;
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
        s.generating = false;
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
    s.busy = true;
    s.reserved = 1;
    kv_reserved_ += 1;
    metrics_.generated_tokens++;
    decode_q_.push_back(std::move(w));
}

}  // namespace dgr::worker
