// Over 500 lines on purpose: one handler per RPC of the service, each short, in one table.
#include "worker/service.h"

#include "worker/errors.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

namespace dgr::worker {

namespace {
class StreamHandle;
}

// Runs the stream writes the scheduler hands over. StartWrite serializes the response and
// writes to the transport inline (measured: ~0.25 ms per token on the scheduler thread, 2-4 %
// of a SmolLM2 decode step at one session); done here, the next llama_decode starts at once.
class Deliverer {
public:
    Deliverer() : thread_([this] { loop(); }) {}
    ~Deliverer() { stop(); }
    // Pumps `h` on the delivery thread (inline once stopped).
    void schedule(std::shared_ptr<StreamHandle> h);
    // At `when`, sends what `h` holds (hold()) if it is still held by then.
    void flush_at(std::weak_ptr<StreamHandle> h, std::chrono::steady_clock::time_point when);
    void stop();

private:
    void loop();
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::shared_ptr<StreamHandle>> q_;
    std::deque<std::pair<std::chrono::steady_clock::time_point, std::weak_ptr<StreamHandle>>> timers_;  // in time order
    bool stop_ = false;
    std::thread thread_;  // last: starts after the members above exist
};

namespace {

class SessionReactor;

// The scheduler's handle on one stream; outlives the reactor (detached in OnDone).
class StreamHandle final : public StreamSink, public std::enable_shared_from_this<StreamHandle> {
public:
    StreamHandle(SessionReactor * r, std::shared_ptr<Deliverer> d) : reactor_(r), deliverer_(std::move(d)) {}
    void deliver(pb::SessionResponse resp, bool terminal, grpc::Status status, bool read_next) override;
    void hold(pb::SessionResponse resp, uint32_t flush_at) override;
    void resume() override;
    void finish(grpc::Status status) override;

    void on_write_done(bool ok);
    void on_read_closed() {
        std::lock_guard<std::recursive_mutex> lk(mu_);
        read_closed_ = true;
    }
    void detach() {
        std::lock_guard<std::recursive_mutex> lk(mu_);
        reactor_ = nullptr;
    }
    void pump_now() {
        std::lock_guard<std::recursive_mutex> lk(mu_);
        pump();
    }
    // Sends what hold() keeps once it has waited kHoldMax (the delivery thread's timer).
    void flush_stale(std::chrono::steady_clock::time_point now) {
        std::lock_guard<std::recursive_mutex> lk(mu_);
        if (held_n_ == 0 || finished_ || finish_pending_ || now - held_since_ < kHoldMax) return;
        release_held();
        pump();
    }
    // Tokens are held only while they follow each other within kHoldGap, and none for longer
    // than kHoldMax (a stall: the delivery thread's timer sends them).
    static constexpr std::chrono::milliseconds kHoldGap{50};
    static constexpr std::chrono::milliseconds kHoldMax{50};

private:
    void pump();  // with mu_ held
    // queue what hold() keeps, with mu_ held
    void release_held() {
        if (held_n_ == 0) return;
        out_.push_back(std::move(held_));
        held_ = pb::SessionResponse();
        held_n_ = 0;
    }
    // pump from the delivery thread (the caller may be the scheduler)
    void kick() {
        if (deliverer_) {
            deliverer_->schedule(shared_from_this());
        } else {
            pump();
        }
    }
    std::recursive_mutex mu_;
    SessionReactor * reactor_;
    std::shared_ptr<Deliverer> deliverer_;
    pb::SessionResponse held_;  // generated tokens kept for one answer (hold)
    uint32_t held_n_ = 0;
    std::chrono::steady_clock::time_point last_hold_{};   // when hold() was last called
    std::chrono::steady_clock::time_point held_since_{};  // when the held answer began
    std::deque<pb::SessionResponse> out_;
    pb::SessionResponse writing_;
    grpc::ByteBuffer writing_bytes_;
    bool write_in_flight_ = false;
    bool need_read_ = false;
    bool read_closed_ = false;
    bool finish_pending_ = false;
    bool finished_ = false;
    grpc::Status final_;
};

class SessionReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
public:
    SessionReactor(Scheduler & sched, uint32_t queue_limit, std::shared_ptr<Deliverer> deliverer,
                   std::string client_identity, grpc::CallbackServerContext * ctx)
        : sched_(sched), queue_limit_(queue_limit), ctx_(ctx) {
        handle_ = std::make_shared<StreamHandle>(this, std::move(deliverer));
        handle_->client_identity = std::move(client_identity);
        StartRead(&in_);
    }
    void read_next() {
        in_.Clear();
        StartRead(&in_);
    }
    void OnReadDone(bool ok) override {
        if (!ok) {
            // a client's cancel also fails the read, often before OnCancel: count it cancelled
            handle_->on_read_closed();
            handle_->client_gone = true;
            sched_.post_stream_closed(handle_, ctx_->IsCancelled());
            return;
        }
        const auto t0 = Clock::now();
        auto req = std::make_unique<pb::SessionRequest>();
        const size_t n_bytes = in_.Length();
        const grpc::Status parsed = grpc::SerializationTraits<pb::SessionRequest>::Deserialize(&in_, req.get());
        if (!parsed.ok()) {
            // not a SessionRequest: end the stream INVALID_ARGUMENT with a BAD_REQUEST ShardError
            // (never OK); the scheduler then releases the session the stream was bound to
            pb::SessionResponse r;
            r.mutable_header()->set_schema_version(pb::SCHEMA_VERSION_V1);
            const std::string why = "undecodable frame: " + std::to_string(n_bytes) +
                                    " bytes that are not a dgr.shard.v1.SessionRequest; the stream ends";
            pb::ShardError e = make_error(pb::ERROR_REASON_BAD_REQUEST, why, true);
            *r.mutable_error() = e;
            handle_->client_gone = true;
            handle_->deliver(std::move(r), true, status_with(grpc::StatusCode::INVALID_ARGUMENT, why, e), false);
            sched_.post_stream_closed(handle_, false);
            return;
        }
        if (!sched_.post_frame(handle_, std::move(req), t0)) {
            // queue full: answer here without touching the scheduler (non-terminal)
            pb::SessionResponse r;
            r.mutable_header()->set_schema_version(pb::SCHEMA_VERSION_V1);
            pb::ShardError e = make_error(pb::ERROR_REASON_OVER_BUDGET, "worker queue full; back off and resend this step");
            e.set_limit(queue_limit_);
            *r.mutable_error() = e;
            rejected_queue_++;
            handle_->deliver(std::move(r), false, grpc::Status::OK, true);
        }
    }
    void OnWriteDone(bool ok) override { handle_->on_write_done(ok); }
    void OnCancel() override {
        handle_->client_gone = true;
        sched_.post_stream_closed(handle_, true);
    }
    void OnDone() override {
        handle_->detach();
        delete this;
    }
    static std::atomic<uint64_t> rejected_queue_;

private:
    Scheduler & sched_;
    uint32_t queue_limit_;
    grpc::CallbackServerContext * ctx_;  // outlives this reactor (gRPC frees it after OnDone)
    std::shared_ptr<StreamHandle> handle_;
    grpc::ByteBuffer in_;
};

std::atomic<uint64_t> SessionReactor::rejected_queue_{0};

void StreamHandle::deliver(pb::SessionResponse resp, bool terminal, grpc::Status status, bool read_next) {
    std::lock_guard<std::recursive_mutex> lk(mu_);
    if (finished_ || finish_pending_) return;
    release_held();
    out_.push_back(std::move(resp));
    if (terminal) {
        finish_pending_ = true;
        final_ = status;
    } else if (read_next) {
        need_read_ = true;
    }
    kick();
}

void StreamHandle::hold(pb::SessionResponse resp, uint32_t flush_at) {
    std::lock_guard<std::recursive_mutex> lk(mu_);
    if (finished_ || finish_pending_) return;
    // a token that comes more than kHoldGap after the previous one goes out at once (with what
    // is held): slow generations are not delayed at all
    const auto now = std::chrono::steady_clock::now();
    const bool slow = now - last_hold_ > kHoldGap;
    last_hold_ = now;
    if (slow) flush_at = 1;
    const uint32_t n = (uint32_t) resp.tail().tokens_size();
    if (held_n_ == 0) {
        held_ = std::move(resp);
        held_since_ = now;
        if (n < flush_at && deliverer_) deliverer_->flush_at(weak_from_this(), now + kHoldMax);
    } else {
        // the answer reads as the last step's (step, cached positions), its positions span all
        for (auto & t : *resp.mutable_tail()->mutable_tokens()) *held_.mutable_tail()->add_tokens() = std::move(t);
        const uint32_t start = held_.header().positions().start();
        *held_.mutable_header() = resp.header();
        held_.mutable_header()->mutable_positions()->set_start(start);
    }
    held_n_ += n;
    if (held_n_ >= flush_at) {
        release_held();
        kick();
    }
}

void StreamHandle::resume() {
    std::lock_guard<std::recursive_mutex> lk(mu_);
    need_read_ = true;
    kick();
}

void StreamHandle::finish(grpc::Status status) {
    std::lock_guard<std::recursive_mutex> lk(mu_);
    if (finished_ || finish_pending_) return;
    release_held();
    finish_pending_ = true;
    final_ = status;
    kick();
}

void StreamHandle::on_write_done(bool ok) {
    std::lock_guard<std::recursive_mutex> lk(mu_);
    write_in_flight_ = false;
    if (!ok) {
        // the stream is broken (peer gone); OnCancel/OnReadDone(false) will follow
        out_.clear();
        held_ = pb::SessionResponse();
        held_n_ = 0;
        need_read_ = false;
    }
    pump();
}

void StreamHandle::pump() {
    if (!reactor_ || finished_ || write_in_flight_) return;
    if (!out_.empty()) {
        writing_ = std::move(out_.front());
        out_.pop_front();
        write_in_flight_ = true;
        bool own = false;
        writing_bytes_.Clear();
        grpc::SerializationTraits<pb::SessionResponse>::Serialize(writing_, &writing_bytes_, &own);
        reactor_->StartWrite(&writing_bytes_);
        return;
    }
    if (finish_pending_) {
        finished_ = true;
        reactor_->Finish(final_);
        return;
    }
    if (need_read_ && !read_closed_) {
        need_read_ = false;
        reactor_->read_next();
    }
}

}  // namespace

void Deliverer::schedule(std::shared_ptr<StreamHandle> h) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (!stop_) {
            q_.push_back(std::move(h));
            cv_.notify_one();
            return;
        }
    }
    h->pump_now();
}

void Deliverer::flush_at(std::weak_ptr<StreamHandle> h, std::chrono::steady_clock::time_point when) {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return;
    auto it = timers_.end();   // one delay for all: almost always the last in time order
    while (it != timers_.begin() && std::prev(it)->first > when) --it;
    timers_.emplace(it, when, std::move(h));
    cv_.notify_one();
}

void Deliverer::stop() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (stop_) return;
        stop_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
}

void Deliverer::loop() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
        if (!q_.empty()) {
            std::shared_ptr<StreamHandle> h = std::move(q_.front());
            q_.pop_front();
            lk.unlock();
            h->pump_now();
            lk.lock();
            continue;
        }
        if (stop_) return;  // stopped and drained (held answers go out with their stream's end)
        const auto now = std::chrono::steady_clock::now();
        if (!timers_.empty() && timers_.front().first <= now) {
            std::weak_ptr<StreamHandle> w = std::move(timers_.front().second);
            timers_.pop_front();
            lk.unlock();
            if (auto h = w.lock()) h->flush_stale(now);
            lk.lock();
            continue;
        }
        if (timers_.empty()) {
            cv_.wait(lk);
        } else {
            cv_.wait_until(lk, timers_.front().first);
        }
    }
}

ShardService::ShardService(ModelBackend & backend, Scheduler & scheduler, Metrics & metrics, ServiceInfo rt)
    : backend_(backend), scheduler_(scheduler), metrics_(metrics), rt_(std::move(rt)),
      deliverer_(std::make_shared<Deliverer>()) {}

ShardService::~ShardService() { deliverer_->stop(); }

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> * ShardService::Session(grpc::CallbackServerContext * ctx) {
    std::string who = client_identity_of(*ctx);
    if (rt_.require_client_auth && who.empty()) return refused_stream();
    return new SessionReactor(scheduler_, scheduler_.options().queue_limit, deliverer_, std::move(who), ctx);
}

template <class Req, class Resp>
grpc::ServerUnaryReactor * ShardService::unary(grpc::CallbackServerContext * ctx, const grpc::ByteBuffer * in,
                                               grpc::ByteBuffer * out, UnaryHandler<Req, Resp> handler) {
    auto * reactor = ctx->DefaultReactor();
    if (refuse_unauthenticated(ctx, reactor)) return reactor;
    auto call = std::make_shared<std::pair<Req, Resp>>();
    grpc::ByteBuffer bytes(*in);  // shares the slices; decoding consumes the copy
    const size_t n_bytes = bytes.Length();
    if (!grpc::SerializationTraits<Req>::Deserialize(&bytes, &call->first).ok()) {
        pb::ShardError e = make_error(pb::ERROR_REASON_BAD_REQUEST,
                                      "undecodable request: " + std::to_string(n_bytes) + " bytes that are not a " +
                                          call->first.GetTypeName());
        ctx->AddTrailingMetadata("dgr-error-bin", e.SerializeAsString());
        reactor->Finish(status_for(e));
        return reactor;
    }
    (this->*handler)(ctx, call->first, &call->second, [reactor, out, call](grpc::Status status) {
        if (status.ok()) {
            bool own = false;
            status = grpc::SerializationTraits<Resp>::Serialize(call->second, out, &own);
        }
        reactor->Finish(status);
    });
    return reactor;
}

grpc::ServerUnaryReactor * ShardService::GetCapability(grpc::CallbackServerContext * ctx, const grpc::ByteBuffer * in,
                                                       grpc::ByteBuffer * out) {
    return unary<pb::GetCapabilityRequest, pb::GetCapabilityResponse>(ctx, in, out, &ShardService::on_get_capability);
}

grpc::ServerUnaryReactor * ShardService::ReleaseSession(grpc::CallbackServerContext * ctx, const grpc::ByteBuffer * in,
                                                        grpc::ByteBuffer * out) {
    return unary<pb::ReleaseSessionRequest, pb::ReleaseSessionResponse>(ctx, in, out,
                                                                         &ShardService::on_release_session);
}

grpc::ServerUnaryReactor * ShardService::CancelSession(grpc::CallbackServerContext * ctx, const grpc::ByteBuffer * in,
                                                       grpc::ByteBuffer * out) {
    return unary<pb::CancelSessionRequest, pb::CancelSessionResponse>(ctx, in, out, &ShardService::on_cancel_session);
}

grpc::ServerUnaryReactor * ShardService::GetMetrics(grpc::CallbackServerContext * ctx, const grpc::ByteBuffer * in,
                                                    grpc::ByteBuffer * out) {
    return unary<pb::GetMetricsRequest, pb::GetMetricsResponse>(ctx, in, out, &ShardService::on_get_metrics);
}

grpc::ServerUnaryReactor * ShardService::Tokenize(grpc::CallbackServerContext * ctx, const grpc::ByteBuffer * in,
                                                  grpc::ByteBuffer * out) {
    return unary<pb::TokenizeRequest, pb::TokenizeResponse>(ctx, in, out, &ShardService::on_tokenize);
}

grpc::ServerUnaryReactor * ShardService::Detokenize(grpc::CallbackServerContext * ctx, const grpc::ByteBuffer * in,
                                                    grpc::ByteBuffer * out) {
    return unary<pb::DetokenizeRequest, pb::DetokenizeResponse>(ctx, in, out, &ShardService::on_detokenize);
}

grpc::ServerUnaryReactor * ShardService::ApplyChatTemplate(grpc::CallbackServerContext * ctx, const grpc::ByteBuffer * in,
                                                           grpc::ByteBuffer * out) {
    return unary<pb::ApplyChatTemplateRequest, pb::ApplyChatTemplateResponse>(ctx, in, out,
                                                                               &ShardService::on_apply_chat_template);
}

void ShardService::on_get_capability(grpc::CallbackServerContext *, const pb::GetCapabilityRequest &,
                                     pb::GetCapabilityResponse * resp, UnaryDone done) {
    *resp = scheduler_.capability();
    auto * r = resp->mutable_runtime();
    r->set_dgr_version(rt_.dgr_version);
    r->set_llama_commit(rt_.llama_commit);
    r->set_patch_digest(rt_.patch_digest);
    r->set_backend(rt_.backend);
    if (rt_.device_memory) {
        uint64_t free = 0, total = 0;
        rt_.device_memory->get(&free, &total);
        if (total) {
            resp->mutable_device()->set_memory_free_bytes(free);
            resp->mutable_device()->set_memory_total_bytes(total);
        }
    }
    done(grpc::Status::OK);
}

void ShardService::on_release_session(grpc::CallbackServerContext *, const pb::ReleaseSessionRequest & req,
                                      pb::ReleaseSessionResponse * resp, UnaryDone done) {
    scheduler_.post_release(req, [resp, done](pb::ReleaseSessionResponse r) {
        *resp = std::move(r);
        done(grpc::Status::OK);
    });
}

void ShardService::on_cancel_session(grpc::CallbackServerContext *, const pb::CancelSessionRequest & req,
                                     pb::CancelSessionResponse * resp, UnaryDone done) {
    scheduler_.post_cancel(req, [resp, done](pb::CancelSessionResponse r) {
        *resp = std::move(r);
        done(grpc::Status::OK);
    });
}

std::vector<prometheus::MetricFamily> ShardService::metric_families() const {
    metrics_.rejected_queue = SessionReactor::rejected_queue_.load();
    Gauges g = scheduler_.gauges();
    if (rt_.device_memory) {
        uint64_t free = 0, total = 0;
        rt_.device_memory->get(&free, &total);
        if (total) {
            g.device_memory_free_bytes = free;
            g.device_memory_total_bytes = total;
        }
    }
    return metrics_.families(g);
}

void ShardService::on_get_metrics(grpc::CallbackServerContext *, const pb::GetMetricsRequest &,
                                  pb::GetMetricsResponse * resp, UnaryDone done) {
    const Gauges g = scheduler_.gauges();
    auto * l = resp->mutable_load();
    l->set_active_sessions(g.active_sessions);
    l->set_kv_cells_used(g.kv_cells_used);
    l->set_kv_cells_total(g.kv_cells_total);
    l->set_queued_steps(g.queued_steps);
    for (const auto & s : Metrics::samples(metric_families())) {
        auto * ms = resp->add_samples();
        ms->set_name(s.name);
        for (const auto & kv : s.labels) (*ms->mutable_labels())[kv.first] = kv.second;
        ms->set_value(s.value);
    }
    done(grpc::Status::OK);
}

std::vector<prometheus::MetricFamily> ShardService::prometheus_families() const {
    std::vector<prometheus::MetricFamily> f = metric_families();
    prometheus::MetricFamily info;
    info.name = "dgr_worker_info";
    info.help = "Build of this worker (always 1).";
    info.type = prometheus::MetricType::Gauge;
    prometheus::ClientMetric m;
    m.label = {{"backend", rt_.backend}, {"llama_commit", rt_.llama_commit}, {"version", rt_.dgr_version}};
    m.gauge.value = 1;
    info.metric.push_back(std::move(m));
    f.push_back(std::move(info));
    return f;
}

void ShardService::on_tokenize(grpc::CallbackServerContext * ctx, const pb::TokenizeRequest & req,
                               pb::TokenizeResponse * resp, UnaryDone done) {
    std::vector<int32_t> ids;
    std::string err;
    if (req.text().size() > (1u << 20)) {
        pb::ShardError e = make_error(pb::ERROR_REASON_MESSAGE_TOO_LARGE, "text above 1 MiB");
        e.set_limit(1u << 20);
        ctx->AddTrailingMetadata("dgr-error-bin", e.SerializeAsString());
        done(status_for(e));
        return;
    }
    if (!backend_.tokenize(req.text(), req.add_special(), req.parse_special(), &ids, &err)) {
        pb::ShardError e = make_error(pb::ERROR_REASON_BAD_REQUEST, "tokenize failed: " + err);
        ctx->AddTrailingMetadata("dgr-error-bin", e.SerializeAsString());
        done(status_for(e));
        return;
    }
    for (int32_t t : ids) resp->add_token_ids(t);
    done(grpc::Status::OK);
}

void ShardService::on_detokenize(grpc::CallbackServerContext * ctx, const pb::DetokenizeRequest & req,
                                 pb::DetokenizeResponse * resp, UnaryDone done) {
    const uint32_t n_vocab = backend_.info().n_vocab;
    std::vector<int32_t> ids(req.token_ids().begin(), req.token_ids().end());
    for (int32_t t : ids) {
        if (t < 0 || (uint32_t) t >= n_vocab) {
            pb::ShardError e = make_error(pb::ERROR_REASON_TOKEN_OUT_OF_VOCAB,
                                          "token id " + std::to_string(t) + " outside [0, " + std::to_string(n_vocab) + ")");
            ctx->AddTrailingMetadata("dgr-error-bin", e.SerializeAsString());
            done(status_for(e));
            return;
        }
    }
    resp->set_text(backend_.detokenize(ids, req.remove_special(), req.unparse_special()));
    if (req.include_pieces()) {
        for (int32_t t : ids) resp->add_pieces(backend_.piece(t, req.unparse_special()));
    }
    done(grpc::Status::OK);
}

}  // namespace dgr::worker
